"""Decode CUDA graphs and the backend choice on a real GPU.

* float32, through LLM (scheduler, chunked prefill, requests finishing at different steps, so decode
  batches of many sizes are padded to the captured ones): greedy tokens with graphs equal those without;
* bfloat16, through ModelRunner on a mixed workload fed the same tokens: the CuPy backend with graphs, and
  without, against the torch backend on the same GPU, within bf16 tolerance at every step;
* the backend choice: auto picks cupy on a CUDA device for head sizes the kernels implement.
"""
from __future__ import annotations

import dataclasses

import random

import pytest
import torch

from executor_svc.attention.cupy_backend import CupyPagedAttention
from executor_svc.attention.torch_backend import TorchPagedAttention
from executor_svc.model_runner import ModelRunner
from pagedserve.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteStep
from tests.gpu.test_model_gpu import BLOCK_SIZE, VOCAB, Driver, write_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-graphs")
    write_model("llama", path, seed=4)
    return path


def test_backend_choice_on_cuda(llama_dir):
    from executor_svc.server import ExecutorServicer

    runner = ModelRunner(ModelConfig(str(llama_dir), dtype="bfloat16", device="cuda"),
                         CacheConfig(kv_cache_memory=16 << 20),
                         SchedulerConfig(max_num_seqs=4))
    assert runner.attention_backend_name == "cupy" and isinstance(runner.attention, CupyPagedAttention)
    assert ExecutorServicer(runner).GetInfo(None, None).attention_backend == "cupy"
    assert sorted(runner.decode_graphs.graphs) == [(1, 1024), (2, 1024), (4, 1024)]
    assert all(not k.any() and not v.any() for k, v in runner.kv_caches)  # capture wrote no K/V
    torch_runner = ModelRunner(ModelConfig(str(llama_dir), dtype="bfloat16", device="cuda", attention_backend="torch"),
                               CacheConfig(kv_cache_memory=16 << 20))
    assert torch_runner.attention_backend_name == "torch" and isinstance(torch_runner.attention, TorchPagedAttention)
    assert torch_runner.decode_graphs is None
    eager = ModelRunner(ModelConfig(str(llama_dir), dtype="bfloat16", device="cuda", enforce_eager=True),
                        CacheConfig(kv_cache_memory=16 << 20))
    assert eager.attention_backend_name == "cupy" and eager.decode_graphs is None


def test_greedy_tokens_with_graphs_equal_eager(llama_dir):
    from pagedserve.entrypoints.offline import LLM

    gen = random.Random(7)
    lengths = (5, 17, 33, 64, 100, 130, 8, 250, 40, 3, 77, 19)
    max_tokens = (40, 25, 60, 10, 33, 48, 70, 20, 55, 65, 5, 30)
    prompts = [[gen.randrange(VOCAB - 1) for _ in range(n)] for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    tokens = {}
    for enforce_eager in (False, True):
        llm = LLM(str(llama_dir), device="cuda", dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=16,
                  max_num_batched_tokens=256, enforce_eager=enforce_eager)
        assert llm.runner.attention_backend_name == "cupy"
        tokens[enforce_eager] = [r.token_ids for r in llm.generate(prompts, params)]
        graphs = llm.runner.decode_graphs
        if enforce_eager:
            assert graphs is None
        else:
            assert graphs.batch_sizes == (1, 2, 4, 8, 16)
            assert graphs.num_replays >= 20, graphs.num_replays
        del llm
        torch.cuda.empty_cache()
    assert [len(t) for t in tokens[False]] == list(max_tokens)
    assert tokens[False] == tokens[True]


def test_cupy_runner_with_and_without_graphs_matches_torch_runner_bf16(llama_dir):
    cache = CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=64 << 20)
    model = ModelConfig(str(llama_dir), dtype="bfloat16", device="cuda", attention_backend="cupy")
    runners = {
        "torch": ModelRunner(dataclasses.replace(model, attention_backend="torch"), cache),
        "cupy-graphs": ModelRunner(model, cache, SchedulerConfig(max_num_seqs=8)),
        "cupy-eager": ModelRunner(dataclasses.replace(model, enforce_eager=True), cache),
    }
    assert len({r.num_blocks for r in runners.values()}) == 1
    driver = Driver(runners["torch"], seed=3)
    gen = random.Random(3)
    names = [f"s{i}" for i in range(6)]
    sequences = {name: [gen.randrange(VOCAB - 1) for _ in range(900)] for name in names}
    progress = {name: 0 for name in names}
    plans = [[("s0", 600), ("s1", 150)], [("s1", 150), ("s2", 40), ("s0", 1)]]
    plans += [[(n, 1) for n in ("s0", "s1", "s2")]] * 5  # 3 rows: padded to 4
    plans += [[("s3", 7), ("s4", 120), ("s0", 1)]]
    plans += [[(n, 1) for n in ("s0", "s1", "s2", "s3", "s4")]] * 5  # 5 rows: padded to 8
    plans += [[("s5", 2)] + [(n, 1) for n in ("s0", "s1")]]
    plans += [[(n, 1) for n in names]] * 5  # 6 rows: padded to 8
    plans += [[("s2", 1)]] * 3  # 1 row
    for plan in plans:
        requests = [driver.request(name, sequences[name], progress[name], n) for name, n in plan]
        logits = {key: runner.step_logits(ExecuteStep(requests)) for key, runner in runners.items()}
        for name, n in plan:
            progress[name] += n
            ref = logits["torch"][name]
            for key in ("cupy-graphs", "cupy-eager"):
                diff = (logits[key][name] - ref).abs().max().item()
                assert diff < 0.02 * ref.abs().max().item() + 1e-2, f"{key} {name} at {progress[name] - 1}: {diff}"
    assert runners["cupy-graphs"].decode_graphs.num_replays == 18
    assert runners["cupy-eager"].decode_graphs is None
