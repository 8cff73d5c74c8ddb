"""The executor on the CPU: dtype chosen from the CPU's flags and reported, torch threads from --cpu-threads,
and a steady decode batch that reuses its sampling tensors."""
from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F

import pagedserve.config
from executor_svc.model_runner import ModelRunner
from executor_svc.server import executor_info
from pagedserve.config import CacheConfig, ModelConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteRequest, ExecuteStep


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("flags, speedup, dtype, reason", [
    (("avx512_bf16",), 3.5, "bfloat16", "the CPU has avx512_bf16 and runs bfloat16 linear layers 3.50x as fast "
                                        "as float32, at least 1.3x"),
    (("avx512_bf16",), 0.6, "float32", "the CPU has avx512_bf16 and runs bfloat16 linear layers 0.60x as fast "
                                       "as float32, under 1.3x"),
    ((), None, "float32", "the CPU has no native bfloat16 matrix support"),
])
def test_auto_dtype_follows_the_cpu_and_get_info_reports_it(tiny_llama_dir, monkeypatch, caplog, flags, speedup,
                                                            dtype, reason):
    monkeypatch.setattr(pagedserve.config, "cpu_bf16_flags", lambda: flags)
    monkeypatch.setattr(pagedserve.config, "cpu_bf16_speedup", lambda: speedup)
    with caplog.at_level(logging.INFO, logger="executor_svc.model_runner"):
        runner = ModelRunner(ModelConfig(str(tiny_llama_dir), device="cpu"), CacheConfig(kv_cache_memory=1 << 20))
    assert executor_info(runner).dtype == dtype and runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    assert f"dtype {dtype} (auto: {reason})" in caplog.text


def test_cpu_threads_sets_torchs_threads(tiny_llama_dir, restore_threads):
    ModelRunner(ModelConfig(str(tiny_llama_dir), device="cpu", cpu_threads=1), CacheConfig(kv_cache_memory=1 << 20))
    assert torch.get_num_threads() == 1
    torch.set_num_threads(1)
    ModelRunner(ModelConfig(str(tiny_llama_dir), device="cpu"), CacheConfig(kv_cache_memory=1 << 20))
    assert torch.get_num_threads() == len(os.sched_getaffinity(0))


def test_a_steady_decode_batch_reuses_its_sampling_tensors(tiny_llama_dir):
    runner = ModelRunner(ModelConfig(str(tiny_llama_dir), device="cpu", dtype="float32"),
                         CacheConfig(kv_cache_memory=1 << 20, block_size=16))
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, ignore_eos=False)

    def request(request_id, tokens, start, blocks=(), first=False):
        return ExecuteRequest(request_id=request_id, token_ids=tokens, start_position=start, new_block_ids=list(blocks),
                              sample=True, sampling_params=params if first else None, prompt_len=4)

    out = runner.execute(ExecuteStep([request("a", [1, 2, 3, 4], 0, [0], True), request("b", [5, 6, 7, 8], 0, [1], True)]))
    first = runner._last_sampling_batch[1]
    out = runner.execute(ExecuteStep([request(r, [out.sampled[r].token_id], 4) for r in ("a", "b")]))
    assert runner._last_sampling_batch[1] is first  # same requests, same order: no rebuild
    runner.execute(ExecuteStep([request("b", [out.sampled["b"].token_id], 5)], finished_request_ids=["a"]))
    assert runner._last_sampling_batch[1] is not first and len(runner._last_sampling_batch[1]) == 1


def test_min_tokens_bans_each_rows_stop_tokens_until_they_are_out(tiny_llama_dir):
    runner = ModelRunner(ModelConfig(str(tiny_llama_dir), device="cpu", dtype="float32"),
                         CacheConfig(kv_cache_memory=1 << 20, block_size=16))
    early = SamplingParams(temperature=0, max_tokens=8, min_tokens=5, stop_token_ids=[7])
    late = SamplingParams(temperature=0, max_tokens=8, min_tokens=0, stop_token_ids=[7])
    steps = [ExecuteRequest(request_id=r, token_ids=[1, 2], start_position=0, new_block_ids=[i], sample=True,
                            sampling_params=p, prompt_len=2) for i, (r, p) in enumerate((("early", early), ("late", late)))]
    runner.execute(ExecuteStep(steps))
    rows, token_ids = runner._banned_tokens(steps, [2, 2])
    assert set(rows) == {0} and set(token_ids) == {7, *runner.eos_token_ids}
    assert runner._banned_tokens(steps, [7, 7]) is None  # min_tokens out for both


