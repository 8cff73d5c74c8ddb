"""The offline LLM end to end: the default model against transformers, and the engine's guarantees."""
from __future__ import annotations

import json
import random

import pytest
import torch

from pagedserve import LLM, SamplingParams

CHAT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works to a ten year old.",
    "Describe the water cycle in detail.",
    "Give me five tips for learning to cook.",
]


@pytest.fixture(scope="module")
def smollm2():
    return LLM("default", device="cpu", dtype="float32", kv_cache_memory=128 << 20)


def test_default_model_greedy_matches_transformers_token_for_token(smollm2):
    from transformers import AutoModelForCausalLM

    results = smollm2.chat(
        [[{"role": "user", "content": p}] for p in CHAT_PROMPTS], SamplingParams(temperature=0, max_tokens=48)
    )
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2.runner.model_dir, dtype=torch.float32).eval()
    for result in results:
        assert len(result.token_ids) >= 32, result.text
        prompt = torch.tensor([result.prompt_token_ids])
        with torch.no_grad():
            expected = hf_model.generate(prompt, do_sample=False, max_new_tokens=48)[0, prompt.shape[1]:]
        assert result.token_ids == expected.tolist()
        assert result.text == smollm2.tokenizer.decode(expected, skip_special_tokens=True)


def test_chat_answers_sensibly(smollm2):
    [result] = smollm2.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=24)
    )
    assert "Paris" in result.text
    assert result.finish_reason == "stop"


def test_results_come_back_in_input_order_for_text_and_token_prompts(smollm2):
    token_prompt = smollm2.tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=5)
    batch = smollm2.generate(["Once upon a time", token_prompt, "1, 2, 3,"], params)
    alone = [smollm2.generate(p, params)[0] for p in ["Once upon a time", token_prompt, "1, 2, 3,"]]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    assert batch[1].prompt_token_ids == token_prompt


def test_bad_prompts_raise_value_errors_naming_the_problem(smollm2):
    with pytest.raises(ValueError, match="empty"):
        smollm2.generate("", SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        smollm2.generate([[1, 2, 10**9]], SamplingParams())
    with pytest.raises(ValueError, match="sampling_params"):
        smollm2.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(ValueError, match="context length"):
        smollm2.generate([[5] * smollm2.max_model_len], SamplingParams())


def test_logprobs_are_the_models_own(smollm2):
    [result] = smollm2.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=3))
    assert len(result.logprobs) == 4
    full = torch.tensor([result.prompt_token_ids + result.token_ids])
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(smollm2.runner.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf_model(full).logits[0].float().log_softmax(-1)
    start = len(result.prompt_token_ids) - 1
    for i, (token_id, entry) in enumerate(zip(result.token_ids, result.logprobs)):
        row = logits[start + i]
        assert entry.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
        assert entry.top_token_ids[0] == token_id  # greedy picks the top token
        assert entry.top_logprobs == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


# ----------------------------------------------------------------------------- tiny random model


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", dtype="float32", kv_cache_memory=4 << 20)


def random_token_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 150) for _ in range(rng.randint(5, 40))] for _ in range(count)]


def test_preemption_under_a_quarter_pool_leaves_greedy_outputs_unchanged(tiny_llama_dir, tiny_llm):
    prompts = random_token_prompts(32, seed=0)
    # Logprobs make the comparison sensitive: a tiny random model's greedy tokens barely depend on context.
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    unconstrained = tiny_llm.generate(prompts, params)
    assert tiny_llm.scheduler.num_preemptions == 0

    block_size = 16
    needed_blocks = sum(-(-(len(p) + 24) // block_size) for p in prompts)
    bytes_per_block = tiny_llm.runner.config.kv_bytes_per_token(torch.float32) * block_size
    constrained_llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32",
                          kv_cache_memory=(needed_blocks // 4) * bytes_per_block)
    assert constrained_llm.runner.num_blocks == needed_blocks // 4
    constrained = constrained_llm.generate(prompts, params)
    assert constrained_llm.scheduler.num_preemptions > 0
    assert [r.token_ids for r in constrained] == [r.token_ids for r in unconstrained]
    for a, b in zip(constrained, unconstrained):
        assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-4)
    assert all(r.finish_reason == "length" for r in constrained)


def test_seeded_sampling_is_the_same_alone_and_in_any_batch(tiny_llm):
    prompts = random_token_prompts(6, seed=1)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    [alone] = tiny_llm.generate([prompts[0]], seeded)
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 5
    batched = tiny_llm.generate(prompts[1:4] + [prompts[0]] + prompts[4:], others[:3] + [seeded] + others[3:])
    assert batched[3].token_ids == alone.token_ids
    [again] = tiny_llm.generate([prompts[0]], seeded)
    assert again.token_ids == alone.token_ids


def test_min_tokens_holds_back_stop_tokens(tiny_llm):
    prompt = random_token_prompts(1, seed=2)[0]
    [free] = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    first = free.token_ids[0]
    [stopped] = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first]))
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    # With min_tokens the stop token cannot be sampled for the first 3 tokens, so greedy picks another.
    [held] = tiny_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=3, stop_token_ids=[first])
    )
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3


def test_prompts_without_a_tokenizer_must_be_token_ids(tiny_llm):
    with pytest.raises(ValueError, match="token ids"):
        tiny_llm.generate("some text", SamplingParams())
    [result] = tiny_llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(result.token_ids) == 3 and result.text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        tiny_llm.generate([[3, 4, 5]], SamplingParams(stop=["x"]))


def test_steps_planned_ahead_give_the_outputs_of_one_step_at_a_time(smollm2):
    """The same batch with and without async scheduling: greedy tokens, texts and finish reasons alike,
    including a structured request, whose grammar accepts its end a step before the engine knows it."""
    sync = LLM("default", device="cpu", dtype="float32", kv_cache_memory=128 << 20, async_scheduling=False)
    assert smollm2.config.scheduler_config.async_scheduling and not sync.config.scheduler_config.async_scheduling
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    conversations = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS[:2]]
    conversations.append([{"role": "user", "content": "Describe a person as JSON with a name and an age."}])
    params = [SamplingParams(temperature=0, max_tokens=40, stop=["\n\n"]), SamplingParams(temperature=0, max_tokens=40),
              SamplingParams(temperature=0, max_tokens=64, json_schema=json.dumps(person))]
    results = [llm.chat(conversations, params) for llm in (smollm2, sync)]
    for ahead, one_by_one in zip(*results):
        assert (ahead.token_ids, ahead.text, ahead.finish_reason) == (
            one_by_one.token_ids, one_by_one.text, one_by_one.finish_reason)
    structured = results[0][2]
    assert structured.finish_reason == "stop" and set(json.loads(structured.text)) == {"name", "age"}
    # Every block came back (the step planned ahead for a finished request included).
    manager = smollm2.block_manager
    assert manager.num_requests == 0 and manager.num_free_blocks == manager.num_blocks
