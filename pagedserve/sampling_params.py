"""Per-request sampling and stopping parameters, with vLLM's names and defaults.

Validated on construction so that a bad value fails where the user wrote it, with the field named.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

# Beyond this many top logprobs per token the cost is all copying; vLLM caps at 20 as well.
MAX_LOGPROBS = 20
# Every stop string is searched for in every text delta, so their number is bounded.
MAX_STOP_STRINGS = 16
# OpenAI's bounds: a bias of +-100 already bans or forces a token, and the penalties' range is theirs.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_PENALTY = 2.0
# A choice request's strings become one grammar, compiled per request.
MAX_CHOICES = 256
# As many token ids as the largest vocabularies hold (Gemma 3's): a request cannot make the sampler build more.
MAX_ALLOWED_TOKEN_IDS = 1 << 18
# The fields that ask for a structure given as text or a list (json_object, a flag, is the other kind).
STRUCTURE_FIELDS = ("json_schema", "regex", "choice", "grammar")
# Every bad word's token sequences are matched against the output's tail at every step.
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
# Siblings share one prompt's prefill; each is a request of its own in the back end.
MAX_N = 16
# Seeds are int64 on the wire.
SEED_MODULUS = 1 << 63
# The integers the wire holds: int32, and for a seed int64 or the unsigned 64 bits it stands for (the sampler
# reads only the bits).
INT32_RANGE = (-(1 << 31), 1 << 31)
SEED_RANGE = (-(1 << 63), 1 << 64)
# Below this temperature sampling is greedy, as in vLLM: dividing logits by a temperature of 1e-38 would
# overflow them to infinities, whose softmax is NaN.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)  # the text is cut where the first one completes
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # return the chosen token's logprob and this many top logprobs
    # Return the logprob of every prompt token after the first (which has none) and this many top logprobs
    # for each, computed with the prompt: such a request is never served from the prefix cache.
    prompt_logprobs: int | None = None
    # vLLM's (and OpenAI's) penalties: presence and frequency over the output tokens, repetition over the
    # prompt and output tokens (logits divided by it when positive, multiplied when negative).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # vLLM's: only these tokens may be sampled (None: any).
    allowed_token_ids: list[int] | None = None
    # vLLM's: words that must not be generated. Where token ids become text (the frontend, the offline LLM)
    # they are tokenized into bad_words_token_ids (tokenize_bad_words), which is what the executor acts on: a
    # sequence's last token is banned wherever the output ends in the rest of it (one token: always).
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Structured output: the output is JSON that validates against this schema (JSON text), or any JSON
    # object with json_object; the executor masks every token the grammar does not allow.
    json_schema: str | None = None
    json_object: bool = False
    # Or the output matches this regular expression, is exactly one of these strings, or is a sentence of this
    # EBNF grammar (xgrammar's dialect, GBNF-like, from `root`) (vLLM's guided_regex, guided_choice and
    # guided_grammar); at most one kind of structure per request.
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # Choices from one prompt. The frontend turns them into n requests of one choice each (sharing the
    # prompt's KV blocks); the scheduler and the executor only ever see n = 1.
    n: int = 1
    # Output processing (pagedserve.output), applied where token ids become text; the scheduler and
    # the executor never look at these.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: only the prompt's last k tokens are used (left truncation), applied where the prompt is tokenized;
    # -1: as many as the context holds with room for max_tokens (1 without it).
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, SEED_RANGE)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        # A bare string would be taken apart into one-character stop strings.
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a list of strings")
        self.stop = list(self.stop)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if not all(self.stop):
            raise ValueError("stop strings must not be empty")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id)
            if token_id < 0:
                raise ValueError(f"stop_token_ids must be non-negative token ids, got {token_id}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= MAX_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_PENALTY:g}], got {self.repetition_penalty}")
        self._check_logit_bias()
        self._check_allowed_and_bad_words()
        self._check_structure()
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}")
        _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")

    def _check_structure(self) -> None:
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise ValueError(f"json_schema must be a JSON text, got {type(self.json_schema).__name__}")
        _check_bool("json_object", self.json_object)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("grammar must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a list of non-empty strings")
            if not 1 <= len(self.choice) <= MAX_CHOICES:
                raise ValueError(f"choice takes 1 to {MAX_CHOICES} strings, got {len(self.choice)}")
            self.choice = list(self.choice)
        given = [name for name in STRUCTURE_FIELDS if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are exclusive: one structure per request")
        # A grammar's mask and the allowed tokens could leave no token at all to sample.
        if given and self.allowed_token_ids is not None:
            raise ValueError(f"allowed_token_ids and {given[0]} are exclusive: a structure decides the tokens")

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must map token ids to numbers")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(self.logit_bias)}")
        bias = {}
        for token_id, value in self.logit_bias.items():
            # JSON object keys are strings: OpenAI's clients send {"50256": -100}.
            if isinstance(token_id, str) and token_id.isascii() and token_id.isdigit():  # not "²", not "١٢"
                token_id = int(token_id)
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token_id!r}")
            _check_number("logit_bias", value)
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value}")
            bias[token_id] = float(value)
        self.logit_bias = bias

    def _check_allowed_and_bad_words(self) -> None:
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids takes at most {MAX_ALLOWED_TOKEN_IDS} token ids, "
                                 f"got {len(self.allowed_token_ids)}")
            for token_id in self.allowed_token_ids:
                _check_int("allowed_token_ids", token_id)
                if token_id < 0:
                    raise ValueError(f"allowed_token_ids must be non-negative token ids, got {token_id}")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in self.bad_words):
            raise ValueError("bad_words must be a list of strings")
        self.bad_words = list(self.bad_words)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words takes at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
        if not all(w.strip() and len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words):
            raise ValueError(f"bad_words must be words of 1 to {MAX_BAD_WORD_CHARS} characters, not blank")
        sequences = self.bad_words_token_ids
        if (not isinstance(sequences, (list, tuple)) or len(sequences) > 2 * MAX_BAD_WORDS
                or not all(isinstance(s, (list, tuple)) and 0 < len(s) <= MAX_BAD_WORD_CHARS for s in sequences)):
            raise ValueError(f"bad_words_token_ids must be at most {2 * MAX_BAD_WORDS} non-empty token id lists")
        for sequence in sequences:
            for token_id in sequence:
                _check_int("bad_words_token_ids", token_id)
                if token_id < 0:
                    raise ValueError(f"bad_words_token_ids must be non-negative token ids, got {token_id}")
        self.bad_words_token_ids = [list(s) for s in sequences]

    def tokenize_bad_words(self, tokenizer) -> None:
        """bad_words_token_ids from bad_words, as vLLM tokenizes them: each word (leading spaces dropped) alone,
        and after a space where that gives another first token in as many tokens (a word both at the start
        and inside the text)."""
        sequences = []
        for word in self.bad_words:
            alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not alone:  # (a tokenizer that drops the word entirely has nothing to ban)
                continue
            sequences.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        self.bad_words_token_ids = sequences

    def check_token_ids(self, vocab_size: int) -> None:
        """Refuses token ids the model has no logit for (a ValueError naming the field)."""
        beyond = [t for t in self.stop_token_ids if t >= vocab_size]
        if beyond:
            raise ValueError(f"stop_token_ids must be below the vocabulary size ({vocab_size}), got {beyond[0]}")
        beyond = [t for t in self.logit_bias if t >= vocab_size]
        if beyond:
            raise ValueError(f"logit_bias token ids must be below the vocabulary size ({vocab_size}), got {beyond[0]}")
        beyond = [t for t in self.allowed_token_ids or [] if t >= vocab_size]
        if beyond:
            raise ValueError(f"allowed_token_ids must be below the vocabulary size ({vocab_size}), got {beyond[0]}")
        beyond = [t for s in self.bad_words_token_ids for t in s if t >= vocab_size]
        if beyond:
            raise ValueError(f"bad_words tokenize to ids beyond the vocabulary size ({vocab_size}): {beyond[0]}")

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's token ids as truncate_prompt_tokens leaves them."""
        keep = self.truncate_prompt_tokens
        if keep == -1:
            keep = max(max_model_len - (self.max_tokens or 1), 1)
        return prompt_ids if keep is None or len(prompt_ids) <= keep else prompt_ids[len(prompt_ids) - keep:]

    def check_allowed_tokens(self, eos_token_ids=()) -> None:
        """Refuses allowed_token_ids that are all banned from the first token on (one-token bad words; the stop
        tokens, EOS among them unless ignore_eos, while min_tokens holds them back): nothing could be sampled."""
        if self.allowed_token_ids is None:
            return
        banned = {s[0] for s in self.bad_words_token_ids if len(s) == 1}
        if self.min_tokens:
            banned.update(self.stop_token_ids, () if self.ignore_eos else eos_token_ids)
        if set(self.allowed_token_ids) <= banned:
            raise ValueError("allowed_token_ids are all banned (by bad_words, or as stop tokens before min_tokens): "
                             "nothing could be sampled")

    def for_choice(self, index: int) -> "SamplingParams":
        """What choice `index` of n runs with: one choice each, seeded choices seeded apart (so that they differ
        and are each reproducible), and the prompt's logprobs asked of the first choice only (the others get
        its prompt from the prefix cache)."""
        seed = None if self.seed is None else (self.seed + index) % SEED_MODULUS
        return dataclasses.replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def structured(self) -> bool:
        return self.json_object or any(getattr(self, name) is not None for name in STRUCTURE_FIELDS)

    def grammar_source(self) -> tuple[str, str]:
        """A structured request's grammar as (kind, source): ("json_schema", schema text), ("json_object", ""),
        ("regex", pattern), or ("ebnf", the grammar given, or that of the choices: one string literal each)."""
        if self.json_object:
            return "json_object", ""
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "ebnf", self.grammar
        # JSON string literals are xgrammar's EBNF literals (the same escapes).
        return "ebnf", "root ::= " + " | ".join(json.dumps(choice) for choice in self.choice)

    @property
    def needs_token_history(self) -> bool:
        """The executor must see every token of the request (penalties count them, a grammar follows the
        output, bad words are matched against its tail), including those of a cached prefix that it never
        computes."""
        return self.has_penalties or self.structured or bool(self.bad_words_token_ids)


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__}")


