"""The C++ CPU paged-attention kernels (executor_svc/csrc) against the float64 reference and the torch
backend, on every instruction-set path this CPU can run: random shuffled block tables, GQA ratios 1/3/8,
head dims 64/128, block sizes 8/16/32, float32 and bfloat16, decodes and prefill chunks over cached context,
with NaN wherever the kernel must not read. The cache write goes through the extension too."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from executor_svc.attention.cpu_backend import CpuPagedAttention, load_extension, supported_isas
from executor_svc.attention.selection import select_attention_backend
from executor_svc.attention.torch_backend import TorchPagedAttention
from tests.support.attention_reference import PagedProblem

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
ISAS = supported_isas()


@pytest.fixture(params=ISAS)
def isa(request):
    ops = load_extension()
    previous = ops.select_isa(request.param)
    yield request.param
    ops.select_isa(previous)


def random_problem(seed: int, *, group: int, head_dim: int, block_size: int, dtype, poison: bool = True,
                   window: int | None = None):
    rng = random.Random(seed)
    num_kv_heads = rng.choice([1, 2]) if group == 8 else rng.choice([1, 2, 3])
    num_prefills = rng.randint(0, 3)
    num_decodes = rng.randint(0 if num_prefills else 1, 5)
    # Chunks of 2..40 queries reach both the dot-product path (few rows) and the row-vector path.
    query_lens = [rng.randint(2, 40) for _ in range(num_prefills)] + [1] * num_decodes
    cached = [rng.choice([0, rng.randint(1, 90)]) for _ in range(num_prefills)] + \
             [rng.randint(0, 150) for _ in range(num_decodes)]
    return PagedProblem(num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        block_size=block_size, query_lens=query_lens, cached_lens=cached,
                        num_prefills=num_prefills, dtype=dtype, seed=seed, poison=poison, window=window)


def run_cpu(p: PagedProblem) -> torch.Tensor:
    backend = CpuPagedAttention(p.num_heads, p.num_kv_heads, p.head_dim, p.scale)
    meta = backend.build_metadata(p.layout(), torch.device("cpu"))
    return backend.forward(p.query, p.key, p.value, p.key_cache, p.value_cache, meta, p.window, p.softcap)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got = got.view(expected.shape).double()
    return ((got - expected).norm() / expected.norm()).item()


def test_every_path_this_cpu_reports_is_available():
    flags = open("/proc/cpuinfo").read().split()
    assert "baseline" in ISAS
    assert ("avx2" in ISAS) == ("avx2" in flags and "fma" in flags)
    assert ("avx512" in ISAS) == all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))
    assert ("avx512_bf16" in ISAS) == ("avx512" in ISAS and "avx512_bf16" in flags)
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        load_extension().select_isa("sse9")


CASES = list(itertools.product([1, 3, 8], [64, 128], [8, 16, 32], [torch.float32, torch.bfloat16]))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_float64_reference(isa, case):
    group, head_dim, block_size, dtype = CASES[case]
    seed = case + 100 * ISAS.index(isa)
    p = random_problem(seed, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype)
    expected, key_cache, value_cache = p.expected()
    got = run_cpu(p)
    # The extension wrote the step's K/V into their slots, bit for bit, and nothing else.
    assert torch.equal(p.key_cache.nan_to_num(7.0), key_cache.nan_to_num(7.0))
    assert torch.equal(p.value_cache.nan_to_num(7.0), value_cache.nan_to_num(7.0))
    assert relative_error(got, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch_backend(isa, seed, dtype):
    rng = random.Random(seed)
    group, head_dim, block_size = rng.choice([1, 3, 8]), rng.choice([64, 128]), rng.choice([8, 16, 32])
    # The torch backend multiplies masked probabilities by whatever the cache holds: no NaN poison here.
    p = random_problem(seed, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype, poison=False)
    torch_backend = TorchPagedAttention(p.num_heads, p.num_kv_heads, p.head_dim, p.scale)
    key_cache, value_cache = p.key_cache.clone(), p.value_cache.clone()
    meta = torch_backend.build_metadata(p.layout(), torch.device("cpu"))
    want = torch_backend.forward(p.query, p.key, p.value, key_cache, value_cache, meta)
    got = run_cpu(p)
    assert torch.equal(p.key_cache, key_cache) and torch.equal(p.value_cache, value_cache)
    assert relative_error(got, want.view(-1, p.num_heads, p.head_dim).double()) < TOLERANCE[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40))
def test_kernel_random_sweep(isa, seed):
    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    p = random_problem(seed, group=rng.choice([1, 2, 3, 4, 7, 8]), head_dim=rng.choice([16, 32, 64, 128, 256]),
                       block_size=rng.choice([1, 3, 8, 16, 32, 64]), dtype=dtype)
    expected, _, _ = p.expected()
    assert relative_error(run_cpu(p), expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("window", [1, 7, 32, 45])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_matches_reference_and_reads_nothing_before_it(isa, window, dtype):
    # Chunks and decodes whose contexts run past the window (the cache holds NaN before each sequence's first
    # window), on both paths, and wide decode batches whose items serve several KV heads.
    for i, (group, head_dim, block_size) in enumerate([(3, 64, 16), (8, 128, 8), (1, 64, 32)]):
        p = random_problem(1000 * window + i, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype,
                           window=window)
        expected, _, _ = p.expected()
        assert relative_error(run_cpu(p), expected) < TOLERANCE[dtype], (group, head_dim, block_size)
    num_seqs = 8 * torch.get_num_threads() + 1
    p = PagedProblem(num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, query_lens=[24] + [1] * num_seqs,
                     cached_lens=[70] + [window * s % 150 for s in range(num_seqs)], num_prefills=1, dtype=dtype,
                     seed=window, window=window)
    expected, _, _ = p.expected()
    assert relative_error(run_cpu(p), expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcapped_scores_match_reference(isa, dtype):
    # Caps well inside the scores' spread (about N(0, 1) here), so that tanh bends most of them; with a window too.
    for i, (group, head_dim, block_size, softcap, window) in enumerate(
            [(3, 64, 16, 0.7, None), (8, 128, 8, 2.0, None), (2, 64, 32, 1.3, 20)]):
        p = random_problem(500 + i, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype, window=window)
        p.softcap = softcap
        expected, _, _ = p.expected()
        assert relative_error(run_cpu(p), expected) < TOLERANCE[dtype], (group, head_dim, softcap)
        p.softcap = None
        assert relative_error(run_cpu(p), expected) > 10 * TOLERANCE[dtype]  # the cap changed the answer


def test_long_prefill_over_cached_context_and_wide_decode_batch(isa):
    # The shapes the benchmark times, scaled down: a 200-token chunk over 300 cached, and 24 decodes.
    p = PagedProblem(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, query_lens=[200] + [1] * 24,
                     cached_lens=[300] + list(range(100, 580, 20)), num_prefills=1, dtype=torch.float32, seed=5)
    expected, _, _ = p.expected()
    assert relative_error(run_cpu(p), expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_wide_decode_batch_matches_reference_and_each_sequence_served_alone(isa, group, head_dim, dtype):
    # Enough decodes (8 per torch thread) that an item serves several KV heads of its sequence: the rows must
    # come out as the float64 reference has them, and bit for bit as when the sequence is the whole batch.
    rng = random.Random(group * head_dim)
    num_seqs = 8 * torch.get_num_threads() + 3
    p = PagedProblem(num_heads=4 * group, num_kv_heads=4, head_dim=head_dim, block_size=16,
                     query_lens=[1] * num_seqs, cached_lens=[rng.randint(0, 150) for _ in range(num_seqs)],
                     num_prefills=0, dtype=dtype, seed=group + head_dim)
    expected, _, _ = p.expected()
    got = run_cpu(p)
    assert relative_error(got, expected) < TOLERANCE[dtype]
    backend = CpuPagedAttention(p.num_heads, p.num_kv_heads, p.head_dim, p.scale)
    meta = backend.build_metadata(p.layout(), torch.device("cpu"))
    for s in range(0, num_seqs, 5):
        alone = torch.empty_like(got[s : s + 1])
        backend.ops.paged_attention(alone, p.query[s : s + 1], p.key_cache, p.value_cache,
                                    torch.tensor([0, 1], dtype=torch.int32), meta.context_lens[s : s + 1],
                                    meta.block_tables[s : s + 1], p.num_heads, p.scale)
        assert torch.equal(alone, got[s : s + 1])


def test_cache_write_skips_negative_slots_and_refuses_slots_outside():
    ops = load_extension()
    key_cache = torch.zeros(2, 1, 4, 16)
    value_cache = torch.zeros(2, 1, 4, 16)
    key, value = torch.randn(3, 16), torch.randn(3, 16)
    ops.write_cache(key, value, key_cache, value_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(key_cache[1, 0, 1], key[0]) and torch.equal(value_cache[0, 0, 0], value[2])
    assert int((key_cache != 0).any(-1).sum()) == 2
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.write_cache(key, value, key_cache, value_cache, torch.tensor([8, 0, 1]))


def test_kernel_refuses_what_it_cannot_serve():
    p = PagedProblem(num_heads=2, num_kv_heads=1, head_dim=16, block_size=4, query_lens=[1], cached_lens=[6],
                     num_prefills=0, dtype=torch.float32, seed=0)
    backend = CpuPagedAttention(2, 1, 16, p.scale)
    meta = backend.build_metadata(p.layout(), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="block table too short"):
        backend.ops.paged_attention(torch.empty(1, 32), p.query, p.key_cache, p.value_cache, meta.query_start,
                                    meta.context_lens, meta.block_tables[:, :1], 2, p.scale)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        half = p.key_cache.half()
        backend.ops.paged_attention(torch.empty(1, 32).half(), p.query.half(), half, half, meta.query_start,
                                    meta.context_lens, meta.block_tables, 2, p.scale)


def test_metadata_buffers_are_reused_across_steps():
    backend = CpuPagedAttention(4, 2, 16, 0.25)
    big = PagedProblem(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, query_lens=[5, 1, 1],
                       cached_lens=[0, 30, 9], num_prefills=1, dtype=torch.float32, seed=1)
    small = PagedProblem(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, query_lens=[1, 1],
                         cached_lens=[3, 12], num_prefills=0, dtype=torch.float32, seed=2)
    first = backend.build_metadata(big.layout(), torch.device("cpu"))
    second = backend.build_metadata(small.layout(), torch.device("cpu"))
    assert second.block_tables.data_ptr() == first.block_tables.data_ptr()
    assert second.query_start.tolist() == [0, 1, 2] and second.context_lens.tolist() == [4, 13]
    for row, (table, context_len) in enumerate(zip(small.block_tables, small.context_lens)):
        needed = -(-context_len // 4)
        assert second.block_tables[row, :needed].tolist() == table[:needed]


def test_auto_selects_the_cpu_kernels_on_the_cpu():
    cls, reason = select_attention_backend("cpu", head_dim=64, dtype=torch.float32)
    assert cls is CpuPagedAttention, reason
    cls, reason = select_attention_backend("cpu", head_dim=64, dtype=torch.float16)
    assert cls is TorchPagedAttention and "float16" in reason
    cls, reason = select_attention_backend("cpu", head_dim=72, dtype=torch.float32)
    assert cls is TorchPagedAttention and "head_dim 72" in reason
    assert select_attention_backend("cpu", "cpu", head_dim=64, dtype=torch.bfloat16)[0] is CpuPagedAttention
    with pytest.raises(ValueError, match="cannot run here"):
        select_attention_backend("cpu", "cpu", head_dim=72, dtype=torch.float32)
    with pytest.raises(ValueError, match="cannot run on cuda"):
        select_attention_backend("cuda", "cpu", head_dim=64)


def test_a_build_killed_midway_does_not_hang_the_next_load():
    """torch's `lock` file in the build directory, as a build killed while compiling leaves it, is removed under
    the extension's own lock (released by the kernel when its holder dies): the next load goes on, where torch
    alone would wait for the file forever."""
    import subprocess
    import sys
    from pathlib import Path

    load_extension()  # built, so that the load below only loads
    [build_dir] = {Path(p).parent for p in torch.ops.loaded_libraries if "pagedserve_cpu_attention_" in p}
    (build_dir / "lock").touch()
    run = subprocess.run([sys.executable, "-c", "from executor_svc.attention.cpu_backend import load_extension; "
                          "load_extension().select_isa('auto')"], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr
    assert not (build_dir / "lock").exists()
