"""CPU-side checks of the CUDA attention kernels and the CuPy backend; none needs a GPU.

* tools/kernels_check.py compiles every kernel for sm_90 without spills or stack frames (needs nvcc);
* the backend's host half: index arrays (plan_batch), split-K planning, metadata, launch plans and the
  argument checks, and backend selection;
* the float64 references agree with TorchPagedAttention on random ragged batches with shuffled block
  tables, so the GPU tests can trust them;
* the kernels themselves, built as C++ for the host (g++) with an emulator of the CUDA features they use
  (threads as fibers, barriers, warp shuffles, ldmatrix, mma.sync, cp.async, shared memory), run through the
  backend's own launch plans against the references: index arithmetic, masking, split-K, GQA packing and
  synchronisation are checked here; timing, the PTX itself and the real tensor cores only on a GPU.
"""
from __future__ import annotations

import ctypes
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from executor_svc.attention import cupy_backend
from executor_svc.attention.cupy_backend import (
    CupyPagedAttention, KERNEL_DIR, MIN_PARTITION, DECODE_TILE, PREFILL_ROWS, SM90, SmLimits, decode_smem_bytes,
    default_decode_slots, kernel_names, plan_batch, plan_decode_partitions, resident_ctas,
)
from executor_svc.attention.layout import BatchLayout
from executor_svc.attention.selection import select_attention_backend
from executor_svc.attention.torch_backend import TorchPagedAttention, write_cache
from tests.support.attention_reference import PagedProblem, cache_write_reference, paged_decode_reference

ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------------------------------------
# kernels_check
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_kernels_check_compiles_every_kernel_without_spills():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "kernels_check.py")], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in kernel_names():
        assert name in proc.stdout


def import_kernels_check():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import kernels_check
    finally:
        sys.path.pop(0)
    return kernels_check


def test_kernels_check_without_any_compiler_is_unchecked_not_passed(monkeypatch, capsys, tmp_path):
    kernels_check = import_kernels_check()
    monkeypatch.setattr(kernels_check, "find_nvcc", lambda explicit: None)
    monkeypatch.setattr(kernels_check, "find_nvrtc", lambda: None)
    assert kernels_check.main(["--json", str(tmp_path / "check.json")]) == 2
    assert "UNCHECKED" in capsys.readouterr().out
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["status"] == "unchecked" and report["kernels"] == {} and report["failures"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_kernels_check_gives_the_same_verdict_through_nvrtc_alone(monkeypatch, tmp_path):
    """What a GPU machine without the toolkit runs: NVRTC (as CuPy compiles) reads the same spills and frames."""
    kernels_check = import_kernels_check()
    if kernels_check.find_nvrtc() is None:
        pytest.skip("libnvrtc not found (NVRTC_LIBRARY, the nvidia-cuda-nvrtc wheel or the toolkit)")
    assert kernels_check.main(["--json", str(tmp_path / "both.json")]) == 0
    monkeypatch.setattr(kernels_check, "find_nvcc", lambda explicit: None)
    assert kernels_check.main(["--json", str(tmp_path / "nvrtc.json")]) == 0
    both, alone = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("both", "nvrtc"))
    assert both["status"] == alone["status"] == "passed" and alone["compilers"]["nvcc"] is None
    assert set(alone["kernels"]) == {"nvrtc"} and set(alone["kernels"]["nvrtc"]) == set(kernel_names())
    assert alone["kernels"]["nvrtc"] == both["kernels"]["nvrtc"]


def test_kernels_check_parses_ptxas_output():
    kernels_check = import_kernels_check()
    text = """ptxas info    : Compiling entry function 'paged_decode_bf16_d64' for 'sm_90'
ptxas info    : Function properties for paged_decode_bf16_d64
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 64 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'cache_write_f32' for 'sm_90'
ptxas info    : Function properties for cache_write_f32
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 26 registers, used 0 barriers
"""
    parsed = kernels_check.parse_ptxas(text)
    assert parsed["paged_decode_bf16_d64"] == {"registers": 96, "smem": 64, "spill_stores": 4, "spill_loads": 12,
                                               "stack": 8}
    assert parsed["cache_write_f32"]["registers"] == 26 and parsed["cache_write_f32"]["stack"] == 0


# ---------------------------------------------------------------------------------------------------------
# Host half of the backend: plans, metadata, launches, checks, selection
# ---------------------------------------------------------------------------------------------------------


