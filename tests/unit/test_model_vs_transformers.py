"""The flat-batch model against transformers on tiny random-weight configs, logits at every step."""
from __future__ import annotations

import random

import pytest
import torch

from executor_svc.model_runner import ModelRunner
from executor_svc.models.llama import RMSNorm
from pagedserve.config import CacheConfig, ModelConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteRequest, ExecuteStep
from tests.conftest import write_tiny_model

TOLERANCE = 1e-4
BLOCK_SIZE = 8


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "smollm3", "granite", "gemma3", "gemma2", "mistral",
                                             "phi3", "llama3-rope", "mixtral", "qwen2_moe", "qwen3_moe", "granitemoe",
                                             "granitemoeshared", "olmoe", "olmo2", "olmo3", "ministral", "exaone4",
                                             "seed_oss", "helium"])
def tiny_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, write_tiny_model(request.param, path)


class TeacherForcedDriver:
    """Feeds fixed token sequences through the runner in chosen chunk sizes, blocks from a shuffled pool."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.free_blocks = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.blocks_held: dict[str, int] = {}

    def request(self, request_id: str, tokens: list[int], start: int, count: int) -> ExecuteRequest:
        end = start + count
        needed = -(-end // BLOCK_SIZE) - self.blocks_held.get(request_id, 0)
        new_blocks = [self.free_blocks.pop() for _ in range(needed)]
        first = request_id not in self.blocks_held
        self.blocks_held[request_id] = self.blocks_held.get(request_id, 0) + needed
        return ExecuteRequest(
            request_id, tokens[start:end], start, new_blocks, sample=True,
            sampling_params=SamplingParams(temperature=0) if first else None,
        )


def logits_by_chunk(runner: ModelRunner, tokens: list[int], chunks) -> list[tuple[int, torch.Tensor]]:
    """(position, logits) after each chunk of one request fed through the runner step by step."""
    driver, start, out = TeacherForcedDriver(runner), 0, []
    for n in chunks:
        start += n
        out.append((start - 1, runner.step_logits(ExecuteStep([driver.request("r", tokens, start - n, n)]))["r"]))
    return out


def reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def test_mixed_batch_logits_match_transformers_at_every_step(tiny_model):
    path, hf_model = tiny_model
    runner = ModelRunner(ModelConfig(str(path), device="cpu", dtype="float32"),
                         CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=1 << 20))
    driver = TeacherForcedDriver(runner)
    gen = random.Random(1)
    sequences = {name: [gen.randrange(160) for _ in range(200)] for name in ("fresh", "chunked", "decoding")}
    expected = {name: reference_logits(hf_model, seq) for name, seq in sequences.items()}

    # "decoding" is prefilled a step early, so every later step mixes its decode with a fresh prompt
    # (whole, then decoding) and a prompt prefilled in chunks of 1, 7, 16 and 33 tokens.
    chunk_cycle = [1, 7, 16, 33]
    step_plans = [[("decoding", 30)]]
    for step in range(12):
        step_plans.append([("decoding", 1), ("fresh", 50 if step == 0 else 1), ("chunked", chunk_cycle[step % 4])])

    progress = {name: 0 for name in sequences}
    checked = 0
    for plan in step_plans:
        requests = [driver.request(name, sequences[name], progress[name], n) for name, n in plan]
        logits = runner.step_logits(ExecuteStep(requests))
        for name, n in plan:
            progress[name] += n
            diff = (logits[name] - expected[name][progress[name] - 1]).abs().max().item()
            assert diff < TOLERANCE, f"{name} at position {progress[name] - 1}: max abs diff {diff}"
            checked += 1
    assert checked == 1 + 12 * 3


def test_chunked_and_unchunked_prefill_give_the_same_logits(tiny_model):
    path, _ = tiny_model
    tokens = random.Random(2).choices(range(160), k=90)
    logits = {}
    for chunks in ([90], [1, 7, 16, 33, 33], [33, 16, 7, 1, 33]):
        runner = ModelRunner(ModelConfig(str(path), device="cpu", dtype="float32"),
                             CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=1 << 20))
        driver = TeacherForcedDriver(runner, seed=len(chunks))
        start = 0
        for n in chunks:
            out = runner.step_logits(ExecuteStep([driver.request("r", tokens, start, n)]))
            start += n
        logits[tuple(chunks)] = out["r"]
    reference = logits[(90,)]
    for chunks, value in logits.items():
        assert (value - reference).abs().max().item() < 1e-5, chunks


def test_bfloat16_logits_are_about_as_close_to_float32_as_transformers_in_bfloat16(tiny_model):
    # bfloat16 rounds differently in different code; what must hold is that ours strays from the float32 logits
    # no further than transformers' own bfloat16 run does, give or take.
    path, hf_model = tiny_model
    hf_bf16 = type(hf_model).from_pretrained(path, dtype=torch.bfloat16).eval()
    runner = ModelRunner(ModelConfig(str(path), dtype="bfloat16", device="cpu"),
                         CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=1 << 20))
    # Gemma's and OLMo 2's norms multiply by their weights in float32: those weights stay float32.
    norm_dtypes = {m.weight.dtype for m in runner.model.modules() if isinstance(m, RMSNorm)}
    assert norm_dtypes == {torch.float32 if runner.config.float32_norm_products else torch.bfloat16}
    tokens = random.Random(3).choices(range(160), k=64)
    exact, rounded = reference_logits(hf_model, tokens), reference_logits(hf_bf16, tokens)
    for position, logits in logits_by_chunk(runner, tokens, (40, 1, 1, 7, 15)):
        ours = (logits - exact[position]).abs().max().item()
        theirs = (rounded[position] - exact[position]).abs().max().item()
        assert ours < 2 * theirs + 0.005 * exact[position].abs().max().item(), (position, ours, theirs)


@pytest.mark.parametrize("kind", ["phi3", "gemma2"])
def test_torch_backend_and_unfused_rotary_match_transformers(kind, tmp_path):
    # The torch attention backend (sliding windows through its masks) and the model's own rotary embedding
    # (partial for Phi-3), which the CPU kernels' fused path otherwise replaces.
    hf_model = write_tiny_model(kind, tmp_path)
    runner = ModelRunner(ModelConfig(str(tmp_path), device="cpu", dtype="float32", attention_backend="torch"),
                         CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=1 << 20))
    assert runner.model.fused_ops is None
    tokens = random.Random(4).choices(range(160), k=130)
    expected = reference_logits(hf_model, tokens)
    for position, logits in logits_by_chunk(runner, tokens, (50, 1, 33, 45, 1)):
        assert (logits - expected[position]).abs().max().item() < TOLERANCE, position


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_scales_its_embeddings_by_sqrt_hidden_rounded_to_the_models_dtype(kind, tmp_path):
    # sqrt(72) = 8.485 is 8.5 in bfloat16; transformers scales by the rounded value, and so must we.
    hf_model = write_tiny_model(kind, tmp_path, hidden_size=72)
    runner = ModelRunner(ModelConfig(str(tmp_path), dtype="bfloat16", device="cpu"), CacheConfig(kv_cache_memory=1 << 20))
    hf_bf16 = type(hf_model).from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ids = torch.arange(160)
    with torch.no_grad():
        assert torch.equal(runner.model.embed(ids), hf_bf16.model.embed_tokens(ids))


def test_longrope_past_its_original_context_takes_the_long_factors_at_every_position(tmp_path):
    # transformers runs a sequence longer than original_max_position_embeddings (256 here) on the long factors
    # throughout: so does a server whose max_model_len passes it, at every position of every request.
    hf_model = write_tiny_model("phi3", tmp_path)
    runner = ModelRunner(ModelConfig(str(tmp_path), device="cpu", dtype="float32", max_model_len=512),
                         CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=1 << 20))
    tokens = random.Random(5).choices(range(160), k=300)
    expected = reference_logits(hf_model, tokens)
    for position, logits in logits_by_chunk(runner, tokens, (100, 1, 150, 48, 1)):
        assert (logits - expected[position]).abs().max().item() < TOLERANCE, position


def test_gemma3s_attention_leaves_its_configs_softcap_unapplied_as_transformers_does(tmp_path):
    # Gemma 3's config has attn_logit_softcapping (null in its checkpoints); transformers' Gemma 3 attention never
    # applies it, and a cap of 1.5 would bend these scores well past the tolerance.
    hf_model = write_tiny_model("gemma3", tmp_path, attn_logit_softcapping=1.5)
    runner = ModelRunner(ModelConfig(str(tmp_path), device="cpu", dtype="float32"),
                         CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=1 << 20))
    assert runner.model.config.attention_softcap is None
    tokens = random.Random(6).choices(range(160), k=60)
    expected = reference_logits(hf_model, tokens)
    for position, logits in logits_by_chunk(runner, tokens, (40, 1, 19)):
        assert (logits - expected[position]).abs().max().item() < TOLERANCE, position


def test_a_qwen2_moe_shared_expert_sized_0_loads_and_adds_nothing_as_in_transformers(tmp_path):
    # transformers saves the expert as empty tensors, and its gate, which scales the expert's nothing.
    hf_model = write_tiny_model("qwen2_moe", tmp_path,
                                edit_config=lambda config: setattr(config, "shared_expert_intermediate_size", 0))
    runner = ModelRunner(ModelConfig(str(tmp_path), device="cpu", dtype="float32"),
                         CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=1 << 20))
    tokens = random.Random(7).choices(range(160), k=40)
    expected = reference_logits(hf_model, tokens)
    for position, logits in logits_by_chunk(runner, tokens, (30, 1, 9)):
        assert (logits - expected[position]).abs().max().item() < TOLERANCE, position