def onednn_packs_bfloat16() -> bool:
    """Whether this CPU's oneDNN packs bfloat16 weights at all: it refuses without AVX512-BW/VL/DQ or
    AVX-NE-CONVERT (an AVX2-only CPU, say), and the model then keeps its plain weights."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("rows", [1, 3, 17, 600])
def test_a_bfloat16_linear_packed_for_onednn_gives_f_linears_bits_and_lets_its_plain_weight_go(rows):
    from executor_svc.attention.cpu_backend import load_extension
    from executor_svc.models.llama import Linear

    torch.manual_seed(rows)
    layer = Linear(64, 96, True, load_extension()).to(torch.bfloat16)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    wide = torch.randn(rows, 128).bfloat16()
    inputs = [wide[:, :64], wide[:, :64].contiguous()]  # rows strided as the down projection reads them, and not
    with torch.inference_mode():
        expected = [F.linear(x, weight, bias) for x in inputs]
        if onednn_packs_bfloat16():
            assert layer.pack()
            assert layer.weight.numel() == 0 and layer.packed is not None
        else:  # declined: the layer stays as it was
            assert not layer.pack()
            assert layer.packed is None and torch.equal(layer.weight, weight)
        assert all(torch.equal(layer(x), e) for x, e in zip(inputs, expected))


def test_a_bfloat16_mixture_of_experts_packs_its_experts_with_the_same_logits(tmp_path, monkeypatch):
    from executor_svc.models.llama import LlamaForCausalLM, SparseMoE
    from tests.conftest import write_tiny_model

    write_tiny_model("qwen2_moe", tmp_path)
    config, cache = ModelConfig(str(tmp_path), device="cpu", dtype="bfloat16"), CacheConfig(kv_cache_memory=1 << 20)
    packed = ModelRunner(config, cache)
    [moe] = [m for m in packed.model.modules() if isinstance(m, SparseMoE)]
    assert (moe.packed is not None) == onednn_packs_bfloat16()
    assert (moe.experts_gate_up.numel() == 0) == onednn_packs_bfloat16()
    monkeypatch.setattr(LlamaForCausalLM, "pack_bfloat16_linears", lambda self: (0, 0))
    plain = ModelRunner(config, cache)
    assert plain.model.weight_numel() == packed.model.weight_numel()
    logits = [runner.step_logits(ExecuteStep([ExecuteRequest("a", list(range(1, 40)), 0, [0, 1, 2], True,
                                                             SamplingParams(temperature=0), prompt_len=39)]))["a"]
              for runner in (packed, plain)]
    assert torch.equal(*logits)


def test_a_bfloat16_model_runs_packed_with_the_same_logits_and_a_float32_one_stays_plain(tiny_llama_dir, monkeypatch):
    from executor_svc.models.llama import Linear, LlamaForCausalLM

    def logits(runner):
        step = ExecuteStep([ExecuteRequest(request_id="a", token_ids=list(range(1, 40)), start_position=0,
                                           new_block_ids=[0, 1, 2], sample=True,
                                           sampling_params=SamplingParams(temperature=0, max_tokens=2), prompt_len=39)])
        return runner.step_logits(step)["a"]

    config, cache = ModelConfig(str(tiny_llama_dir), device="cpu", dtype="bfloat16"), CacheConfig(kv_cache_memory=1 << 20)
    packed = ModelRunner(config, cache)
    linears = [m for m in packed.model.modules() if isinstance(m, Linear)]
    if onednn_packs_bfloat16():
        assert linears and all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    else:
        assert linears and all(m.packed is None and m.weight.numel() > 0 for m in linears)
    assert packed.model.lm_head is not None or packed.model.packed_head is not None
    monkeypatch.setattr(LlamaForCausalLM, "pack_bfloat16_linears", lambda self: (0, 0))
    plain = ModelRunner(config, cache)
    assert torch.equal(logits(packed), logits(plain))
    monkeypatch.undo()
    fp32 = ModelRunner(ModelConfig(str(tiny_llama_dir), device="cpu", dtype="float32"), cache)
    assert all(m.packed is None and m.weight.numel() > 0 for m in fp32.model.modules() if isinstance(m, Linear))
