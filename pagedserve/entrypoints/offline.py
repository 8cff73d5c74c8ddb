"""The offline engine: the scheduler, block manager and model runner of the services, in one process.

The scheduler's engine loop drives the steps on the caller's thread. With async_scheduling (the default)
the model is loaded on a worker thread of its own and runs each step there while the loop plans the next one,
as the services do; without, each step runs to its end before the next is planned.

    from pagedserve import LLM, SamplingParams
    llm = LLM()                      # the default model (SmolLM2-135M-Instruct) on the CPU
    [result] = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(result.text)
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from executor_svc.build import build_model_runner
from executor_svc.server import executor_info
from kvcache_svc.build import build_block_manager
from pagedserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedserve.chat import load_chat_template, render_chat
from pagedserve.config import CacheConfig, ModelConfig, PagedServeConfig, SchedulerConfig
from pagedserve.output import RequestOutputState, Usage
from pagedserve.sampling_params import SamplingParams, generation_config_defaults
from pagedserve.step import SampledToken, one_executor
from scheduler_svc.build import build_scheduler
from scheduler_svc.engine_loop import CompletedCall, EngineLoop
from scheduler_svc.request import Request


Prompt = str | Sequence[int]


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    # Up to and including the token that completed a stop string, as the Generate API streams them.
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[SampledToken] | None = None
    usage: Usage | None = None
    index: int = 0  # which of the prompt's n choices (SamplingParams.n)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (it has no logprob).
    prompt_logprobs: list[SampledToken | None] | None = None


class LLM:
    """Takes the options of ModelConfig, CacheConfig and SchedulerConfig (pagedserve/config.py) by name."""

    def __init__(self, model: str = ModelConfig.model, **options) -> None:
        from transformers import AutoTokenizer

        self.config = PagedServeConfig.from_kwargs(
            "LLM", (ModelConfig, CacheConfig, SchedulerConfig), model=model, **options
        )
        model_config, cache_config = self.config.model_config, self.config.cache_config
        async_scheduling = self.config.scheduler_config.async_scheduling
        if async_scheduling:
            # One thread loads the model and runs every step. torch's OpenMP pool belongs to the thread that uses
            # it: a second pool (the loading thread's) makes libgomp count more threads than cores, and its
            # workers then spin only briefly between operators, sleeping and being woken around each one.
            # A device named by index is made the thread's current one; plain "cuda" is already (device 0).
            device = torch.device(model_config.resolved_device())
            by_index = device.type == "cuda" and device.index is not None
            initializer = (lambda: torch.cuda.set_device(device)) if by_index else None
            self._steps = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-steps", initializer=initializer)
            self.runner = self._steps.submit(
                build_model_runner, model_config, cache_config, self.config.scheduler_config).result()
        else:
            self.runner = build_model_runner(model_config, cache_config, self.config.scheduler_config)
        # The cores meet here as they do in the services: through what the executor reports.
        info = executor_info(self.runner)
        self.block_manager = build_block_manager(cache_config, info)
        self.scheduler = build_scheduler(self.config.scheduler_config, info, one_executor(self.block_manager.step))
        if async_scheduling:
            submit = lambda step: self._steps.submit(self.runner.execute, step)  # noqa: E731
        else:
            submit = lambda step: CompletedCall(self.runner.execute, step)  # noqa: E731
        self.engine = EngineLoop(self.scheduler, submit, publish=lambda outputs: None,
                                 executor_epoch=lambda: info.epoch, async_scheduling=async_scheduling)
        # A checkpoint without tokenizer files still serves prompts given as token ids (text stays "").
        tokenizer_dir = Path(model_config.tokenizer or self.runner.model_dir)
        has_tokenizer = any((tokenizer_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if has_tokenizer else None
        if self.tokenizer is not None and model_config.chat_template:
            self.tokenizer.chat_template = load_chat_template(model_config.chat_template)
        self.eos_token_ids = self.runner.eos_token_ids
        # Read once, so that a bad generation_config.json is refused here rather than at a first generate().
        self._default_sampling = generation_config_defaults(model_config.generation_config, self.runner.model_dir)
        self._request_ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() sample with when given no SamplingParams: the model's generation config's
        (ModelConfig.generation_config), else SamplingParams' defaults, as vLLM's LLM."""
        return SamplingParams(**self._default_sampling)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[GenerationResult]:
        """Generates for every prompt (text, or a list of token ids) as one continuous batch.

        Returns one result per prompt and choice: the prompts in input order, each with its n choices
        (SamplingParams.n) in index order. A prompt's choices share its prefill: the first one goes alone,
        the others are added once it has sampled, and find its prompt in the prefix cache. Requests with
        different ``cache_salt`` values never share prefix-cache blocks. priority: one per prompt, lower first
        (with scheduling_policy="priority").
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            [sampling_params] * len(prompt_list) if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(
                f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts"
            )
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompt_list)} prompts")
        results: dict[str, GenerationResult] = {}
        states: dict[str, RequestOutputState] = {}
        siblings: dict[str, list[Request]] = {}  # choice 0's id -> the other choices, added once it has sampled
        prompt_choices: list[list[str]] = []
        for params in params_list:
            if params.bad_words:
                if self.tokenizer is None:
                    raise ValueError("bad_words need the model's tokenizer, and this model has none")
                params.tokenize_bad_words(self.tokenizer)
            params.check_token_ids(self.runner.config.vocab_size)
            params.check_allowed_tokens(self.runner.eos_token_ids)
        for prompt, params, request_priority in zip(prompt_list, params_list, priorities):
            token_ids = params.truncated(self._tokenize(prompt), self.max_model_len)
            choices = []
            for index in range(params.n):
                request_id = str(next(self._request_ids))
                choice = params.for_choice(index)
                states[request_id] = RequestOutputState(self.tokenizer, token_ids, choice)
                choices.append(Request(request_id, token_ids, choice, self.eos_token_ids, self.max_model_len,
                                       cache_salt, priority=request_priority))
                results[request_id] = GenerationResult(
                    request_id, token_ids, logprobs=[] if params.logprobs is not None else None, index=index
                )
            self.scheduler.add_request(choices[0])
            siblings[choices[0].request_id] = choices[1:]
            prompt_choices.append([request.request_id for request in choices])

        while self.engine.has_work():
            for output in self.engine.step():
                for sibling in siblings.pop(output.request_id, []):
                    self.scheduler.add_request(sibling)
                result = results[output.request_id]
                result.token_ids.extend(output.new_token_ids)
                if output.new_logprobs is not None and result.logprobs is not None:
                    result.logprobs.extend(output.new_logprobs)
                if output.prompt_logprobs is not None:
                    result.prompt_logprobs = [None] + output.prompt_logprobs
                # The same output processing as the Generate API's streams, so the two agree on text.
                delta = states[output.request_id].update(output.new_token_ids, output.finish_reason)
                if delta.abort:
                    self.scheduler.abort_request(output.request_id)
                result.text += delta.text
                result.finish_reason = delta.finish_reason
                result.usage = delta.usage
        ordered = []
        for choice_ids in prompt_choices:
            first = results[choice_ids[0]]
            for request_id in choice_ids:
                if first.prompt_logprobs is not None:  # asked of the first choice only; the prompt is theirs too
                    results[request_id].prompt_logprobs = first.prompt_logprobs
                ordered.append(results[request_id])
        return ordered

    def chat(
        self,
        conversations: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[GenerationResult]:
        """Applies the model's chat template to each conversation (a list of {role, content}) and generates;
        the options are pagedserve/chat.py's (tools: OpenAI's function definitions, for a template that shows
        them; the answer is text)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        # Token ids, not text: the template writes its own special tokens, which generate() would add again.
        prompts = [self._encode(render_chat(self.tokenizer, list(messages), add_generation_prompt,
                                            continue_final_message, chat_template_kwargs, tools),
                                add_special_tokens=False) for messages in conversations]
        return self.generate(prompts, sampling_params)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search (pagedserve/beam_search.py): each step, every live beam of every prompt is one
        generate() row of one token whose top 2 x beam_width logprobs are its candidates; their shared prefixes come
        from the prefix cache. A text prompt is tokenized as generate() tokenizes it."""
        prompt_list = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else prompts
        prompt_ids = [self._tokenize(prompt) for prompt in prompt_list]
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        searches = [BeamSearch(len(ids), params.beam_width, params.max_tokens, eos, params.length_penalty,
                               params.ignore_eos) for ids in prompt_ids]
        while running := [(search, ids) for search, ids in zip(searches, prompt_ids) if not search.done]:
            rows = [ids + beam.tokens for search, ids in running for beam in search.live]
            step = running[0][0].step_params(params.temperature)
            tokens = iter(result.logprobs[0] for result in self.generate(rows, step))
            for search, _ in running:
                search.advance_sampled([next(tokens) for _ in search.live])
        return [BeamSearchOutput([BeamSearchSequence(
            ids + beam.tokens, self._decode(beam.tokens[:-1] if beam.finished else beam.tokens),
            beam.cumulative_logprob, "stop" if beam.finished else "length") for beam in search.best()])
            for search, ids in zip(searches, prompt_ids)]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            return self._encode(prompt, add_special_tokens=True)  # a BOS where the tokenizer adds one, as vLLM's
        token_ids = list(prompt)
        vocab_size = self.runner.config.vocab_size
        for token_id in token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}), got {token_id!r}")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        return token_ids

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if max(token_ids, default=0) >= self.runner.config.vocab_size:  # a tokenizer larger than the model
            raise ValueError(f"the prompt tokenizes to id {max(token_ids)}, beyond the model's vocabulary "
                             f"({self.runner.config.vocab_size})")
        return token_ids


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
