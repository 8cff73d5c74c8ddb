"""The CPU extension's fused elementwise ops (executor_svc/csrc) against the torch operators they replace in the
model, on every instruction-set path: the rotary embedding bit for bit and RMSNorm to the rounding of its sum of
squares, in float32 and bfloat16, SiLU-and-mul to the rounding of its exp, on strided rows, odd widths and batches
of one to a prefill chunk; the greedy argmax index for index, ties, infinities and NaNs included; the linear
layers' split products as F.linear's."""
from __future__ import annotations

import pytest
import torch

import torch.nn.functional as F

from executor_svc.attention.cpu_backend import load_extension, supported_isas
from executor_svc.models.llama import SPLIT_LINEAR_MAX_ROWS, Linear, RMSNorm, _apply_rotary


@pytest.fixture(scope="module")
def ops():
    return load_extension()


@pytest.fixture(params=supported_isas())
def isa(ops, request):
    """Every instruction-set path this CPU runs (bfloat16 rows take the vector loops of that path)."""
    previous = ops.select_isa(request.param)
    yield request.param
    ops.select_isa(previous)


def assert_within_bf16_steps(got: torch.Tensor, expected: torch.Tensor) -> None:
    """bfloat16 results whose float32 work rounded differently (the order of a sum) may land a bfloat16 step apart,
    rarely, and a product of such a value rounded again one more; everything else is equal."""
    assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -6, atol=1e-30)
    assert (got == expected).float().mean() > 0.99


