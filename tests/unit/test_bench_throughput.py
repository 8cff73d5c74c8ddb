"""bench/throughput.py's clocks on the model's parts: they time the linear layers and attention in place and
change nothing the model computes."""
from __future__ import annotations

from bench import kernel
from bench.throughput import clock_model_parts
from executor_svc.model_runner import ModelRunner
from pagedserve.config import CacheConfig, ModelConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteRequest, ExecuteStep, SampledToken

TINY = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=50, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True)


def prefill(runner: ModelRunner, request_id: str, prompt: list[int], finished: str | None = None) -> SampledToken:
    """The token sampled after the prompt, with its logprobs, from one step of a fresh request on the pool's first
    blocks (the request `finished`, which held them, ends in the same step)."""
    blocks = list(range(-(-len(prompt) // runner.block_size)))
    step = ExecuteStep([ExecuteRequest(request_id=request_id, token_ids=prompt, start_position=0, new_block_ids=blocks,
                                       sample=True, prompt_len=len(prompt),
                                       sampling_params=SamplingParams(temperature=0, max_tokens=4, logprobs=3))],
                       executor_epoch=runner.epoch, finished_request_ids=[finished] if finished else [])
    result = runner.execute(step)
    assert not result.rejected
    return result.sampled[request_id]


def test_the_clocks_time_linear_layers_and_attention_and_leave_the_answer_alone(tmp_path):
    kernel.write_random_qwen2(tmp_path, TINY, device="cpu")
    runner = ModelRunner(ModelConfig(str(tmp_path), dtype="float32", device="cpu"),
                         CacheConfig(block_size=16, kv_cache_memory=1 << 20))
    prompt = [(7 * i) % 50 for i in range(40)]
    before = prefill(runner, "a", prompt)
    seconds = clock_model_parts(runner.model)
    assert seconds == {"linear": 0.0, "attention": 0.0}
    after = prefill(runner, "b", prompt, finished="a")
    assert (after.token_id, after.logprob, after.top_logprobs) == (before.token_id, before.logprob, before.top_logprobs)
    assert seconds["linear"] > 0 and seconds["attention"] > 0
    linear, attention = seconds["linear"], seconds["attention"]
    prefill(runner, "c", prompt, finished="b")  # every call adds up
    assert seconds["linear"] > linear and seconds["attention"] > attention
