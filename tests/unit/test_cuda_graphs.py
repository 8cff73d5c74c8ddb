"""Attention backend choice and decode CUDA graphs, as far as a CPU reaches.

* ModelRunner's attention_backend (auto, torch, cupy) on the CPU, its report through GetInfo, and the flag
  through `python -m executor_svc`, the launcher and `pagedserve up`;
* the graph runner's arithmetic: batch sizes to capture, context capacities, which graph a step replays,
  padding a decode batch, and the metadata a graph is captured with and refilled from;
* the graph runner end to end inside ModelRunner, with the CUDA kernels emulated on the host
  (tests/unit/test_kernels_cpu.py) and a stand-in graph that re-runs the captured forward on its static
  buffers at each replay: padding, refilling, bucket choice and the eager fallback against eager steps.

What needs a GPU (torch.cuda.graph capture itself, CuPy launches inside it) is in tests/gpu.
"""
from __future__ import annotations

import logging
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from executor_svc.attention.cupy_backend import CupyPagedAttention, plan_batch
from executor_svc.attention.layout import BatchLayout
from executor_svc.attention.cpu_backend import CpuPagedAttention
from executor_svc.attention.torch_backend import TorchPagedAttention
from executor_svc.cuda_graphs import (
    DEFAULT_CUDA_GRAPH_BATCH_SIZES, PADDING_BLOCK, PADDING_SLOT, DecodeGraphRunner, cuda_graph_batch_sizes,
    cuda_graph_context_capacities, pad_decode_layout, padding_layout, select_cuda_graph,
)
from executor_svc.model_runner import ModelRunner
from pagedserve.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ExecuteRequest, ExecuteStep
from tests.unit.test_kernels_cpu import EmulatedLauncher, emulator_library  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16


# ---------------------------------------------------------------------------------------------------------
# Backend choice
# ---------------------------------------------------------------------------------------------------------


def test_runner_backend_auto_is_the_cpu_kernels_on_cpu(tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="executor_svc.model_runner"):
        runner = ModelRunner(ModelConfig(str(tiny_llama_dir), device="cpu"), CacheConfig(kv_cache_memory=1 << 20))
    assert runner.attention_backend_name == "cpu"
    assert isinstance(runner.attention, CpuPagedAttention)
    assert all(layer.self_attn.backend is runner.attention for layer in runner.model.layers)
    assert runner.decode_graphs is None
    assert f"attention backend cpu (cpu: C++ kernels, {CpuPagedAttention.isa()} path)" in caplog.text
    assert "CUDA graphs off (device cpu)" in caplog.text


def test_runner_backend_torch_when_asked(tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="executor_svc.model_runner"):
        runner = ModelRunner(ModelConfig(str(tiny_llama_dir), attention_backend="torch", device="cpu"),
                             CacheConfig(kv_cache_memory=1 << 20))
    assert runner.attention_backend_name == "torch" and isinstance(runner.attention, TorchPagedAttention)
    assert "attention backend torch (torch backend requested)" in caplog.text


def test_runner_backend_cupy_on_cpu_says_why_not(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"cupy attention backend cannot run here: device cpu is not a CUDA device"):
        ModelRunner(ModelConfig(str(tiny_llama_dir), attention_backend="cupy", device="cpu"),
                    CacheConfig(kv_cache_memory=1 << 20))
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, cupy, cpu, got 'flash'"):
        ModelConfig(str(tiny_llama_dir), attention_backend="flash")


def test_cpu_runner_resolves_graph_sizes_but_captures_none(tiny_llama_dir):
    runner = ModelRunner(ModelConfig(str(tiny_llama_dir), device="cpu"),
                         CacheConfig(kv_cache_memory=1 << 20),
                         SchedulerConfig(max_num_seqs=48))
    assert runner.cuda_graph_batch_sizes == (1, 2, 4, 8, 16, 32, 48)
    assert runner.decode_graphs is None
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes must be at least 1"):
        ModelConfig(str(tiny_llama_dir), cuda_graph_batch_sizes=[0, 4])