@pytest.mark.parametrize("rotary_fraction", [1, 0.75, 0.5], ids=["full", "three-quarters", "half"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim", [(1, 9, 3, 64), (37, 4, 1, 128), (300, 6, 6, 16)])
def test_rotary_equals_torch_bit_for_bit_in_place_in_the_projection_output(ops, isa, num_tokens, num_heads,
                                                                            num_kv_heads, head_dim, dtype,
                                                                            rotary_fraction):
    # A partial embedding (Phi-3's partial_rotary_factor) turns the leading dims of each head only.
    torch.manual_seed(num_tokens)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size).to(dtype)
    rotary_dim = int(head_dim * rotary_fraction)
    table = torch.randn(num_tokens, 1, rotary_dim).to(dtype), torch.randn(num_tokens, 1, rotary_dim).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    expected_q = _apply_rotary(q.view(num_tokens, num_heads, head_dim), *table).reshape(num_tokens, -1)
    expected_k = _apply_rotary(k.view(num_tokens, num_kv_heads, head_dim), *table).reshape(num_tokens, -1)
    v_before = v.clone()
    ops.rotary(q, k, *table, head_dim)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(v, v_before)  # the rest of the row is left alone


@pytest.mark.parametrize("num_tokens", [1, 40])
def test_bfloat16_denormal_and_nan_results_round_as_torch_rounds_them(ops, isa, num_tokens):
    """A vector of bfloat16 results that holds denormals or NaNs, which the AVX512-BF16 conversion would flush or
    keep the payload of, is rounded as torch rounds it: the rotary embedding and the skip connection's sum bit
    for bit, NaN where torch gives NaN."""
    torch.manual_seed(num_tokens)
    heads, head_dim = 3, 64
    width = 3 * heads * head_dim
    tiny = torch.where(torch.rand(num_tokens, width) < 0.5, 1e-39, 1.0)  # half the lanes in bfloat16's denormals
    qkv = (torch.randn(num_tokens, width) * tiny).bfloat16()
    qkv[:, 5] = qkv[:, heads * head_dim + 70] = float("nan")
    table = torch.randn(num_tokens, 1, head_dim).bfloat16(), torch.randn(num_tokens, 1, head_dim).bfloat16()
    q, k, _ = qkv.split(heads * head_dim, dim=-1)
    expected = [_apply_rotary(t.view(num_tokens, heads, head_dim), *table).reshape(num_tokens, -1) for t in (q, k)]
    ops.rotary(q, k, *table, head_dim)
    for got, want in zip((q, k), expected):
        assert ((got != 0) & (got.abs() < 2 ** -126)).any()  # denormal results, not flushed
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    x, residual = qkv[:, :576], (torch.randn(num_tokens, 576) * tiny[:, :576]).bfloat16()
    summed = residual + x
    ops.add_rms_norm(torch.empty_like(residual), residual, x, torch.ones(576, dtype=torch.bfloat16), 1e-5)
    assert torch.equal(residual.isnan(), summed.isnan()) and torch.equal(residual.nan_to_num(), summed.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,hidden", [(1, 576), (64, 576), (2048, 576), (5, 100), (3, 7)])
def test_rms_norm_matches_torch_to_rounding(ops, isa, num_tokens, hidden, dtype):
    torch.manual_seed(hidden)
    x = (torch.randn(num_tokens, hidden + 3) * 4).to(dtype)[:, :hidden]  # strided rows
    reference, fused = RMSNorm(hidden, 1e-5).to(dtype), RMSNorm(hidden, 1e-5, ops).to(dtype)
    with torch.no_grad():
        reference.weight.normal_()
        fused.weight.copy_(reference.weight)
        expected, got = reference(x), fused(x)
    assert got.shape == expected.shape
    if dtype == torch.bfloat16:
        assert_within_bf16_steps(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,hidden", [(1, 576), (64, 576), (5, 100), (3, 7)])
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(ops, isa, num_tokens, hidden, dtype):
    torch.manual_seed(hidden)
    x = (torch.randn(num_tokens, hidden + 3) * 4).to(dtype)[:, :hidden]  # strided rows
    residual = (torch.randn(num_tokens, hidden) * 4).to(dtype)
    norm = RMSNorm(hidden, 1e-5, ops).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
        summed = residual + x
        expected = norm(summed)
        out, stream = norm(x, residual)
    assert stream is residual and torch.equal(residual, summed)
    assert torch.equal(out, expected)
    # The torch path gives the same pair without writing into the residual.
    reference, kept = RMSNorm(hidden, 1e-5).to(dtype), residual.clone()
    with torch.no_grad():
        reference.weight.copy_(norm.weight)
        ref_out, ref_stream = reference(x, kept)
    assert torch.equal(ref_stream, residual + x) and torch.equal(kept, residual)
    torch.testing.assert_close(ref_out, reference(residual + x), rtol=0, atol=0)


@pytest.mark.parametrize("num_tokens,hidden", [(1, 576), (64, 640), (5, 100)])
def test_gemma_norm_on_bfloat16_rows_multiplies_by_its_float32_factor_before_rounding(ops, isa, num_tokens, hidden):
    # Gemma's RMSNorm scales by 1 + w in float32 and rounds once; the model holds 1 + w as a float32 weight
    # (LlamaForCausalLM.convert). Rounding 1 + w to bfloat16, or the normalised row before the product, is off.
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    torch.manual_seed(hidden)
    x = (torch.randn(num_tokens, hidden + 3) * 4).bfloat16()[:, :hidden]  # strided rows
    residual = (torch.randn(num_tokens, hidden) * 4).bfloat16()
    gemma = Gemma3RMSNorm(hidden, eps=1e-6).bfloat16()
    with torch.no_grad():
        gemma.weight.copy_(torch.randn(hidden) * 0.7)
        expected, expected_summed = gemma(x), gemma(residual + x)
        for norm in (RMSNorm(hidden, 1e-6, ops), RMSNorm(hidden, 1e-6)):  # fused, and torch's operators
            norm.weight.copy_(1 + gemma.weight.float())
            assert norm.weight.dtype == torch.float32
            assert_within_bf16_steps(norm(x), expected)
            out, stream = norm(x, residual.clone())
            assert torch.equal(stream, residual + x)
            assert_within_bf16_steps(out, expected_summed)
        rounded = RMSNorm(hidden, 1e-6, ops).bfloat16()
        rounded.weight.copy_(1 + gemma.weight.float())
        assert (rounded(x) != expected).float().mean() > 0.05


@pytest.mark.parametrize("num_tokens,intermediate", [(1, 1536), (64, 1536), (700, 1536), (3, 37)])
def test_silu_mul_matches_torch_to_rounding(ops, isa, num_tokens, intermediate):
    torch.manual_seed(intermediate)
    # Strided rows, and values from far below to far above where SiLU saturates.
    gate_up = (torch.randn(num_tokens, 2 * intermediate + 5) * 30)[:, :2 * intermediate]
    gate, up = gate_up.split(intermediate, dim=-1)
    out = torch.empty(num_tokens, intermediate)
    ops.silu_mul(out, gate_up)
    expected = F.silu(gate) * up
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-30)
    # In place over the gate half, as the MLP calls it: the same values, the up half untouched.
    up_before = up.clone()
    ops.silu_mul(gate, gate_up)
    assert torch.equal(gate, out) and torch.equal(up, up_before)


@pytest.mark.parametrize("num_tokens,intermediate", [(1, 1536), (64, 1536), (700, 1536), (3, 37)])
def test_silu_mul_in_bfloat16_rounds_as_torchs_two_operators(ops, isa, num_tokens, intermediate):
    """SiLU rounded to bfloat16, then its product with up rounded: torch's F.silu(gate) * up, equal but where the
    exps (this file's and torch's, each within 2 ulp in float32) land on either side of a rounding boundary."""
    torch.manual_seed(intermediate)
    gate_up = (torch.randn(num_tokens, 2 * intermediate + 6) * 30).bfloat16()[:, :2 * intermediate]
    gate, up = gate_up.split(intermediate, dim=-1)
    out = torch.empty(num_tokens, intermediate, dtype=torch.bfloat16)
    ops.silu_mul(out, gate_up)
    expected = F.silu(gate) * up
    # (Below -88 the exp saturates: torch's SiLU is -0 there, this one's a number under 1e-30.)
    differ = ~torch.isclose(out.float(), expected.float(), rtol=0, atol=1e-30)
    assert differ.float().mean() < 1e-3
    # Where they differ, by one bfloat16 step of the SiLU at most (times up, rounded).
    torch.testing.assert_close(out.float()[differ], expected.float()[differ], rtol=2 ** -7, atol=0)
    up_before = up.clone()
    ops.silu_mul(gate, gate_up)
    assert torch.equal(gate, out) and torch.equal(up, up_before)


@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 1000, 49152])
def test_argmax_equals_torch_index_for_index(ops, isa, vocab):
    torch.manual_seed(vocab)
    rows = [torch.randn(vocab), torch.randint(0, 3, (vocab,)).float(),  # ties: the first one wins
            torch.full((vocab,), float("-inf")), torch.full((vocab,), 2.0)]
    for place in {0, vocab // 2, vocab - 1}:
        inf, nan = torch.randn(vocab), torch.randn(vocab)
        inf[place] = float("inf")
        nan[place] = float("nan")
        nan[vocab - 1 - place] = float("inf")  # a NaN is taken over an infinity, wherever it is
        rows += [inf, nan]
    logits = torch.stack(rows)
    strided = torch.cat([logits, torch.zeros(len(rows), 3)], dim=1)[:, :vocab]
    for x in (logits, strided):
        assert torch.equal(ops.argmax(x), x.argmax(dim=-1))


def test_sampler_greedy_takes_the_fused_argmax_and_falls_back_to_torch(ops):
    from executor_svc.sampler import Sampler, SamplingBatch
    from pagedserve.sampling_params import SamplingParams

    logits = torch.randn(5, 300)
    batch = SamplingBatch.build([SamplingParams(temperature=0)] * 5)
    calls = []
    sampler = Sampler(lambda x: calls.append(x) or ops.argmax(x))
    assert torch.equal(sampler(logits, batch, [0] * 5).token_ids, logits.argmax(dim=-1))
    assert len(calls) == 1
    # Non-float32 logits are computed in float32 first; columns with a stride go to torch's argmax.
    assert torch.equal(sampler(logits.bfloat16(), batch, [0] * 5).token_ids, logits.bfloat16().float().argmax(dim=-1))
    assert torch.equal(sampler.greedy(logits.t().contiguous().t()), logits.argmax(dim=-1))
    assert len(calls) == 2


def test_rms_norm_leaves_other_dtypes_to_torch(ops):
    x = torch.randn(4, 64, dtype=torch.float64)
    reference, fused = RMSNorm(64, 1e-6).to(torch.float64), RMSNorm(64, 1e-6, ops).to(torch.float64)
    with torch.no_grad():
        assert torch.equal(reference(x), fused(x))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows,in_features,out_features,bias", [(1, 64, 960, False), (64, 576, 3072, True),
                                                                (7, 96, 100, True), (33, 48, 16, False)])