def _check_int(name: str, value: object, bounds: tuple[int, int] = INT32_RANGE) -> None:
    """An integer within [low, high): what its field on the wire holds, so that the services never meet one
    protobuf cannot."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    low, high = bounds
    if not low <= value < high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}), got {value}")


# The sampling fields of a generation_config.json that vLLM takes as the model's defaults (its
# `--generation-config auto`), by SamplingParams' names: its max_new_tokens is max_tokens.
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_config_defaults(setting: str, model_dir: str | Path | None) -> dict:
    """The default sampling parameters `setting` (ModelConfig.generation_config) names, by SamplingParams' names:
    `auto`, those the model's generation_config.json sets; `vllm`, none (SamplingParams' own); else those of the
    generation_config.json in that directory. A request's fields left unset take them, and max_tokens caps a
    request's own, as in vLLM. Checked as SamplingParams checks them; a directory without the file sets none."""
    if setting == "vllm" or (setting == "auto" and model_dir is None):
        return {}
    path = Path(model_dir if setting == "auto" else setting) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"generation_config: {path} is not readable JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"generation_config: {path} does not hold a JSON object")
    defaults = {ours: config[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items()
                if config.get(theirs) is not None}
    # JSON writes 1.0 as 1 at times; the float fields take it.
    defaults.update({name: float(value) for name, value in defaults.items()
                     if name not in ("top_k", "max_tokens") and type(value) is int})
    try:
        SamplingParams(**defaults)
    except ValueError as error:
        raise ValueError(f"generation_config: {path}: {error}") from None
    return defaults