def mixed_layout(block_size=16, seed=0):
    """Two prefill chunks (one with cached context) and three decode rows, shuffled tables."""
    rng = random.Random(seed)
    query_lens = [37, 5, 1, 1, 1]
    context_lens = [37, 70, 3, 300, 129]
    pool = list(range(200))
    rng.shuffle(pool)
    tables = []
    for ctx in context_lens:
        n = -(-ctx // block_size) + 1
        tables.append([pool.pop() for _ in range(n)])
    slots = [t[p // block_size] * block_size + p % block_size
             for n, ctx, t in zip(query_lens, context_lens, tables) for p in range(ctx - n, ctx)]
    return BatchLayout(query_lens, context_lens, tables, 2, torch.tensor(slots), block_size)


def test_plan_batch_index_arrays():
    layout = mixed_layout()
    plan = plan_batch(layout, num_heads=14, num_kv_heads=2)
    group = 7
    assert plan.num_tokens == 45 and plan.num_prefills == 2 and plan.num_prefill_tokens == 42 and plan.num_decodes == 3
    assert plan.block_tables.dtype == np.int32 and plan.block_tables.shape == (5, -(-300 // 16))
    for i, (ctx, table) in enumerate(zip(layout.context_lens, layout.block_tables)):
        needed = -(-ctx // 16)
        assert plan.block_tables[i, :needed].tolist() == table[:needed]
        assert not plan.block_tables[i, needed:].any()
    assert plan.prefill_seqs.tolist() == [[0, 37, 37], [37, 5, 70]]
    # Work items tile each prefill's packed (query, head) rows exactly once, the longest key sweeps first.
    covered = {}
    for seq, m0 in plan.prefill_work.tolist():
        covered.setdefault(seq, []).append(m0)
    assert sorted(covered[0]) == list(range(0, 37 * group, PREFILL_ROWS))
    assert sorted(covered[1]) == list(range(0, 5 * group, PREFILL_ROWS))

    def keys_swept(seq, m0):
        n, ctx = layout.query_lens[seq], layout.context_lens[seq]
        return ctx - n + (min(m0 + PREFILL_ROWS, n * group) - 1) // group + 1

    sweeps = [keys_swept(seq, m0) for seq, m0 in plan.prefill_work.tolist()]
    assert sweeps == sorted(sweeps, reverse=True) and sweeps[0] == 70
    assert plan.decode_context_lens.tolist() == [3, 300, 129]
    assert plan.row_seq.tolist() == [0] * 37 + [1] * 5 + [2, 3, 4]
    assert plan.row_keys.tolist() == list(range(1, 38)) + list(range(66, 71)) + [3, 300, 129]


def test_resident_ctas_follows_the_binding_limit():
    # paged_decode at D = 64: 94 registers -> 3,072 per warp, 12,288 per CTA: 5 CTAs by registers; 39,168 B of
    # shared memory + 1 KB reserve: 5 by shared memory. At D = 128 (164 registers, 73,984 B): 3 by both.
    assert resident_ctas(128, 94, decode_smem_bytes(64), SM90) == 5
    assert resident_ctas(128, 164, decode_smem_bytes(128), SM90) == 3
    assert default_decode_slots(64) == 132 * 5 and default_decode_slots(128) == 132 * 3
    assert resident_ctas(128, 32, 0, SM90) == 16  # threads bind: 2,048 / 128
    assert resident_ctas(32, 16, 0, SM90) == 32  # the CTA limit binds
    assert resident_ctas(128, 94, 100 * 1024, SmLimits(shared_memory=100 * 1024)) == 1  # never below one


def test_plan_decode_partitions():
    slots = 660  # 132 SMs x 5 CTAs
    # Enough rows to fill whole waves: one partition covering the longest context (rounded to the tile).
    assert plan_decode_partitions(330, 2, 2048, slots) == (1, 2048)
    assert plan_decode_partitions(4, 2, 100, slots) == (1, 128)
    assert plan_decode_partitions(4, 2, MIN_PARTITION, slots) == (1, MIN_PARTITION)
    # Batch 64 x 2 KV heads = 128 CTAs over 660 slots: 5 partitions of 7 tiles fill one wave (640 CTAs).
    assert plan_decode_partitions(64, 2, 2048, slots) == (5, 448)
    # 64 x 8 KV heads at D = 128 (396 slots): 512 CTAs leave a short second wave; 3 partitions make 4 full ones.
    assert plan_decode_partitions(64, 8, 2048, 396) == (3, 704)
    for rows, ctas_per_row, max_ctx in [(1, 2, 512), (16, 2, 2048), (64, 2, 2048), (1, 8, 8192), (3, 1, 100000)]:
        parts, size = plan_decode_partitions(rows, ctas_per_row, max_ctx, slots)
        assert size % DECODE_TILE == 0 and size >= MIN_PARTITION
        assert parts * size >= max_ctx > (parts - 1) * size  # every partition starts inside the longest context
        assert rows * ctas_per_row * parts <= slots  # these all fit in one wave
    assert plan_decode_partitions(0, 2, 0, slots) == (1, DECODE_TILE)


def test_build_metadata_on_cpu_is_int32_and_sliced_from_one_buffer():
    backend = CupyPagedAttention(14, 2, 64, 0.125)
    meta = backend.build_metadata(mixed_layout(), torch.device("cpu"))
    for name in ("slot_mapping", "block_tables", "prefill_seqs", "prefill_work", "decode_context_lens", "row_seq",
                 "row_keys"):
        t = getattr(meta, name)
        assert t.dtype == torch.int32 and t.device.type == "cpu" and t.is_contiguous(), name
    assert meta.slot_mapping.tolist() == mixed_layout().slot_mapping.tolist()
    assert meta.table_stride == meta.block_tables.shape[1] and meta.num_prefill_work == meta.prefill_work.shape[0]
    # 3 decode rows x 2 KV heads leave most CTA slots idle: the 300-token context is split.
    assert meta.decode_partitions > 1
    assert tuple(meta.decode_part_out.shape) == (3, 14, meta.decode_partitions, 64)
    assert tuple(meta.decode_part_ml.shape) == (3, 14, meta.decode_partitions, 2)
    assert meta.decode_part_out.dtype == torch.float32
    assert meta.decode_counters.dtype == torch.int32 and meta.decode_counters.tolist() == [[0, 0]] * 3


def decode_layout(context_lens, block_size=16, seed=0):
    rng = random.Random(seed)
    pool = list(range(1000))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-ctx // block_size))] for ctx in context_lens]
    slots = [t[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size for ctx, t in zip(context_lens, tables)]
    return BatchLayout([1] * len(context_lens), list(context_lens), tables, 0, torch.tensor(slots), block_size)


def test_refill_metadata_matches_a_fresh_build():
    backend = CupyPagedAttention(14, 2, 64, 0.125)
    meta = backend.build_metadata(decode_layout([10, 300, 64, 1]), torch.device("cpu"), context_capacity=2048)
    assert meta.table_stride == 2048 // 16
    assert meta.decode_partitions * meta.decode_partition_size >= 2048
    tensors = {name: getattr(meta, name) for name in ("block_tables", "decode_context_lens", "row_seq", "row_keys",
                                                      "slot_mapping")}
    pointers = {name: t.data_ptr() for name, t in tensors.items()}
    later = decode_layout([2000, 17, 1, 999], seed=1)
    backend.refill_metadata(meta, later)
    fresh = plan_batch(later, 14, 2)
    assert {name: getattr(meta, name).data_ptr() for name in pointers} == pointers  # same tensors, new contents
    width = fresh.block_tables.shape[1]
    assert meta.block_tables[:, :width].numpy().tolist() == fresh.block_tables.tolist()
    assert not meta.block_tables[:, width:].any()
    assert meta.decode_context_lens.tolist() == [2000, 17, 1, 999]
    assert meta.row_keys.tolist() == [2000, 17, 1, 999] and meta.row_seq.tolist() == [0, 1, 2, 3]
    assert meta.slot_mapping.tolist() == later.slot_mapping.tolist()


@pytest.mark.parametrize("layout, message", [
    (decode_layout([10, 20, 30]), "3 rows"),
    (decode_layout([10, 20, 30, 2049]), "capacity"),
    (mixed_layout(), "decode-only"),
])
def test_refill_metadata_rejects_what_does_not_fit(layout, message):
    backend = CupyPagedAttention(14, 2, 64, 0.125)
    meta = backend.build_metadata(decode_layout([10, 300, 64, 1]), torch.device("cpu"), context_capacity=2048)
    with pytest.raises(ValueError, match=message):
        backend.refill_metadata(meta, layout)


@pytest.mark.parametrize("change, message", [
    (lambda l: setattr(l, "block_size", 12), "power of two"),
    (lambda l: l.block_tables[1].__delitem__(slice(1, None)), "needs 5 blocks"),
    (lambda l: l.query_lens.__setitem__(3, 2), "prefill chunks"),
    (lambda l: l.context_lens.__setitem__(0, 30), "query_len"),
    (lambda l: setattr(l, "slot_mapping", l.slot_mapping[:-1]), "slot_mapping"),
    (lambda l: l.context_lens.pop(), "disagree"),
])
def test_plan_batch_rejects_inconsistent_layouts(change, message):
    layout = mixed_layout()
    change(layout)
    with pytest.raises(ValueError, match=message):
        plan_batch(layout, 14, 2)


def test_backend_rejects_unsupported_shapes():
    with pytest.raises(ValueError, match="head_dim"):
        CupyPagedAttention(8, 2, 96, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        CupyPagedAttention(6, 4, 64, 0.1)


def make_inputs(dtype=torch.bfloat16, heads=(14, 2), head_dim=64, block_size=16):
    problem = PagedProblem(num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size,
                           query_lens=[37, 5, 1, 1, 1], cached_lens=[0, 65, 2, 299, 128], num_prefills=2,
                           dtype=dtype)
    backend = CupyPagedAttention(heads[0], heads[1], head_dim, head_dim**-0.5)
    meta = backend.build_metadata(problem.layout(), torch.device("cpu"))
    out = torch.empty(problem.query.shape[0], heads[0] * head_dim, dtype=dtype)
    return backend, problem, meta, out


def test_plan_forward_bf16_launches_and_arguments():
    backend, p, meta, out = make_inputs()
    launches = backend.plan_forward(p.query, p.key, p.value, p.key_cache, p.value_cache, meta, out)
    assert [l.kernel for l in launches] == ["cache_write_bf16", "paged_prefill_bf16_d64", "paged_decode_bf16_d64"]
    write, prefill, decode = launches
    assert write.grid == (-(-45 * 2 * 8 // 128), 1, 1) and write.block == (128, 1, 1)
    assert write.args[:5] == (p.key.data_ptr(), p.value.data_ptr(), p.key_cache.data_ptr(), p.value_cache.data_ptr(),
                              meta.slot_mapping.data_ptr())
    assert write.args[-2:] == (p.key.stride(0), p.value.stride(0)) and write.args[-1] == (14 + 2 * 2) * 64
    assert prefill.grid == (meta.num_prefill_work, 2, 1) and prefill.smem == cupy_backend.prefill_smem_bytes(64)
    assert decode.grid == (3, 2, meta.decode_partitions) and decode.smem == cupy_backend.decode_smem_bytes(64)
    # Split-K workspace: partial outputs, (max, denominator) pairs, the merge counters.
    assert decode.args[1:4] == (meta.decode_part_out.data_ptr(), meta.decode_part_ml.data_ptr(),
                                meta.decode_counters.data_ptr())
    # Decode rows read the table rows after the two prefill sequences, and write rows after the 42 prefill tokens.
    assert decode.args[7] == meta.block_tables.data_ptr() + 2 * meta.table_stride * 4
    assert decode.args[14] == 42
    for launch in launches:
        for arg in launch.args:
            assert isinstance(arg, (int, np.int32, np.int64, np.float32)), (launch.kernel, arg)
    assert decode.args[-3:] == (np.float32(64**-0.5 * cupy_backend.LOG2_E), cupy_backend.NO_WINDOW, 0.0)
    windowed = backend.plan_forward(p.query, p.key, p.value, p.key_cache, p.value_cache, meta, out, 24, 50.0)
    for launch in windowed[1:]:
        assert launch.args[-2:] == (24, np.float32(50.0 * cupy_backend.LOG2_E))
    with pytest.raises(ValueError, match="window must be at least 1"):
        backend.plan_forward(p.query, p.key, p.value, p.key_cache, p.value_cache, meta, out, 0)
    with pytest.raises(ValueError, match="softcap must be positive"):
        backend.plan_forward(p.query, p.key, p.value, p.key_cache, p.value_cache, meta, out, None, -1.0)


def test_plan_forward_float32_uses_the_row_kernel():
    backend, p, meta, out = make_inputs(dtype=torch.float32, heads=(8, 8), head_dim=128)
    launches = backend.plan_forward(p.query, p.key, p.value, p.key_cache, p.value_cache, meta, out)
    assert [l.kernel for l in launches] == ["cache_write_f32", "paged_attention_rows_f32_d128"]
    assert launches[1].grid == (45, 8, 1) and launches[1].block == (32, 1, 1)


@pytest.mark.parametrize("spoil, message", [
    (lambda p, m, o: (p.query.float(), p.key, p.value, p.key_cache, p.value_cache, m, o), "query is"),
    (lambda p, m, o: (p.query, p.key, p.value, p.key_cache[:, :1], p.value_cache, m, o), "key_cache has shape"),
    (lambda p, m, o: (p.query, p.key, p.value, p.key_cache, p.value_cache.transpose(1, 2), m, o), "value_cache"),
    (lambda p, m, o: (p.query[:-1], p.key, p.value, p.key_cache, p.value_cache, m, o), "rows"),
    (lambda p, m, o: (p.query, p.key.t().contiguous().t(), p.value, p.key_cache, p.value_cache, m, o), "contiguous"),
    (lambda p, m, o: (p.query, p.key, p.value, p.key_cache, p.value_cache, m, o[:, :-8]), "out has shape"),
])
def test_plan_forward_rejects_bad_inputs(spoil, message):
    backend, p, meta, out = make_inputs()
    with pytest.raises(ValueError, match=message):
        backend.plan_forward(*spoil(p, meta, out))


def test_plan_forward_rejects_misaligned_rows_and_wrong_metadata_dtype():
    backend, p, meta, out = make_inputs()
    odd = torch.zeros(p.query.shape[0], 14 * 64 + 1, dtype=torch.bfloat16)[:, 1:]  # rows start 2 bytes in
    odd.copy_(p.query)
    with pytest.raises(ValueError, match="16-byte"):
        backend.plan_forward(odd, p.key, p.value, p.key_cache, p.value_cache, meta, out)
    meta.slot_mapping = meta.slot_mapping.long()
    with pytest.raises(ValueError, match="slot_mapping"):
        backend.plan_forward(p.query, p.key, p.value, p.key_cache, p.value_cache, meta, out)


def test_select_attention_backend_on_cpu():
    cls, reason = select_attention_backend("cpu")
    assert cls.name == "cpu" and reason.startswith("cpu: C++ kernels")  # tests/unit/test_cpu_attention.py
    assert select_attention_backend("cpu", "torch")[0] is TorchPagedAttention
    with pytest.raises(ValueError, match="cannot run here"):
        select_attention_backend("cpu", "cupy")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_attention_backend("cpu", "flash")


def test_select_attention_backend_auto_on_cuda_paths(monkeypatch):
    monkeypatch.setattr(cupy_backend, "supported_reason", lambda device: None)
    assert select_attention_backend("cuda:0")[0] is CupyPagedAttention
    cls, reason = select_attention_backend("cuda:0", head_dim=80)
    assert cls is TorchPagedAttention and "head_dim 80" in reason
    monkeypatch.setattr(cupy_backend, "supported_reason", lambda device: "cupy is not importable (ImportError)")
    cls, reason = select_attention_backend("cuda:0")
    assert cls is TorchPagedAttention and "cupy is not importable" in reason


def test_kernel_source_is_one_translation_unit():
    source = cupy_backend.kernel_source()
    assert "#include" not in source and "#pragma once" not in source
    assert len(kernel_names(source)) == len(set(kernel_names(source))) == 17
    for name in kernel_names(source):
        assert f'extern "C"' in source and name in source


# ---------------------------------------------------------------------------------------------------------
# The references agree with TorchPagedAttention
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (24, 2.0), (None, 0.8)])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_references_match_torch_backend_on_random_ragged_batches(seed, dtype, tolerance, window, softcap):
    rng = random.Random(seed)
    num_kv_heads, group = rng.choice([(1, 1), (2, 3), (2, 7), (4, 2)])
    head_dim, block_size = rng.choice([16, 64]), rng.choice([4, 8, 16])
    num_prefills = rng.randint(0, 3)
    num_decodes = rng.randint(0 if num_prefills else 1, 6)
    query_lens = [rng.randint(2, 40) for _ in range(num_prefills)] + [1] * num_decodes
    cached = [rng.choice([0, rng.randint(1, 90)]) for _ in range(num_prefills)] + \
             [rng.randint(0, 150) for _ in range(num_decodes)]
    # The torch backend multiplies masked probabilities by whatever the cache holds: no NaN poison here.
    p = PagedProblem(num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     block_size=block_size, query_lens=query_lens, cached_lens=cached, num_prefills=num_prefills,
                     dtype=dtype, seed=seed, poison=False, window=window, softcap=softcap)
    expected, key_cache, value_cache = p.expected()

    backend = TorchPagedAttention(p.num_heads, num_kv_heads, head_dim, p.scale)
    meta = backend.build_metadata(p.layout(), torch.device("cpu"))
    got = backend.forward(p.query, p.key, p.value, p.key_cache, p.value_cache, meta, window, softcap)
    assert torch.equal(p.key_cache, key_cache) and torch.equal(p.value_cache, value_cache)
    got = got.view(expected.shape).double()
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel < tolerance, rel


def test_cache_write_reference_matches_torch_and_skips_padding():
    p = PagedProblem(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, query_lens=[6, 1], cached_lens=[0, 9],
                     num_prefills=1, dtype=torch.float32, poison=False)
    slots = p.slot_mapping.clone()
    slots[2] = -1
    key_cache, value_cache = cache_write_reference(p.key_cache, p.value_cache, p.key, p.value, slots)
    keep = slots >= 0
    kc, vc = p.key_cache.clone(), p.value_cache.clone()
    write_cache(kc, vc, p.key.reshape(7, 2, 16)[keep], p.value.reshape(7, 2, 16)[keep], slots[keep])
    assert torch.equal(kc, key_cache) and torch.equal(vc, value_cache)


def test_decode_reference_is_softmax_over_whole_context():
    p = PagedProblem(num_heads=2, num_kv_heads=1, head_dim=8, block_size=4, query_lens=[1], cached_lens=[6],
                     num_prefills=0, dtype=torch.float64, poison=False)
    expected, kc, vc = p.expected()
    keys = torch.stack([kc[p.block_tables[0][i // 4], 0, i % 4] for i in range(7)])
    values = torch.stack([vc[p.block_tables[0][i // 4], 0, i % 4] for i in range(7)])
    q = p.query.view(2, 8)
    manual = torch.softmax(q @ keys.T * p.scale, -1) @ values
    assert torch.allclose(expected[0], manual)
    assert torch.allclose(paged_decode_reference(p.query, kc, vc, p.context_lens, p.block_tables, p.scale), expected)


# ---------------------------------------------------------------------------------------------------------
# The kernels, emulated on the host
# ---------------------------------------------------------------------------------------------------------

EMULATOR_DIR = Path(__file__).resolve().parent / "kernel_emulator"


# Scheduling modes of the emulator: (cp.async lands at issue, thread order, CTAs last to first). Deferred
# copies expose a missing cp.async wait; eager copies with warp-serial orders expose a missing barrier (a
# warp running ahead and overwriting a stage the others still read); the reversed grid makes another
# partition of each split-K row the last to count, so the merge must not depend on which one it is.
EMULATION_MODES = ((0, 0, 0), (1, 1, 0), (1, 2, 1), (0, 2, 1))


class EmulatedLauncher:
    """Runs the backend's Launch records through the host-compiled kernels (ctypes)."""

    def __init__(self, library: Path) -> None:
        self.lib = ctypes.CDLL(str(library))
        self.lib.emu_launch.restype = ctypes.c_int
        self.ranges: list[torch.Tensor] | None = None  # the tensors kernels may touch; None: unchecked
        self.launches: list = []

    @property
    def kernels(self) -> list[str]:
        return [launch.kernel for launch in self.launches]

    def configure(self, eager_copies: int, order: int, reverse_grid: int) -> None:
        self.lib.emu_configure(ctypes.c_int(eager_copies), ctypes.c_int(order), ctypes.c_int(reverse_grid))

    def __call__(self, launches, device) -> None:
        for launch in launches:
            self.launches.append(launch)
            values = []
            for arg in launch.args:
                if isinstance(arg, np.int32):
                    values.append(ctypes.c_int32(int(arg)))
                elif isinstance(arg, np.int64):
                    values.append(ctypes.c_int64(int(arg)))
                elif isinstance(arg, np.float32):
                    values.append(ctypes.c_float(float(arg)))
                elif isinstance(arg, int):
                    values.append(ctypes.c_void_p(arg))
                else:
                    raise TypeError(f"{launch.kernel}: argument {arg!r} has type {type(arg).__name__}")
            pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
            ranges = self.ranges or []
            starts = (ctypes.c_void_p * max(1, len(ranges)))(*[t.data_ptr() for t in ranges])
            sizes = (ctypes.c_ulonglong * max(1, len(ranges)))(*[t.numel() * t.element_size() for t in ranges])
            error = ctypes.create_string_buffer(512)
            rc = self.lib.emu_launch(
                launch.kernel.encode(), *(ctypes.c_uint(v) for v in launch.grid), *(ctypes.c_uint(v) for v in launch.block),
                ctypes.c_uint(launch.smem), pointers, starts, sizes,
                ctypes.c_int(len(ranges) if self.ranges is not None else -1), error, ctypes.c_int(len(error)),
            )
            if rc != 0:
                raise RuntimeError(f"{launch.kernel} grid {launch.grid}: {error.value.decode()}")


@pytest.fixture(scope="session")
def emulator_library(tmp_path_factory) -> Path:
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not installed: the kernel emulation needs it")
    folder = tmp_path_factory.mktemp("kernel_emulator")
    kernels = " ".join(f"X({name})" for name in kernel_names())
    library = folder / "libkernels_emulated.so"
    cmd = [compiler, "-std=c++20", "-O2", "-shared", "-fPIC", "-w", "-I", str(KERNEL_DIR),
           f"-DEMU_KERNEL_LIST(X)={kernels}", str(EMULATOR_DIR / "emulator.cpp"), "-o", str(library)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return library


def run_emulated(library, problem: PagedProblem, modes=EMULATION_MODES):
    """Output [T, H, D] and caches after one emulated forward, identical (bitwise) in every mode."""
    backend = CupyPagedAttention(problem.num_heads, problem.num_kv_heads, problem.head_dim, problem.scale,
                                 launcher=EmulatedLauncher(library))
    meta = backend.build_metadata(problem.layout(), torch.device("cpu"))
    key_cache0, value_cache0 = problem.key_cache.clone(), problem.value_cache.clone()
    results = []
    for mode in modes:
        key_cache, value_cache = key_cache0.clone(), value_cache0.clone()
        for workspace in (meta.decode_part_out, meta.decode_part_ml):  # a merge of unwritten partials shows
            if workspace is not None:
                workspace.fill_(float("nan"))
        out = torch.full((problem.query.shape[0], problem.num_heads * problem.head_dim), float("nan"),
                         dtype=problem.dtype)
        launcher = backend.launcher
        launcher.ranges = [problem.qkv, key_cache, value_cache, out] + [
            t for t in (meta.slot_mapping, meta.block_tables, meta.prefill_seqs, meta.prefill_work,
                        meta.decode_context_lens, meta.row_seq, meta.row_keys, meta.decode_part_out,
                        meta.decode_part_ml, meta.decode_counters) if t is not None and t.numel()]
        launcher.configure(*mode)
        launcher(backend.plan_forward(problem.query, problem.key, problem.value, key_cache, value_cache, meta, out,
                                      problem.window, problem.softcap), None)
        if meta.decode_counters is not None:  # each row's merging CTA reset its counter for the next launch
            assert not meta.decode_counters.any(), meta.decode_counters
        results.append((out, key_cache, value_cache))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "result depends on thread scheduling"
    out, key_cache, value_cache = results[0]
    return out.view(-1, problem.num_heads, problem.head_dim), key_cache, value_cache, meta, backend.launcher.kernels


def check_emulated(library, tolerance=None, **problem_args):
    problem = PagedProblem(**problem_args)
    out, key_cache, value_cache, meta, kernels = run_emulated(library, problem)
    expected, expected_k, expected_v = problem.expected()
    # The cache write is a copy: bitwise equal, NaN poison included.
    assert torch.equal(key_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), expected_v.view(torch.uint8))
    assert not torch.isnan(out).any(), "an output was not written, or a masked NaN leaked in"
    got = out.double()
    rel = ((got - expected).norm() / expected.norm()).item()
    limit = tolerance if tolerance is not None else (1e-5 if problem.dtype == torch.float32 else 1e-2)
    assert rel < limit, f"relative error {rel:.2e}"
    return meta, kernels


EMULATED_CASES = {
    # name: (dtype, heads (q, kv), head_dim, block_size, query_lens, cached_lens, num_prefills)
    "decode-gqa7-split": (torch.bfloat16, (14, 2), 64, 16, [1, 1, 1], [4, 299, 700], 0),
    "decode-mha-d128": (torch.float16, (8, 8), 128, 8, [1, 1], [0, 32], 0),
    "decode-gqa20-headgroups-split": (torch.bfloat16, (40, 2), 64, 8, [1, 1], [9, 600], 0),
    "prefill-gqa3-bs32": (torch.bfloat16, (6, 2), 64, 32, [37, 5], [0, 65], 2),
    "prefill-gqa7-d128-4-key-tiles": (torch.bfloat16, (7, 1), 128, 16, [30, 1], [170, 199], 1),
    "prefill-mha-2-row-tiles": (torch.float16, (3, 3), 64, 32, [70], [130], 1),
    "mixed-gqa8-d128": (torch.float16, (8, 1), 128, 16, [20, 1, 1], [30, 8, 129], 1),
    "mixed-gqa8-bs8": (torch.bfloat16, (32, 4), 64, 8, [17, 9, 1, 1, 1, 1], [0, 40, 0, 15, 63, 64], 2),
    "f32-rows-mixed": (torch.float32, (6, 2), 64, 16, [9, 1, 1], [3, 2, 39], 1),
    "f32-rows-d128": (torch.float32, (4, 4), 128, 8, [1], [16], 0),
    # Sliding windows and softcapped scores (the last two elements, None for none): the cache holds NaN before
    # each sequence's first window, and the windows start mid-tile, mid-block and, for the split decode, past
    # its first partition.
    "window-decode-split": (torch.bfloat16, (14, 2), 64, 16, [1, 1, 1], [4, 299, 700], 0, 333),
    "softcap-mixed-split": (torch.bfloat16, (14, 2), 64, 16, [37, 1, 1], [20, 299, 700], 1, None, 1.1),
    "window-softcap-prefill-row-tiles-d128": (torch.float16, (7, 1), 128, 16, [70, 1], [170, 199], 1, 37, 0.9),
    "window-softcap-f32-rows": (torch.float32, (6, 2), 64, 16, [9, 1, 1], [3, 2, 39], 1, 6, 0.7),
}


@pytest.mark.parametrize("case", list(EMULATED_CASES))
def test_emulated_kernels_match_reference(emulator_library, case):
    dtype, (h, kvh), d, bs, query_lens, cached, num_prefills, *extra = EMULATED_CASES[case]
    window, softcap = (extra + [None, None])[:2]
    meta, kernels = check_emulated(emulator_library, num_heads=h, num_kv_heads=kvh, head_dim=d, block_size=bs,
                                   query_lens=query_lens, cached_lens=cached, num_prefills=num_prefills, dtype=dtype,
                                   seed=len(case), window=window, softcap=softcap)
    if "split" in case:
        assert meta.decode_partitions > 1 and kernels[-1].startswith("paged_decode_")
    if dtype == torch.float32:
        assert {k.split("_d")[0] for k in kernels} == {"cache_write_f32", "paged_attention_rows_f32"}


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_emulated_kernels_random_sweep(emulator_library, seed):
    rng = random.Random(seed)
    num_kv_heads, group = rng.choice([(1, 1), (2, 3), (2, 7), (1, 8), (4, 8), (1, 17)])
    num_prefills = rng.randint(0, 2)
    num_decodes = rng.randint(0 if num_prefills else 1, 5)
    check_emulated(
        emulator_library, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_dim=rng.choice([64, 128]),
        block_size=rng.choice([8, 16, 32]), query_lens=[rng.randint(2, 80) for _ in range(num_prefills)] + [1] * num_decodes,
        cached_lens=[rng.choice([0, rng.randint(1, 200)]) for _ in range(num_prefills)]
        + [rng.randint(0, 700) for _ in range(num_decodes)],
        num_prefills=num_prefills, dtype=rng.choice([torch.bfloat16, torch.float16, torch.float32]), seed=seed,
    )


def test_emulated_decode_without_split_matches_split(emulator_library, monkeypatch):
    """The same decode batch with and without split-K: both close to the reference and to each other."""
    args = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, query_lens=[1, 1], cached_lens=[500, 77],
                num_prefills=0, dtype=torch.bfloat16, seed=5)
    split_meta, _ = check_emulated(emulator_library, **args)
    assert split_meta.decode_partitions > 1
    monkeypatch.setattr(cupy_backend, "MIN_PARTITION", 1 << 20)  # no context is long enough to split
    whole_meta, _ = check_emulated(emulator_library, **args)
    assert whole_meta.decode_partitions == 1 and whole_meta.decode_counters is None


def test_emulated_decode_after_refill_matches_reference(emulator_library):
    """Metadata built once with a context capacity, refilled with another batch: the CUDA-graph replay path."""
    first = PagedProblem(num_heads=14, num_kv_heads=2, head_dim=64, block_size=16, query_lens=[1] * 4,
                         cached_lens=[10, 300, 64, 0], num_prefills=0, dtype=torch.bfloat16, seed=1)
    later = PagedProblem(num_heads=14, num_kv_heads=2, head_dim=64, block_size=16, query_lens=[1] * 4,
                         cached_lens=[900, 3, 0, 511], num_prefills=0, dtype=torch.bfloat16, seed=2)
    launcher = EmulatedLauncher(emulator_library)
    backend = CupyPagedAttention(14, 2, 64, later.scale, launcher=launcher)
    meta = backend.build_metadata(first.layout(), torch.device("cpu"), context_capacity=1024)
    backend.refill_metadata(meta, later.layout())
    expected, expected_k, _ = later.expected()
    out = torch.full((4, 14 * 64), float("nan"), dtype=torch.bfloat16)
    launcher(backend.plan_forward(later.query, later.key, later.value, later.key_cache, later.value_cache, meta, out),
             None)
    assert torch.equal(later.key_cache.view(torch.uint8), expected_k.view(torch.uint8))
    got = out.view(4, 14, 64).double()
    assert ((got - expected).norm() / expected.norm()).item() < 1e-2


def test_emulated_cache_write_skips_negative_slots(emulator_library):
    problem = PagedProblem(num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, query_lens=[1, 1, 1],
                           cached_lens=[3, 8, 20], num_prefills=0, dtype=torch.bfloat16, poison=False)
    problem.slot_mapping[1] = -1
    backend = CupyPagedAttention(4, 2, 64, problem.scale, launcher=EmulatedLauncher(emulator_library))
    meta = backend.build_metadata(problem.layout(), torch.device("cpu"))
    key_cache, value_cache = problem.key_cache.clone(), problem.value_cache.clone()
    launches = backend.plan_forward(problem.query, problem.key, problem.value, key_cache, value_cache, meta,
                                    torch.empty(3, 256, dtype=torch.bfloat16))
    backend.launcher([launches[0]], None)
    expected_k, expected_v = cache_write_reference(problem.key_cache, problem.value_cache, problem.key,
                                                   problem.value, problem.slot_mapping)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_emulator_reports_out_of_bounds_reads(emulator_library):
    """The range check is live: a block table pointing past the cache is an error, not a silent read."""
    problem = PagedProblem(num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, query_lens=[1], cached_lens=[20],
                           num_prefills=0, dtype=torch.bfloat16)
    problem.block_tables[0][1] = problem.key_cache.shape[0] + 5
    with pytest.raises(RuntimeError, match="outside every argument tensor"):
        run_emulated(emulator_library, problem, modes=((0, 0, 0),))


def _tiny_llama(path, head_dim=64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=4 * head_dim, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=256, eos_token_id=95, bos_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 0.02)])
def test_emulated_backend_inside_the_model_matches_torch_backend(emulator_library, tmp_path, dtype, tolerance):
    """ModelRunner on the CPU with the emulated kernels (strided V from the fused projection, every layer)
    against the same runner with TorchPagedAttention, over a chunked prefill mixed with a decode."""
    from executor_svc.model_runner import ModelRunner
    from pagedserve.config import CacheConfig, ModelConfig
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.step import ExecuteRequest, ExecuteStep

    _tiny_llama(tmp_path)
    runners = {}
    for name in ("torch", "emulated"):
        runner = ModelRunner(ModelConfig(str(tmp_path), dtype=dtype, device="cpu"),
                             CacheConfig(block_size=16, kv_cache_memory=1 << 21))
        if name == "emulated":
            config = runner.config
            backend = CupyPagedAttention(config.num_heads, config.num_kv_heads, config.head_dim,
                                         config.head_dim**-0.5, launcher=EmulatedLauncher(emulator_library))
            runner.attention = backend
            for layer in runner.model.layers:
                layer.self_attn.backend = backend
        runners[name] = runner
    tokens = {r: random.Random(i).choices(range(96), k=60) for i, r in enumerate(("a", "b"))}
    free = list(range(runners["torch"].num_blocks))
    random.Random(0).shuffle(free)
    held = {}
    plans = [[("a", 0, 40)], [("a", 40, 1), ("b", 0, 23)], [("a", 41, 1), ("b", 23, 1)]]
    for plan in plans:
        requests = []
        for rid, start, count in plan:
            needed = -(-(start + count) // 16) - held.get(rid, 0)
            new_blocks = [free.pop() for _ in range(needed)]
            requests.append(ExecuteRequest(rid, tokens[rid][start : start + count], start, new_blocks, sample=True,
                                           sampling_params=SamplingParams(temperature=0) if start == 0 else None))
            held[rid] = held.get(rid, 0) + needed
        logits = {name: runner.step_logits(ExecuteStep(requests)) for name, runner in runners.items()}
        for rid in logits["torch"]:
            ref, got = logits["torch"][rid], logits["emulated"][rid]
            assert (got - ref).abs().max().item() <= tolerance * max(1.0, ref.abs().max().item()), rid
