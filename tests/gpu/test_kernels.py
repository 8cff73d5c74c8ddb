"""Every CUDA kernel against the float64 references, on the GPU (conftest skips these without CUDA and cupy).

Inputs are fresh random draws per case with ragged context lengths, partly filled last blocks and shuffled
block tables; the cache holds NaN wherever a kernel must not read (past each context, unused blocks) or
must write first (this step's slots), and outputs are filled with NaN before each run, so an unwritten
output or a leaked masked value fails the check.
"""
from __future__ import annotations

import random

import pytest
import torch

from executor_svc.attention import cupy_backend
from executor_svc.attention.cupy_backend import CupyPagedAttention, launch_with_cupy, load_kernels
from tests.support.attention_reference import PagedProblem, cache_write_reference

DEVICE = torch.device("cuda")
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
GROUPS = [1, 3, 7, 8]  # query heads per KV head
HEAD_DIMS = [64, 128]
BLOCK_SIZES = [8, 16, 32]


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run_kernels(problem: PagedProblem, backend: CupyPagedAttention | None = None):
    """(output [T, H, D], metadata, launches): one forward through the kernels into a NaN-filled output."""
    backend = backend or CupyPagedAttention(problem.num_heads, problem.num_kv_heads, problem.head_dim, problem.scale)
    meta = backend.build_metadata(problem.layout(), DEVICE)
    out = torch.full((problem.query.shape[0], problem.num_heads * problem.head_dim), float("nan"),
                     dtype=problem.dtype, device=DEVICE)
    launches = backend.plan_forward(problem.query, problem.key, problem.value, problem.key_cache,
                                    problem.value_cache, meta, out, problem.window)
    launch_with_cupy(launches, DEVICE)
    torch.cuda.synchronize()
    return out.view(-1, problem.num_heads, problem.head_dim), meta, launches


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> float:
    out = out.double().cpu()
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} outputs NaN (unwritten, or a masked NaN leaked)"
    rel = ((out - expected).norm() / expected.norm()).item()
    assert rel < TOLERANCE[dtype], f"relative error {rel:.2e} over {TOLERANCE[dtype]:.0e}"
    return rel


def check(problem: PagedProblem, backend: CupyPagedAttention | None = None):
    expected, expected_k, expected_v = problem.expected()
    out, meta, launches = run_kernels(problem, backend)
    assert torch.equal(problem.key_cache.cpu().view(torch.uint8), expected_k.view(torch.uint8)), "key cache write"
    assert torch.equal(problem.value_cache.cpu().view(torch.uint8), expected_v.view(torch.uint8)), "value cache write"
    assert_close(out, expected, problem.dtype)
    if meta.decode_counters is not None:  # the merging CTA of each split row left its counter at zero
        assert not meta.decode_counters.any().item()
    return meta, [launch.kernel for launch in launches]


def kv_heads_for(group: int) -> int:
    return {1: 4, 3: 2, 7: 2, 8: 1}[group]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GROUPS)
def test_mixed_batch_matches_reference(group, head_dim, block_size, dtype):
    """Prefill chunks (fresh and over cached context) and decode rows (split-K on) in one step."""
    seed = 1000 * group + 10 * head_dim + block_size + DTYPES.index(dtype)
    rng = random.Random(seed)
    query_lens = [rng.randint(65, 200), rng.randint(2, 40), 1, 1, 1, 1, 1]
    cached = [0, rng.randint(1, 400), 0, rng.randint(1, 3 * block_size), rng.randint(257, 900),
              rng.randint(1000, 2500), 5 * block_size - 1]
    kv = kv_heads_for(group)
    problem = PagedProblem(num_heads=kv * group, num_kv_heads=kv, head_dim=head_dim, block_size=block_size,
                           query_lens=query_lens, cached_lens=cached, num_prefills=2, dtype=dtype, device=DEVICE,
                           seed=seed)
    meta, kernels = check(problem)
    suffix = cupy_backend.DTYPE_SUFFIX[dtype]
    if dtype == torch.float32:
        assert kernels == [f"cache_write_{suffix}", f"paged_attention_rows_{suffix}_d{head_dim}"]
    else:
        assert meta.decode_partitions > 1
        assert kernels == [f"cache_write_{suffix}", f"paged_prefill_{suffix}_d{head_dim}",
                           f"paged_decode_{suffix}_d{head_dim}"]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("window", [1, 50, 700])