def test_split_linear_equals_f_linear(ops, rows, in_features, out_features, bias, threads):
    """Each output feature is one thread's single-threaded product: F.linear's to rounding whatever the split (odd
    widths, fewer features than a share, more threads than cores) and on strided x. (MKL's kernels for a narrow
    share may sum in another order than its threaded product of the whole.)"""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * in_features, generator=gen)[:, ::2]
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ops.split_linear(x, weight, b)
    finally:
        torch.set_num_threads(previous)
    assert got.shape == (rows, out_features) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_split_linear_is_bit_for_bit_on_the_default_models_decode_shapes(ops):
    """SmolLM2's projections at a 64-request decode, two threads, float32 and bfloat16: the very products torch's
    threaded call gives."""
    gen = torch.Generator().manual_seed(0)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for in_features, out_features in [(576, 960), (576, 576), (576, 3072), (1536, 576)]:
            x, weight = torch.randn(64, in_features, generator=gen), torch.randn(out_features, in_features, generator=gen)
            # Rows strided in place too (the down projection reads the gate half of gate_up).
            wider = torch.cat([x, torch.randn_like(x)], dim=1)
            for dtype in (torch.float32, torch.bfloat16):
                x, weight = x.to(dtype), weight.to(dtype)
                row_strided = wider.to(dtype)[:, :in_features]
                assert row_strided.stride() == (2 * in_features, 1)
                assert torch.equal(ops.split_linear(x, weight, None), F.linear(x, weight))
                assert torch.equal(ops.split_linear(row_strided, weight, None), F.linear(x, weight))
    finally:
        torch.set_num_threads(previous)


