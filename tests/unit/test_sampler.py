"""The batched sampler against plain per-row references: greedy, filters, seeds, distribution, logprobs."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from executor_svc import sampler as sampler_module
from executor_svc.sampler import CDF_CHUNK, Sampler, SamplingBatch, filter_logits, inverse_cdf, mix_seed
from pagedserve.sampling_params import SamplingParams

sampler = Sampler()


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int] | None = None):
    batch = SamplingBatch.build(params)
    return sampler(logits, batch, positions if positions is not None else [0] * len(params))


def reference_bounds(row: torch.Tensor, p: SamplingParams) -> tuple[set[int], set[int]]:
    """(tokens a random row must keep, tokens it may keep), one token at a time in plain Python.

    The two differ only at the edges: a little slack for top-p and min-p (float32 in the sampler,
    float64 here), and ties at the top-p cut, where the sampler may keep any of the tied tokens.
    """
    # Temper and convert the parameters in float32 as the sampler does, so that both see the same ties.
    tempered = (row.float() / torch.tensor(p.temperature, dtype=torch.float32)).double().tolist()
    top_p = torch.tensor(p.top_p, dtype=torch.float32).item()
    min_p = torch.tensor(p.min_p, dtype=torch.float32).item()
    order = sorted(range(len(tempered)), key=lambda i: -tempered[i])
    if 0 < p.top_k < len(order):
        kth = tempered[order[p.top_k - 1]]
        order = [i for i in order if tempered[i] >= kth]  # ties with the k-th are kept
    must, may = list(order), list(order)
    if top_p < 1.0:
        weights = [math.exp(tempered[i] - tempered[order[0]]) for i in order]
        mass_before = [sum(weights[:j]) / sum(weights) for j in range(len(order))]
        last_must = max((j for j, m in enumerate(mass_before) if m < top_p - 1e-4), default=0)
        last_may = max(j for j, m in enumerate(mass_before) if m < top_p + 1e-4)
        must = order[: last_must + 1]
        if last_must + 1 < len(order) and tempered[order[last_must + 1]] == tempered[order[last_must]]:
            # A tie across the cut: which of the tied tokens survive depends on the sort.
            must = [i for i in must if tempered[i] > tempered[order[last_must]]]
        may = [i for i in may if tempered[i] >= tempered[order[last_may]]]
    if min_p > 0.0:
        floor = max(tempered) + math.log(min_p)
        must = [i for i in must if tempered[i] >= floor + 1e-3]
        may = [i for i in may if tempered[i] >= floor - 1e-3]
    return set(must), set(may)


def reference_allowed(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """Tokens a row may emit: for a greedy row the lowest id among the largest logits."""
    if p.greedy:
        values = row.float().tolist()
        return {values.index(max(values))}
    return reference_bounds(row, p)[1]


def assert_kept(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """filter_logits keeps every token a row must keep, none it may not, and one of the most likely."""
    kept_mask = torch.isfinite(filter_logits(logits.float(), SamplingBatch.build(params)))
    for i, p in enumerate(params):
        if p.greedy:
            continue
        must, may = reference_bounds(logits[i], p)
        kept = set(kept_mask[i].nonzero().flatten().tolist())
        assert must <= kept <= may, (i, p, sorted(must - kept), sorted(kept - may))
        assert kept_mask[i][logits[i].float() == logits[i].float().max()].any(), (i, p)


# --------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax_in_any_float_dtype() -> None:
    logits = torch.randn(16, 100)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = logits.to(dtype)
        out = sample(x, [SamplingParams(temperature=0.0)] * 16)
        assert out.token_ids.dtype == torch.int64
        assert torch.equal(out.token_ids, x.float().argmax(dim=-1))


def test_greedy_ties_pick_the_lowest_id() -> None:
    out = sample(torch.tensor([[1.0, 5.0, 5.0, 2.0]]), [SamplingParams(temperature=0.0)])
    assert out.token_ids.tolist() == [1]


def test_greedy_rows_stay_greedy_in_a_mixed_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 50) * 0.3  # flat enough that random rows vary
    params = [
        SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=7) if i % 2 == 0 else SamplingParams(top_p=0.9)
        for i in range(8)
    ]
    random_draws = set()
    for _ in range(30):
        out = sample(logits, params).token_ids
        assert torch.equal(out[0::2], logits[0::2].argmax(dim=-1))
        random_draws.add(tuple(out[1::2].tolist()))
    assert len(random_draws) > 1


# --------------------------------------------------------------------------- seeds


def seeded_sequence(
    row: torch.Tensor, params: SamplingParams, positions: range, batch_of: int, at: int
) -> list[int]:
    """Tokens drawn for one seeded row at each position, placed at row `at` of a batch of other rows."""
    generator = torch.Generator().manual_seed(batch_of * 131 + at)
    tokens = []
    for pos in positions:
        others = torch.randn(batch_of, row.numel(), generator=generator)
        logits = others.clone()
        logits[at] = row
        all_params = [
            SamplingParams(seed=1000 + i, top_p=0.95) if i % 3 == 0 else SamplingParams() for i in range(batch_of)
        ]
        all_params[at] = params
        all_positions = [pos + 17 * i for i in range(batch_of)]
        all_positions[at] = pos
        tokens.append(sample(logits, all_params, all_positions).token_ids[at].item())
    return tokens


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    row = torch.randn(64) * 0.5
    params = SamplingParams(temperature=0.9, top_k=40, seed=1234)
    positions = range(100, 160)
    alone = seeded_sequence(row, params, positions, batch_of=1, at=0)
    assert len(set(alone)) > 5  # varies with the position, so the comparisons below mean something
    torch.manual_seed(99)  # the default generator's state must not matter
    assert seeded_sequence(row, params, positions, batch_of=6, at=4) == alone
    assert seeded_sequence(row, params, positions, batch_of=9, at=0) == alone
    # A preempted request recomputes from the same positions and gets the same tokens.
    assert seeded_sequence(row, params, positions, batch_of=3, at=2) == alone


def test_different_seeds_give_different_tokens() -> None:
    row = torch.randn(64) * 0.5
    positions = range(200)
    a = seeded_sequence(row, SamplingParams(seed=1), positions, batch_of=1, at=0)
    b = seeded_sequence(row, SamplingParams(seed=2), positions, batch_of=1, at=0)
    assert sum(x != y for x, y in zip(a, b)) > 100


def test_mix_seed_is_63_bit_and_spreads() -> None:
    mixed = {mix_seed(seed, pos) for seed in (0, 1, -1, 2**63) for pos in range(100)}
    assert len(mixed) == 400
    assert all(0 <= m < 2**63 for m in mixed)
    assert mix_seed(5, 10) == mix_seed(5, 10)


# --------------------------------------------------------------------------- filters


FILTER_PARAMS = [
    SamplingParams(top_k=5),
    SamplingParams(top_k=1, temperature=2.0),
    SamplingParams(top_p=0.3),
    SamplingParams(top_p=0.8, top_k=20, temperature=0.7),
    SamplingParams(min_p=0.2),
    SamplingParams(min_p=0.05, top_p=0.9, seed=3),
    SamplingParams(top_k=-1, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=0.0, top_k=2),
    SamplingParams(top_k=10_000, seed=11),
    SamplingParams(top_k=3, min_p=0.5, temperature=1.5),
]


@pytest.mark.parametrize(
    "rows",
    [
        FILTER_PARAMS,
        [p for p in FILTER_PARAMS if p.top_p == 1.0],  # top-k without a sort
        [SamplingParams(min_p=m) for m in (0.01, 0.1, 0.5, 0.9, 1.0)],  # min-p alone
    ],
    ids=["all", "no-top-p", "min-p-only"],
)
def test_filters_never_emit_a_masked_token(rows: list[SamplingParams]) -> None:
    torch.manual_seed(1)
    params = rows * 6
    logits = torch.randn(len(params), 200) * 2
    assert_kept(logits, params)
    allowed = [reference_allowed(logits[i], p) for i, p in enumerate(params)]
    for step in range(50):
        out = sample(logits, params, [step] * len(params)).token_ids.tolist()
        for i, token in enumerate(out):
            assert token in allowed[i], (i, params[i], token)


def test_top_k_alone_does_not_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sort(*args: object, **kwargs: object) -> None:
        raise AssertionError("sorted without top-p")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    monkeypatch.setattr(torch, "sort", no_sort)
    logits = torch.randn(4, 30)
    params = [SamplingParams(top_k=k, min_p=0.1) for k in (1, 2, 0, 50)]
    out = sample(logits, params).token_ids.tolist()
    for i, token in enumerate(out):
        assert token in reference_allowed(logits[i], params[i])


def test_top_p_of_one_keeps_the_rounded_off_tail() -> None:
    # In float32 the peaked row's cumulative sum reaches 1 at its first token; nothing may be dropped.
    logits = torch.tensor([[0.0] + [-30.0] * 15, [0.0] * 16])
    filtered = filter_logits(logits, SamplingBatch.build([SamplingParams(), SamplingParams(top_p=0.5)]))
    assert torch.isfinite(filtered[0]).all()
    assert torch.isfinite(filtered[1]).sum() == 8


row_params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
    top_k=st.integers(-1, 70),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), vocab=st.integers(1, 64), rows=st.lists(row_params, min_size=1, max_size=6))
def test_filters_property(data: st.DataObject, vocab: int, rows: list[SamplingParams]) -> None:
    check_filters(data, rows, vocab)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), vocab=st.integers(1, 64), rows=st.lists(row_params, min_size=1, max_size=6))
def test_filters_property_with_narrow_candidate_tiers(data: st.DataObject, vocab: int,
                                                      rows: list[SamplingParams]) -> None:
    # The vocabulary's few most likely tokens first, then a few more, then all, as on a real vocabulary.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampler_module, "TOP_P_CANDIDATES", (2, 9))
        check_filters(data, rows, vocab)


def check_filters(data: st.DataObject, rows: list[SamplingParams], vocab: int) -> None:
    # Few distinct values, so ties at every cut come up often.
    value = st.one_of(st.sampled_from([0.0, 1.0, -3.5, 10.0]), st.floats(-30.0, 30.0, width=32))
    logits = torch.tensor([data.draw(st.lists(value, min_size=vocab, max_size=vocab)) for _ in rows])
    assert_kept(logits, rows)
    position = data.draw(st.integers(0, 10_000))
    out = sample(logits, rows, [position] * len(rows)).token_ids.tolist()
    for i, token in enumerate(out):
        assert token in reference_allowed(logits[i], rows[i])


def test_top_p_among_the_likeliest_tokens_keeps_what_sorting_the_whole_vocabulary_keeps(monkeypatch) -> None:
    # Rows whose cut lies among the first candidates, among the next, and only further down (a flat row); top-k
    # rows, one with ties to its k-th token beyond the candidates, which must be kept as a whole sort keeps them.
    vocab = 6000
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(8, vocab, generator=gen) * torch.tensor([[6.0], [2.6], [1.5], [0.2], [6.0], [3.0], [1.0], [0.2]])
    logits[6, :10] = 5.0
    logits[6, 10:600] = 4.0  # the 300th token ties with 299 before it and 290 after
    params = [SamplingParams(top_p=0.95), SamplingParams(top_p=0.9), SamplingParams(top_p=0.9),
              SamplingParams(top_p=0.5), SamplingParams(top_k=40, top_p=0.8), SamplingParams(top_k=200, top_p=0.99),
              SamplingParams(top_k=300, top_p=0.9), SamplingParams(temperature=0.5, top_p=0.9)]
    batch = SamplingBatch.build(params)
    tiered = torch.isfinite(filter_logits(logits, batch))
    kept = tiered.sum(dim=-1).tolist()
    first, second = max(sampler_module.TOP_P_CANDIDATES[0], 301), sampler_module.TOP_P_CANDIDATES[1]
    assert kept[0] < first < kept[1] < second < kept[2], kept  # every tier is used
    assert first < kept[6] < 600, kept  # top-p over all 600 of row 6's top-k, ties included
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", ())  # the whole vocabulary sorted, for every row
    whole = torch.isfinite(filter_logits(logits, batch))
    assert whole.sum(dim=-1).tolist() == kept
    # Row 6's cut falls among tied tokens: which of them stay depends on the order the sort leaves them in.
    assert torch.equal(tiered[[0, 1, 2, 3, 4, 5, 7]], whole[[0, 1, 2, 3, 4, 5, 7]])
    assert torch.equal(tiered[6, :10], whole[6, :10]) and not tiered[6, 600:].any()


def test_inverse_cdf_never_draws_a_token_of_weight_zero() -> None:
    vocab = 3 * CDF_CHUNK + 5  # a last chunk part padding
    weights = torch.zeros(6, vocab)
    weights[0, 0] = 1.0
    weights[1, vocab - 1] = 1.0  # alone in the padded chunk
    weights[2, [3, CDF_CHUNK + 7]] = torch.tensor([1e-30, 1.0])
    weights[3, :] = 1.0
    weights[4, [CDF_CHUNK - 1, CDF_CHUNK]] = 1.0  # a chunk boundary between the two
    weights[5, 2 * CDF_CHUNK + 1] = 5e-45  # a subnormal alone
    for u in (0.0, 0.5, 1.0 - 2.0**-53, 2.0**-60, 0.999999):
        tokens = inverse_cdf(weights, torch.full((6,), u, dtype=torch.float64))
        assert (weights.gather(1, tokens.unsqueeze(1)) > 0).all(), (u, tokens)
    tokens = inverse_cdf(weights[3:4].expand(4, -1), torch.tensor([0.0, 0.25, 0.5, 1.0 - 2.0**-53], dtype=torch.float64))
    assert tokens.tolist() == [0, vocab // 4, vocab // 2, vocab - 1]


def test_inverse_cdf_keeps_a_small_weight_its_share_after_a_large_one() -> None:
    # Token 5000 weighs 1e-6 of a row whose first token holds the rest: a single float32 cumulative sum would
    # round its step away at the scale of the first token; the chunked sums keep it.
    weights = torch.zeros(1, 8000)
    weights[0, 0] = 1.0
    weights[0, 5000] = 1e-6
    share = 1e-6 / (1.0 + 1e-6)
    hit = inverse_cdf(weights, torch.tensor([1.0 - share / 2], dtype=torch.float64))
    miss = inverse_cdf(weights, torch.tensor([1.0 - 2 * share], dtype=torch.float64))
    assert hit.tolist() == [5000] and miss.tolist() == [0]


# --------------------------------------------------------------------------- distribution


PROBS = torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.04, 0.01], dtype=torch.float64)
N = 20_000


def expected(keep: int, temperature: float = 1.0) -> torch.Tensor:
    """PROBS tempered, restricted to the `keep` most likely tokens and renormalised."""
    p = PROBS ** (1.0 / temperature)
    p[keep:] = 0.0
    return p / p.sum()


def assert_distribution(tokens: torch.Tensor, want: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=len(want)).double()
    support = want > 0
    assert counts[~support].sum() == 0, counts
    f_exp = want[support] * counts.sum()
    assert chisquare(counts[support].numpy(), f_exp.numpy()).pvalue > 0.001, counts


@pytest.mark.parametrize(
    ("params", "want"),
    [
        (SamplingParams(), expected(8)),
        (SamplingParams(temperature=2.0), expected(8, temperature=2.0)),
        (SamplingParams(top_k=4), expected(4)),
        (SamplingParams(top_p=0.6), expected(3)),  # mass before token 3 is 0.65 >= 0.6
        (SamplingParams(top_k=5, top_p=0.8), expected(4)),  # within the top 5, mass before token 4 is 0.885
        (SamplingParams(min_p=0.3), expected(5)),  # p >= 0.09
        (SamplingParams(seed=5, top_k=6), expected(6)),  # seeded rows, one generator each
    ],
    ids=["plain", "temperature", "top-k", "top-p", "top-k-top-p", "min-p", "seeded"],
)
def test_sampled_frequencies_match_the_filtered_distribution(params: SamplingParams, want: torch.Tensor) -> None:
    torch.manual_seed(2)
    logits = PROBS.log().float().expand(N, -1).contiguous()
    # Seeded rows share the seed, so they get distinct streams from distinct positions.
    tokens = sample(logits, [params] * N, list(range(N))).token_ids
    assert_distribution(tokens, want)


def test_top_p_of_one_does_not_filter_rows_sorted_with_top_p_rows() -> None:
    torch.manual_seed(3)
    logits = PROBS.log().float().expand(N, -1).contiguous()
    params = [SamplingParams(top_p=0.6)] * (N // 2) + [SamplingParams()] * (N // 2)
    tokens = sample(logits, params).token_ids
    assert_distribution(tokens[: N // 2], expected(3))
    assert_distribution(tokens[N // 2 :], expected(8))


def test_chi_square_rejects_a_wrong_distribution() -> None:
    torch.manual_seed(4)
    logits = PROBS.log().float().expand(N, -1).contiguous()
    tokens = sample(logits, [SamplingParams()] * N).token_ids
    assert_distribution(tokens, expected(8))
    wrong = expected(8)
    wrong[0] -= 0.02
    wrong[1] += 0.02
    with pytest.raises(AssertionError):
        assert_distribution(tokens, wrong)
    with pytest.raises(AssertionError):
        assert_distribution(tokens, expected(7))  # the dropped token was drawn


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_top_n_sorted() -> None:
    torch.manual_seed(5)
    logits = torch.randn(5, 300, dtype=torch.bfloat16)
    params = [
        SamplingParams(logprobs=None),
        SamplingParams(logprobs=0, temperature=0.5),
        SamplingParams(logprobs=3, top_k=5),
        SamplingParams(logprobs=7, temperature=0.0),
        SamplingParams(logprobs=2, top_p=0.5, seed=1),
    ]
    batch = SamplingBatch.build(params)
    out = sampler(logits, batch, [0] * 5)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs is not None and out.top_token_ids is not None and out.top_logprobs is not None
    assert out.logprobs.dtype == torch.float32 and out.top_token_ids.dtype == torch.int64
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    assert out.top_logprobs.shape == (5, 7)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    top = ref.topk(7, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top.values)
    torch.testing.assert_close(ref.gather(1, out.top_token_ids), top.values)

    tokens = out.to_sampled_tokens(batch)
    assert [t.token_id for t in tokens] == out.token_ids.tolist()
    assert tokens[0].logprob is None and tokens[0].top_token_ids is None
    assert tokens[1].logprob == pytest.approx(out.logprobs[1].item()) and tokens[1].top_token_ids == []
    assert tokens[2].top_token_ids == out.top_token_ids[2, :3].tolist()
    assert tokens[3].top_logprobs == pytest.approx(out.top_logprobs[3].tolist())
    assert tokens[3].token_id == tokens[3].top_token_ids[0]  # greedy picks the top logprob


def test_no_logprobs_unless_asked() -> None:
    params = [SamplingParams(), SamplingParams(temperature=0.0)]
    batch = SamplingBatch.build(params)
    out = sampler(torch.randn(2, 10), batch, [0, 0])
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None
    assert [t.logprob for t in out.to_sampled_tokens(batch)] == [None, None]


def test_zero_logprobs_gives_only_the_chosen_token() -> None:
    out = sample(torch.randn(3, 10), [SamplingParams(logprobs=0)] * 3)
    assert out.logprobs is not None and out.logprobs.shape == (3,)
    assert out.top_token_ids is not None and out.top_token_ids.shape == (3, 0)


# --------------------------------------------------------------------------- batch building and scale


def test_build_flags_only_what_random_rows_use() -> None:
    plain = SamplingBatch.build([SamplingParams(), SamplingParams(top_k=-1)])
    assert not (plain.all_greedy or plain.any_greedy or plain.any_top_k or plain.any_top_p or plain.any_min_p)
    assert plain.top_k.tolist() == [0, 0] and plain.seeded == [] and plain.max_num_logprobs is None
    greedy = SamplingBatch.build([SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.1, seed=4)])
    assert greedy.all_greedy and not (greedy.any_top_k or greedy.any_top_p or greedy.any_min_p)
    assert greedy.seeded == [] and greedy.temperature.tolist() == [1.0]
    mixed = SamplingBatch.build([SamplingParams(seed=9, logprobs=2), SamplingParams(top_k=8, logprobs=5)])
    assert mixed.seeded == [(0, 9)] and mixed.max_top_k == 8 and mixed.max_num_logprobs == 5
    assert len(mixed) == 2


def test_full_size_batch() -> None:
    vocab, rows = 49152, 256
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=50, top_p=0.9, logprobs=5),
        SamplingParams(min_p=0.05, seed=42),
        SamplingParams(temperature=0.8),
    ]
    params = [kinds[i % 4] for i in range(rows)]
    out = sample(logits, params, list(range(rows)))
    assert out.token_ids.shape == (rows,)
    assert ((out.token_ids >= 0) & (out.token_ids < vocab)).all()
    assert torch.equal(out.token_ids[0::4], logits[0::4].float().argmax(dim=-1))
    assert out.top_token_ids is not None and out.top_token_ids.shape == (rows, 5)


# --------------------------------------------------------------------------- degenerate parameters


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 1e-6])
def test_a_temperature_below_epsilon_is_greedy_not_token_zero(temperature) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 20
    logits[:, 0] = -30  # token 0 is never the answer, so a NaN row's argmax (0) would show
    out = sample(logits, [SamplingParams(temperature=temperature)] * 4)
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_p", [1e-46, 1e-45, 1e-30])
def test_a_vanishing_top_p_keeps_the_most_likely_token(top_p) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    logits[:, 0] = -30
    # top_p rounds to 0 (or the least subnormal) in float32: only the top token may survive.
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=top_p)] * 4, positions=[0, 1, 2, 3])
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()


def test_bias_and_penalties_match_a_per_row_reference_and_leave_other_rows_alone():
    from executor_svc.sampler import TokenCounts, apply_penalties

    vocab = 12
    torch.manual_seed(0)
    logits = torch.randn(3, vocab) * 3
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25,
                       logit_bias={4: 2.0}),
        SamplingParams(temperature=0),  # pays nothing
        SamplingParams(temperature=0, frequency_penalty=-1.0, logit_bias={0: -100.0, 7: 1.5}),
    ]
    prompts = {"a": [1, 2, 3], "c": [5]}
    outputs = {"a": [3, 3, 9], "c": [6, 6, 6, 2]}
    counts = TokenCounts(vocab, "cpu")
    flat_ids, flat_tokens, flat_output = [], [], []
    for rid in ("a", "c"):
        counts.add(rid)
        for tokens, is_output in ((prompts[rid], False), (outputs[rid], True)):
            flat_ids += [rid] * len(tokens)
            flat_tokens += tokens
            flat_output += [is_output] * len(tokens)
    counts.record(flat_ids, flat_tokens, flat_output)

    batch = SamplingBatch.build(params)
    adjusted = logits.clone()
    adjusted.index_put_((batch.bias_rows, batch.bias_token_ids), batch.bias_values, accumulate=True)
    apply_penalties(adjusted, batch, *counts.gather(["a", "c"]))

    expected = logits.clone()
    for row, rid in ((0, "a"), (2, "c")):
        p = params[row]
        for token, bias in p.logit_bias.items():
            expected[row, token] += bias
        for token in range(vocab):
            seen = token in prompts[rid] or token in outputs[rid]
            value = expected[row, token]
            if seen:
                value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            n = outputs[rid].count(token)
            value = value - p.frequency_penalty * n - p.presence_penalty * (n > 0)
            expected[row, token] = value
    torch.testing.assert_close(adjusted, expected)
    assert torch.equal(adjusted[1], logits[1])

    # A freed row is handed out again zeroed.
    counts.remove("a")
    counts.add("d")
    index, token_ids, output_counts = counts.gather(["d"])
    assert len(index) == len(token_ids) == len(output_counts) == 0
    index, token_ids, output_counts = counts.gather(["c"])  # seen: its prompt and its output, counted there
    assert index.tolist() == [0] * 3 and token_ids.tolist() == [2, 5, 6] and output_counts.tolist() == [1, 0, 3]


def test_sampler_picks_under_the_adjusted_logits_and_reports_the_raw_logprobs():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    batch = SamplingBatch.build([SamplingParams(temperature=0, logit_bias={1: 5.0}, logprobs=1)])
    out = Sampler()(logits, batch, [0])
    assert out.token_ids.tolist() == [1]
    assert out.top_token_ids.tolist() == [[2]]  # the model's own distribution
    mask = torch.zeros(1, 1, dtype=torch.int32)
    mask[0, 0] = 1 << 3  # the grammar allows token 3 alone
    out = Sampler()(logits, SamplingBatch.build([SamplingParams(temperature=0)]), [0], grammar_mask=(mask, [0]))
    assert out.token_ids.tolist() == [3]


def test_allowed_token_ids_confine_their_rows_alone_and_keep_the_raw_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    allowed = [7, 11, 40]
    params = [SamplingParams(temperature=0, allowed_token_ids=allowed, logprobs=1), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, allowed_token_ids=allowed), SamplingParams(temperature=1.0, seed=1)]
    batch, sampler = SamplingBatch.build(params), Sampler()
    assert logits[0].argmax().item() not in allowed
    drawn = set()
    for _ in range(200):
        out = sampler(logits, batch, [0] * 4)
        assert out.token_ids[0].item() == max(allowed, key=lambda t: logits[0, t].item())
        assert out.token_ids[1].item() == logits[1].argmax().item()
        drawn.add(out.token_ids[2].item())
    assert drawn == set(allowed)  # every allowed token drawn, nothing else
    assert out.top_token_ids[0].tolist() == [logits[0].argmax().item()]  # the model's own top token
    assert batch.allowed_mask(50) is batch.allowed_mask(50)  # built once for a steady batch


def test_banned_stop_tokens_are_never_sampled_yet_keep_their_raw_logprobs():
    """Before min_tokens the stop tokens may not be sampled, but the logprobs stay the model's own (vLLM's): the
    banned token still leads the top logprobs with its raw value, and the rest are not renormalised."""
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [0.0, 1.0, 3.0, 2.0]])
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.7, seed=3, logprobs=2)]
    out = Sampler()(logits.clone(), SamplingBatch.build(params), [0, 0], banned=([0, 0, 1], [2, 3, 2]))
    raw = torch.log_softmax(logits, dim=-1)
    assert out.token_ids[0].item() == 1 and out.token_ids[1].item() in (0, 1, 3)
    assert out.top_token_ids.tolist() == [[2, 3], [2, 3]]
    torch.testing.assert_close(out.top_logprobs, raw[:, [2, 3]])
    torch.testing.assert_close(out.logprobs, raw[[0, 1], out.token_ids])