def test_sliding_window_mixed_batch_matches_reference(window, dtype):
    """Prefill chunks longer than the window and split-K decodes far past it; NaN before each first window."""
    query_lens = [200, 33, 1, 1, 1, 1]
    problem = PagedProblem(num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, query_lens=query_lens,
                           cached_lens=[0, 380, 0, 40, 900, 2500], num_prefills=2, dtype=dtype, device=DEVICE,
                           seed=window, window=window)
    meta, _ = check(problem)
    assert dtype == torch.float32 or meta.decode_partitions > 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("split", [False, True], ids=["whole-context", "split-k"])
def test_decode_matches_reference(group, head_dim, dtype, split, monkeypatch):
    if not split:
        monkeypatch.setattr(cupy_backend, "MIN_PARTITION", 1 << 20)  # no context is long enough to split
    rng = random.Random(group * 7 + head_dim + int(split))
    kv = kv_heads_for(group)
    cached = [rng.randint(0, 3000) for _ in range(12)] + [0, 15, 16, 17]
    problem = PagedProblem(num_heads=kv * group, num_kv_heads=kv, head_dim=head_dim, block_size=16,
                           query_lens=[1] * len(cached), cached_lens=cached, num_prefills=0, dtype=dtype,
                           device=DEVICE, seed=rng.randrange(1 << 30))
    meta, kernels = check(problem)
    assert (meta.decode_partitions > 1) == split
    assert kernels == [f"cache_write_{cupy_backend.DTYPE_SUFFIX[dtype]}", f"paged_decode_{cupy_backend.DTYPE_SUFFIX[dtype]}_d{head_dim}"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_long_prefill_chunks_match_reference(head_dim, dtype):
    """Many row tiles and key tiles: a 700-token prompt and a 300-token chunk over 1200 cached tokens."""
    problem = PagedProblem(num_heads=14, num_kv_heads=2, head_dim=head_dim, block_size=16, query_lens=[700, 300],
                           cached_lens=[0, 1200], num_prefills=2, dtype=dtype, device=DEVICE, seed=head_dim)
    check(problem)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_row_kernel_in_16_bit_matches_reference(dtype, monkeypatch):
    """The CUDA-core row kernel (the float32 path) instantiated for 16-bit caches, as a second implementation."""
    monkeypatch.setattr(cupy_backend, "TENSOR_CORE_DTYPES", ())
    problem = PagedProblem(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, query_lens=[33, 1, 1],
                           cached_lens=[40, 0, 500], num_prefills=1, dtype=dtype, device=DEVICE, seed=3)
    _, kernels = check(problem)
    assert kernels[1].startswith("paged_attention_rows_")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_cache_write_skips_negative_slots(dtype):
    problem = PagedProblem(num_heads=8, num_kv_heads=2, head_dim=128, block_size=32, query_lens=[5, 1, 1],
                           cached_lens=[0, 31, 64], num_prefills=1, dtype=dtype, device=DEVICE, poison=False)
    problem.slot_mapping[[1, 5]] = -1
    expected_k, expected_v = cache_write_reference(problem.key_cache.cpu(), problem.value_cache.cpu(),
                                                   problem.key.cpu(), problem.value.cpu(), problem.slot_mapping.cpu())
    backend = CupyPagedAttention(8, 2, 128, problem.scale)
    meta = backend.build_metadata(problem.layout(), DEVICE)
    out = torch.empty(7, 8 * 128, dtype=dtype, device=DEVICE)
    launches = backend.plan_forward(problem.query, problem.key, problem.value, problem.key_cache,
                                    problem.value_cache, meta, out)
    launch_with_cupy(launches[:1], DEVICE)
    torch.cuda.synchronize()
    assert torch.equal(problem.key_cache.cpu(), expected_k) and torch.equal(problem.value_cache.cpu(), expected_v)


def test_forward_returns_the_attention_output():
    problem = PagedProblem(num_heads=14, num_kv_heads=2, head_dim=64, block_size=16, query_lens=[20, 1, 1],
                           cached_lens=[5, 100, 2000], num_prefills=1, dtype=torch.bfloat16, device=DEVICE, seed=11)
    expected, _, _ = problem.expected()
    backend = CupyPagedAttention(14, 2, 64, problem.scale)
    meta = backend.build_metadata(problem.layout(), DEVICE)
    out = backend.forward(problem.query, problem.key, problem.value, problem.key_cache, problem.value_cache, meta)
    torch.cuda.synchronize()
    assert out.shape == (22, 14 * 64) and out.dtype == torch.bfloat16
    assert_close(out.view(22, 14, 64), expected, torch.bfloat16)


def test_kernels_run_on_a_side_stream_in_order():
    """Launches follow torch's current stream: work queued before them on that stream is visible to them."""
    problem = PagedProblem(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, query_lens=[1, 1],
                           cached_lens=[300, 40], num_prefills=0, dtype=torch.bfloat16, device=DEVICE, seed=12)
    backend = CupyPagedAttention(8, 2, 64, problem.scale)
    meta = backend.build_metadata(problem.layout(), DEVICE)
    fresh = torch.randn(problem.qkv.shape, dtype=torch.bfloat16, device=DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # keeps the stream busy, so a launch on another stream would run first
        problem.qkv.copy_(fresh)
        out = backend.forward(problem.query, problem.key, problem.value, problem.key_cache, problem.value_cache, meta)
    torch.cuda.synchronize()
    expected, _, _ = problem.expected()
    assert_close(out.view(2, 8, 64), expected, torch.bfloat16)


def test_decode_forward_is_cuda_graph_capturable():
    """A decode-only forward captured once, then replayed after refilling the metadata with another batch
    (other contexts, tables, queries and cache contents) gives that batch's answer; the forward itself makes
    no synchronising torch call."""
    rows, capacity = 8, 4096
    first = PagedProblem(num_heads=14, num_kv_heads=2, head_dim=64, block_size=16, query_lens=[1] * rows,
                         cached_lens=[300, 1, 1200, 77, 640, 2000, 16, 999], num_prefills=0, dtype=torch.bfloat16,
                         device=DEVICE, seed=13, spare_blocks=2048)
    later = PagedProblem(num_heads=14, num_kv_heads=2, head_dim=64, block_size=16, query_lens=[1] * rows,
                         cached_lens=[4000, 5, 0, 2500, 33, 1024, 700, 64], num_prefills=0, dtype=torch.bfloat16,
                         device=DEVICE, seed=14)
    assert later.key_cache.shape[0] <= first.key_cache.shape[0]
    backend = CupyPagedAttention(14, 2, 64, first.scale)
    meta = backend.build_metadata(first.layout(), DEVICE, context_capacity=capacity)
    assert meta.decode_partitions > 1
    load_kernels(DEVICE)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda.set_sync_debug_mode("error")
        try:
            backend.forward(first.query, first.key, first.value, first.key_cache, first.value_cache, meta)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(first.query, first.key, first.value, first.key_cache, first.value_cache, meta)

    # The next step: new rows in the captured tensors, metadata refilled in place.
    expected, expected_k, expected_v = later.expected()
    used = later.key_cache.shape[0]
    first.qkv.copy_(later.qkv)
    first.key_cache[:used].copy_(later.key_cache)
    first.value_cache[:used].copy_(later.value_cache)
    first.key_cache[used:] = float("nan")
    first.value_cache[used:] = float("nan")
    backend.refill_metadata(meta, later.layout())
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(first.key_cache[:used].cpu().view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(first.value_cache[:used].cpu().view(torch.uint8), expected_v.view(torch.uint8))
    assert_close(out.view(rows, 14, 64), expected, torch.bfloat16)


def test_load_kernels_reports_no_local_memory():
    """Every kernel loads on this device; the driver's view of registers agrees with no spilling build."""
    import cupy

    registers = load_kernels(DEVICE)
    assert set(registers) == set(cupy_backend.kernel_names())
    for name in registers:
        kernel = cupy_backend._kernel(name, DEVICE.index or 0, 0)
        assert kernel.local_size_bytes == 0, f"{name} uses {kernel.local_size_bytes} bytes of local memory"
        assert 0 < kernel.num_regs <= 255
    assert cupy.cuda.runtime.getDevice() == torch.cuda.current_device()