def test_linear_layers_split_only_products_of_few_rows(ops, monkeypatch):
    layer = Linear(32, 48, True, ops)
    calls = []
    monkeypatch.setattr(layer, "fused_ops", type("Ops", (), {"split_linear": lambda self, *a: calls.append(a) or ops.split_linear(*a)})())
    with torch.no_grad():
        for rows in (1, SPLIT_LINEAR_MAX_ROWS, SPLIT_LINEAR_MAX_ROWS + 1):
            x = torch.randn(rows, 32)
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.double()(torch.randn(4, 32, dtype=torch.float64))  # not float32: torch's
    assert [a[0].shape[0] for a in calls] == [1, SPLIT_LINEAR_MAX_ROWS]


def test_fused_ops_refuse_what_they_cannot_read(ops):
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(torch.empty(2, 8), torch.ones(2, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.empty(2, 8), torch.ones(2, 8), torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="head_dim"):
        ops.rotary(torch.ones(2, 12), torch.ones(2, 12), torch.ones(2, 5), torch.ones(2, 5), 5)
    with pytest.raises(RuntimeError, match="gate_up"):
        ops.silu_mul(torch.empty(2, 3), torch.ones(2, 7))
    with pytest.raises(RuntimeError, match="residual"):
        ops.add_rms_norm(torch.empty(2, 8), torch.ones(3, 8), torch.ones(2, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="logits"):
        ops.argmax(torch.ones(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="logits"):
        ops.argmax(torch.ones(2, 0))
    with pytest.raises(RuntimeError, match="weight"):
        ops.split_linear(torch.ones(2, 8), torch.ones(4, 9), None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.split_linear(torch.ones(2, 8), torch.ones(4, 8), torch.ones(5))
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rotary(torch.ones(2, 16), torch.ones(2, 8), torch.ones(2, 4), torch.ones(2, 8), 8)
    # Every tensor of a call in one dtype (but a norm's float32 weight on bfloat16 rows, Gemma's): a bfloat16 row
    # is not read as float32 bits, nor written as them.
    bf16 = torch.ones(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.rms_norm(torch.empty(2, 8), bf16, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.empty(2, 8), torch.ones(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.add_rms_norm(torch.empty_like(bf16), torch.ones(2, 8), bf16, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rotary(torch.ones(2, 16, dtype=torch.bfloat16), bf16, torch.ones(2, 8), torch.ones(2, 8), 8)
    with pytest.raises(RuntimeError, match="gate_up's dtype"):
        ops.silu_mul(torch.empty(2, 4), torch.ones(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="gate_up"):
        ops.silu_mul(torch.empty(2, 4, dtype=torch.float16), torch.ones(2, 8, dtype=torch.float16))