def test_get_info_reports_the_resolved_backend(tiny_llama_dir):
    from executor_svc.server import ExecutorServicer

    runner = ModelRunner(ModelConfig(str(tiny_llama_dir), device="cpu"), CacheConfig(kv_cache_memory=1 << 20))
    info = ExecutorServicer(runner).GetInfo(None, None)
    assert info.attention_backend == "cpu"


def test_executor_cli_rejects_cupy_on_cpu(tiny_llama_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "executor_svc", "--model", str(tiny_llama_dir), "--device", "cpu",
         "--kv-cache-memory", str(1 << 20),
         "--attention-backend", "cupy", "--port", "0"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode != 0
    assert "cupy attention backend cannot run here" in proc.stderr


def test_launcher_passes_backend_and_graph_options_to_the_executor():
    from pagedserve.config import PagedServeConfig
    from pagedserve.entrypoints.launcher import Stack

    stack = Stack(PagedServeConfig.from_kwargs(port=0, attention_backend="torch", enforce_eager=True, max_num_seqs=32))
    executor = stack.service_argv("executor_svc")
    assert executor[executor.index("--attention-backend") + 1] == "torch"
    assert executor[executor.index("--max-num-seqs") + 1] == "32"
    assert "--enforce-eager" in executor
    executor = Stack(PagedServeConfig.from_kwargs(port=0)).service_argv("executor_svc")
    assert executor[executor.index("--attention-backend") + 1] == "auto" and "--enforce-eager" not in executor


def test_pagedserve_up_passes_the_backend(monkeypatch, up_config):
    import pagedserve.config
    from pagedserve.entrypoints import cli

    config = up_config(["--device", "cpu", "--attention-backend", "cupy", "--enforce-eager"])
    assert config.model_config.attention_backend == "cupy" and config.model_config.enforce_eager
    monkeypatch.setattr(pagedserve.config, "cpu_bf16_flags", lambda: ())
    config = up_config(["--device", "cpu"])
    assert config.model_config.attention_backend == "auto" and not config.model_config.enforce_eager
    assert config.model_config.dtype == "float32"  # auto: float32 on a CPU without native bfloat16
    assert up_config(["--device", "cuda"]).model_config.dtype == "bfloat16"
    with pytest.raises(SystemExit):
        cli.main(["up", "--attention-backend", "flash"])


# ---------------------------------------------------------------------------------------------------------
# Graph arithmetic
# ---------------------------------------------------------------------------------------------------------


def test_batch_sizes_to_capture():
    assert cuda_graph_batch_sizes(256) == DEFAULT_CUDA_GRAPH_BATCH_SIZES
    assert cuda_graph_batch_sizes(1024) == DEFAULT_CUDA_GRAPH_BATCH_SIZES  # larger batches run eagerly
    assert cuda_graph_batch_sizes(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert cuda_graph_batch_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert cuda_graph_batch_sizes(1) == (1,)
    assert cuda_graph_batch_sizes(256, [8, 3, 3, 512]) == (3, 8)
    assert cuda_graph_batch_sizes(256, []) == ()
    for bad in ([0], [-2], [2.0], [True]):
        with pytest.raises(ValueError, match="positive integers"):
            cuda_graph_batch_sizes(256, bad)
    with pytest.raises(ValueError, match="max_num_seqs"):
        cuda_graph_batch_sizes(0)


def test_context_capacities():
    assert cuda_graph_context_capacities(32768) == (2048, 8192)
    assert cuda_graph_context_capacities(4096) == (2048, 4096)
    assert cuda_graph_context_capacities(2048) == (2048,)
    assert cuda_graph_context_capacities(512) == (512,)
    assert cuda_graph_context_capacities(100, tiers=(64, 128, 256)) == (64, 100)
    with pytest.raises(ValueError):
        cuda_graph_context_capacities(0)


@pytest.mark.parametrize("rows, context, expected", [
    (1, 1, (1, 2048)), (3, 2048, (4, 2048)), (4, 2049, (4, 8192)), (5, 8192, (8, 8192)), (33, 100, (64, 2048)),
    (256, 10, (256, 2048)), (257, 10, None), (2, 8193, None), (0, 1, None),
])
def test_select_graph(rows, context, expected):
    assert select_cuda_graph(rows, context, DEFAULT_CUDA_GRAPH_BATCH_SIZES, (2048, 8192)) == expected


def test_pad_decode_layout():
    layout = BatchLayout([1, 1, 1], [5, 40, 17], [[7], [3, 9, 11], [4, 2]], 0, torch.tensor([68, 169, 32]), BLOCK_SIZE)
    padded = pad_decode_layout(layout, 8)
    assert padded.query_lens == [1] * 8 and padded.num_prefills == 0 and padded.block_size == BLOCK_SIZE
    assert padded.context_lens == [5, 40, 17] + [1] * 5
    assert padded.block_tables == [[7], [3, 9, 11], [4, 2]] + [[PADDING_BLOCK]] * 5
    assert padded.slot_mapping.tolist() == [68, 169, 32] + [PADDING_SLOT] * 5
    assert pad_decode_layout(layout, 3).slot_mapping is layout.slot_mapping
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode_layout(layout, 2)
    chunked = BatchLayout([4, 1], [4, 9], [[1], [2]], 1, torch.arange(5), BLOCK_SIZE)
    with pytest.raises(ValueError, match="decode-only"):
        pad_decode_layout(chunked, 8)
    empty = padding_layout(4, BLOCK_SIZE, "cpu")
    assert empty.context_lens == [1] * 4 and empty.slot_mapping.tolist() == [PADDING_SLOT] * 4


def test_graph_metadata_is_sized_for_the_capacity_and_refilled_in_place():
    backend = CupyPagedAttention(14, 2, 64, 0.125)
    meta = backend.build_metadata(padding_layout(64, BLOCK_SIZE, "cpu"), torch.device("cpu"), context_capacity=2048)
    assert meta.num_tokens == meta.num_decodes == 64 and meta.num_prefills == 0
    assert tuple(meta.block_tables.shape) == (64, 2048 // BLOCK_SIZE)
    # 64 rows x 2 KV heads = 128 CTAs fill a fifth of an H200's 660 resident slots: split into 5 partitions
    # of 448 keys, the plan an eager step of 2,000-key contexts gets too.
    assert (meta.decode_partitions, meta.decode_partition_size) == (5, 448)
    eager = plan_batch(BatchLayout([1] * 64, [2000] * 64, [[0] * 125] * 64, 0, torch.zeros(64), BLOCK_SIZE), 14, 2)
    assert (eager.decode_partitions, eager.decode_partition_size) == (5, 448)
    assert tuple(meta.decode_part_out.shape) == (64, 14, 5, 64)
    pointers = [t.data_ptr() for t in (meta.block_tables, meta.decode_context_lens, meta.slot_mapping, meta.row_keys)]

    rng = random.Random(0)
    contexts = [rng.randint(1, 2048) for _ in range(10)]
    tables = [rng.sample(range(10_000), -(-c // BLOCK_SIZE)) for c in contexts]
    slots = torch.tensor([t[(c - 1) // BLOCK_SIZE] * BLOCK_SIZE + (c - 1) % BLOCK_SIZE for t, c in zip(tables, contexts)])
    layout = BatchLayout([1] * 10, contexts, tables, 0, slots, BLOCK_SIZE)
    backend.refill_metadata(meta, pad_decode_layout(layout, 64))
    assert [t.data_ptr() for t in (meta.block_tables, meta.decode_context_lens, meta.slot_mapping,
                                   meta.row_keys)] == pointers
    assert meta.decode_context_lens.tolist() == contexts + [1] * 54
    assert meta.slot_mapping.tolist() == slots.tolist() + [-1] * 54
    for row, table in enumerate(tables):
        assert meta.block_tables[row, : len(table)].tolist() == table
        assert not meta.block_tables[row, len(table) :].any()
    assert meta.block_tables[10:, 0].tolist() == [PADDING_BLOCK] * 54
    assert meta.row_keys.tolist() == contexts + [1] * 54

    too_long = BatchLayout([1], [2049], [list(range(129))], 0, torch.tensor([5]), BLOCK_SIZE)
    with pytest.raises(ValueError, match="exceed the metadata's capacity"):
        backend.refill_metadata(meta, pad_decode_layout(too_long, 64))
    with pytest.raises(ValueError, match="rows"):
        backend.refill_metadata(meta, pad_decode_layout(layout, 32))


def test_graph_runner_refuses_a_backend_without_refillable_metadata():
    with pytest.raises(TypeError, match="not refillable"):
        DecodeGraphRunner(torch.nn.Identity(), TorchPagedAttention(4, 2, 64, 0.125), [], device=torch.device("cpu"),
                          block_size=BLOCK_SIZE, hidden_size=256, batch_sizes=(1, 2), context_capacities=(64,),
                          graph_factory=lambda: None)
    with pytest.raises(ValueError, match="ascending"):
        DecodeGraphRunner(torch.nn.Identity(), CupyPagedAttention(4, 2, 64, 0.125), [], device=torch.device("cpu"),
                          block_size=BLOCK_SIZE, hidden_size=256, batch_sizes=(2, 1), context_capacities=(64,),
                          graph_factory=lambda: None)


# ---------------------------------------------------------------------------------------------------------
# The graph runner inside ModelRunner, kernels emulated, graphs stood in for
# ---------------------------------------------------------------------------------------------------------


class ReplayingGraph:
    """A CUDA graph's contract without CUDA: capture runs fn once and keeps its output tensor; each replay
    runs fn again (on the same static inputs and metadata) and writes the result into that tensor."""

    def __init__(self) -> None:
        self.fn = None
        self.out = None
        self.replays = 0

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())
        self.replays += 1


def _write_llama_d64(path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         eos_token_id=95, bos_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)


def _emulated_runner(path, library, graphs: bool, dtype: str = "bfloat16") -> ModelRunner:
    runner = ModelRunner(ModelConfig(str(path), dtype=dtype, device="cpu"),
                         CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=1 << 22),
                         SchedulerConfig(max_num_seqs=8))
    config = runner.config
    backend = CupyPagedAttention(config.num_heads, config.num_kv_heads, config.head_dim, config.head_dim**-0.5,
                                 launcher=EmulatedLauncher(library))
    runner.attention = backend
    for layer in runner.model.layers:
        layer.self_attn.backend = backend
    if graphs:
        runner.decode_graphs = DecodeGraphRunner(
            runner.model, backend, runner.kv_caches, device=runner.device, block_size=BLOCK_SIZE,
            hidden_size=config.hidden_size, batch_sizes=runner.cuda_graph_batch_sizes,
            context_capacities=(64, 320), graph_factory=ReplayingGraph,
        )
        runner.decode_graphs.capture()
    return runner


def test_replayed_decode_steps_match_eager_steps(emulator_library, tmp_path):
    _write_llama_d64(tmp_path)
    eager = _emulated_runner(tmp_path, emulator_library, graphs=False)
    graphed = _emulated_runner(tmp_path, emulator_library, graphs=True)
    graphs = graphed.decode_graphs
    assert graphed.cuda_graph_batch_sizes == (1, 2, 4, 8)
    assert sorted(graphs.graphs) == [(s, c) for s in (1, 2, 4, 8) for c in (64, 320)]
    assert graphs.graphs[(8, 320)].meta.decode_partitions == 2  # split-K inside a graph
    # Capturing wrote nothing: padding rows go to slot -1.
    assert all(not k.any() and not v.any() for k, v in graphed.kv_caches)

    gen = random.Random(5)
    seqs = {rid: [gen.randrange(95) for _ in range(n)] for rid, n in (("a", 40), ("b", 23), ("c", 317), ("d", 9))}
    free = list(range(eager.num_blocks))
    random.Random(1).shuffle(free)
    held: dict[str, int] = {}
    progress = {rid: 0 for rid in seqs}

    def request(rid, count, sample=True):
        start = progress[rid]
        needed = -(-(start + count) // BLOCK_SIZE) - held.get(rid, 0)
        new_blocks = [free.pop() for _ in range(needed)]
        first = rid not in held
        held[rid] = held.get(rid, 0) + needed
        progress[rid] += count
        return ExecuteRequest(rid, seqs[rid][start : start + count], start, new_blocks, sample=sample,
                              sampling_params=SamplingParams(temperature=0) if first else None)

    def decode(rid):
        if progress[rid] == len(seqs[rid]):
            seqs[rid].append(gen.randrange(95))  # teacher-forced: both runners see the same tokens
        return request(rid, 1)

    plans = [
        lambda: [request("a", 40), request("b", 23), request("c", 150)],       # prefill: eager
        lambda: [decode("a"), decode("b")],                                     # 2 rows, contexts <= 64
        lambda: [decode("a")],                                                  # 1 row
        lambda: [decode("a"), decode("b"), request("c", 1, sample=False)],      # 3 rows -> 4, one not sampled
        lambda: [decode("a"), decode("b"), request("c", 166)],                  # c's prompt done: eager
        lambda: [decode("a"), decode("b"), decode("c")],                        # 3 rows -> 4, capacity 320
        lambda: [request("d", 9), decode("a")],                                 # prefill: eager
        lambda: [decode("a"), decode("b"), decode("c"), decode("d")],           # 4 rows, capacity 320
        lambda: [decode("b"), decode("c"), decode("d"), decode("a")],           # c at 320 keys: still fits
        lambda: [decode("a"), decode("b"), decode("c"), decode("d")],           # c at 321 keys: eager
        lambda: [decode("a"), decode("d")],                                     # back to a graph
    ]
    expected_replays = [0, 1, 2, 3, 3, 4, 4, 5, 6, 6, 7]
    for plan, replays in zip(plans, expected_replays):
        requests = plan()
        want = eager.step_logits(ExecuteStep(requests))
        got = graphed.step_logits(ExecuteStep(requests))
        assert graphs.num_replays == replays
        assert set(got) == set(want) == {r.request_id for r in requests if r.sample}
        for rid in want:  # bfloat16: the graphs' split-K plan (made for their capacity) rounds differently
            assert (got[rid] - want[rid]).abs().max().item() <= 0.02 * max(1.0, want[rid].abs().max().item()), rid
    assert max(progress.values()) == 321
    assert sum(g.graph.replays for g in graphs.graphs.values()) == graphs.num_replays
    assert any(launch.kernel == "paged_decode_bf16_d64" and launch.grid[2] > 1  # split-K ran inside a graph
               for launch in graphed.attention.launcher.launches)
    for (k_eager, v_eager), (k_graph, v_graph) in zip(eager.kv_caches, graphed.kv_caches):
        torch.testing.assert_close(k_graph.float(), k_eager.float(), atol=0.05, rtol=0.02)
        torch.testing.assert_close(v_graph.float(), v_eager.float(), atol=0.05, rtol=0.02)

    # execute() samples from the replayed hidden states like from eager ones.
    requests = [decode("a"), decode("b")]
    step = ExecuteStep(requests)
    assert {r: t.token_id for r, t in graphed.execute(step).sampled.items()} == {
        r: t.token_id for r, t in eager.execute(step).sampled.items()}
    assert graphs.num_replays == 8
