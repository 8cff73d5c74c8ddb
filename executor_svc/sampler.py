"""Token sampling for a whole batch at once: logit bias, penalties, grammar masks, allowed and banned tokens,
greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Every step runs a bounded number of tensor ops whatever the batch size; the only per-request Python loop
is over seeded rows, which each need a generator of their own so that their draws do not depend on the
rest of the batch. Bias, penalties and grammar masks touch only the rows that ask for them. Top-k and top-p
rarely sort the vocabulary (_nucleus_tiers), and a draw takes one random number a row (inverse_cdf).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import SampledToken

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for (request seed, position): nearby inputs give unrelated streams."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 1


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors; built once when the batch's composition changes.

    ``top_k`` holds 0 for rows without top-k (the vocabulary size is only known at sampling time);
    greedy rows keep temperature 1 so that the shared random path never divides by zero, and are
    flagged in ``greedy`` instead.
    """

    temperature: torch.Tensor  # [B] float32
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    min_p: torch.Tensor  # [B] float32, 0 = off
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_top_k: int  # largest k asked, so top-k alone needs one torch.topk of that width
    seeded: list[tuple[int, int]]  # (row, seed) for random rows with a seed
    num_logprobs: list[int | None]  # per row, to cut the batch-wide top-n down to what each asked
    max_num_logprobs: int | None  # None when no row wants logprobs
    # Logit bias of every row flattened: logits[bias_rows, bias_token_ids] += bias_values. None: no row.
    bias_rows: torch.Tensor | None = None
    bias_token_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # Rows with penalties, and theirs: [P] each. None: no row.
    penalty_rows: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    # Rows with allowed_token_ids [A], and (index into them, token id) of each allowed token. None: no row.
    allowed_rows: torch.Tensor | None = None
    allowed_index: torch.Tensor | None = None
    allowed_token_ids: torch.Tensor | None = None
    _allowed_mask: torch.Tensor | None = None  # [A, V] bool, built at the first sampling (V known then)

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        if self._allowed_mask is None or self._allowed_mask.shape[1] != vocab_size:
            mask = torch.zeros(len(self.allowed_rows), vocab_size, dtype=torch.bool, device=self.allowed_rows.device)
            mask[self.allowed_index, self.allowed_token_ids] = True
            self._allowed_mask = mask
        return self._allowed_mask

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> SamplingBatch:
        greedy = [p.greedy for p in params]
        temperature = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        # Features of greedy rows are ignored, so they do not switch the filters on.
        random_rows = [p for p, g in zip(params, greedy) if not g]
        random_top_k = [k for k, g in zip(top_k, greedy) if not g]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        extra = {}
        biased = [(row, token, value) for row, p in enumerate(params) for token, value in p.logit_bias.items()]
        if biased:
            rows, token_ids, values = zip(*biased)
            extra.update(bias_rows=torch.tensor(rows, device=device),
                         bias_token_ids=torch.tensor(token_ids, device=device),
                         bias_values=torch.tensor(values, dtype=torch.float32, device=device))
        allowed = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
        if allowed:
            pairs = [(i, token) for i, row in enumerate(allowed) for token in params[row].allowed_token_ids]
            extra.update(allowed_rows=torch.tensor(allowed, device=device),
                         allowed_index=torch.tensor([i for i, _ in pairs], device=device),
                         allowed_token_ids=torch.tensor([t for _, t in pairs], device=device))
        penalized = [row for row, p in enumerate(params) if p.has_penalties]
        if penalized:
            column = lambda name: torch.tensor(  # noqa: E731
                [getattr(params[row], name) for row in penalized], dtype=torch.float32, device=device).unsqueeze(1)
            extra.update(penalty_rows=torch.tensor(penalized, device=device),
                         presence_penalty=column("presence_penalty"), frequency_penalty=column("frequency_penalty"),
                         repetition_penalty=column("repetition_penalty"))
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_top_k=any(k > 0 for k in random_top_k),
            any_top_p=any(p.top_p < 1.0 for p in random_rows),
            any_min_p=any(p.min_p > 0.0 for p in random_rows),
            max_top_k=max(random_top_k, default=0),
            seeded=[(i, p.seed) for i, p in enumerate(params) if p.seed is not None and not p.greedy],
            num_logprobs=[p.logprobs for p in params],
            max_num_logprobs=max(asked) if asked else None,
            **extra,
        )

    def __len__(self) -> int:
        return len(self.num_logprobs)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: logprob of the chosen token (None if no row asked)
    top_token_ids: torch.Tensor | None  # [B, n] int64, n = max logprobs asked in the batch
    top_logprobs: torch.Tensor | None  # [B, n] float32

    def to_sampled_tokens(self, batch: SamplingBatch) -> list[SampledToken]:
        """One SampledToken per row, logprobs only for rows that asked, cut to the n each asked."""
        token_ids = self.token_ids.tolist()
        if self.logprobs is None or self.top_token_ids is None or self.top_logprobs is None:
            return [SampledToken(token_id=t) for t in token_ids]
        logprobs = self.logprobs.tolist()
        top_ids = self.top_token_ids.tolist()
        top_lps = self.top_logprobs.tolist()
        return [
            SampledToken(token_id=t)
            if n is None
            else SampledToken(token_id=t, logprob=lp, top_token_ids=ids[:n], top_logprobs=lps[:n])
            for t, n, lp, ids, lps in zip(token_ids, batch.num_logprobs, logprobs, top_ids, top_lps)
        ]


class TokenCounts:
    """Per-request token counts on the device, for penalties: how often each token appears in the output, and
    whether it appears at all (prompt or output). One row per request that has penalties, kept between steps and
    updated with one scatter per step for the whole batch.
    """

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.rows: dict[str, int] = {}
        self.free_rows: list[int] = []

    def add(self, request_id: str) -> None:
        if not self.free_rows:
            # Doubling keeps the number of reallocations logarithmic in the peak number of such requests.
            old = self.output_counts.shape[0]
            new = max(2 * old, 8)
            self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(new - old, self.vocab_size)])
            self.seen = torch.cat([self.seen, self.seen.new_zeros(new - old, self.vocab_size)])
            self.free_rows.extend(range(new - 1, old - 1, -1))
        row = self.free_rows.pop()
        self.output_counts[row] = 0
        self.seen[row] = False
        self.rows[request_id] = row

    def remove(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)

    def clear(self) -> None:
        self.free_rows.extend(self.rows.values())
        self.rows.clear()

    def record(self, request_ids: list[str], token_ids: list[int], is_output: list[bool]) -> None:
        """Counts a step's tokens of every tracked request at once (flattened: request_ids[i] saw
        token_ids[i], an output token when is_output[i])."""
        if not request_ids:
            return
        rows = torch.tensor([self.rows[r] for r in request_ids], device=self.device)
        tokens = torch.tensor(token_ids, device=self.device)
        output = torch.tensor(is_output, device=self.device)
        self.output_counts.index_put_((rows[output], tokens[output]),
                                      torch.ones((), dtype=torch.int32, device=self.device), accumulate=True)
        self.seen.index_put_((rows, tokens), torch.ones((), dtype=torch.bool, device=self.device))

    def gather(self, request_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every token these requests have seen, flattened: (the request's index in request_ids, the token id,
        its count in the request's output). A few hundred a request, where the dense rows are the vocabulary."""
        rows = torch.tensor([self.rows[r] for r in request_ids], device=self.device)
        index, token_ids = self.seen[rows].nonzero(as_tuple=True)
        return index, token_ids, self.output_counts[rows[index], token_ids]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch, index: torch.Tensor, token_ids: torch.Tensor,
                    output_counts: torch.Tensor) -> None:
    """vLLM's penalties, in place on the batch's penalty rows, over the tokens each has seen (TokenCounts.gather:
    penalty row index[i] saw token_ids[i], output_counts[i] times in its output): repetition over every token seen
    (divide a positive logit, multiply a negative one), then frequency (per occurrence) and presence (once) over
    the output tokens. Only the seen tokens change, so only they are computed: arithmetic over the whole rows took
    43 ms a step at 64 rows of 49152 on the CPU."""
    rows = batch.penalty_rows[index]
    seen = logits[rows, token_ids]
    rep = batch.repetition_penalty[index, 0]
    seen = torch.where(seen > 0, seen / rep, seen * rep)
    counts = output_counts.to(seen.dtype)
    seen -= batch.frequency_penalty[index, 0] * counts + batch.presence_penalty[index, 0] * (counts > 0)
    logits[rows, token_ids] = seen


def _top_k_threshold(desc_values: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """[B, 1] smallest logit each row keeps under top-k, given its values sorted descending; -inf if off."""
    kth = desc_values.gather(1, (top_k.clamp(1, desc_values.shape[1]) - 1).unsqueeze(1))
    return kth.masked_fill((top_k <= 0).unsqueeze(1), float("-inf"))


# How many of the most likely tokens a row's top-p cut is looked for among, first, then next, found without sorting
# the vocabulary: at 64 rows of 49152 (SmolLM2) torch.topk took 2.4 ms for 64 and 15 for 1024, where the sort took
# 110. A row whose cut lies further down (a flat distribution) is sorted whole.
TOP_P_CANDIDATES = (64, 1024)


def _nucleus(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, log_total: torch.Tensor,
             width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k, then top-p over the distribution top-k left, among each row's `width` most likely tokens (log_total:
    the logsumexp of each whole row). Returns their ids and logits (descending), which of them each row keeps (a
    leading run), and whether its cut fell among them, so that every token beyond them is dropped as well (always,
    with width the whole row)."""
    vocab = logits.shape[1]
    values, ids = logits.topk(min(width, vocab), dim=-1)  # (as fast as a sort at the whole row)
    kth = _top_k_threshold(values, top_k)
    cut_by_k = values[:, -1] < kth.squeeze(1)  # every token beyond is below the k-th (none tied with it)
    kept = values >= kth
    # Each row's distribution: over its top k (all among these where cut_by_k), else over the whole row.
    top_k_total = values.masked_fill(~kept, float("-inf")).logsumexp(dim=-1)
    probs = (values - torch.where(top_k > 0, top_k_total, log_total).unsqueeze(1)).exp() * kept
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p.unsqueeze(1)
    # The top token always stays: a top_p that rounds to 0 in float32 (1e-46) would otherwise drop every token.
    drop[:, 0] = False
    # Rounding can push the tail's cumulative sum to 1, which must not filter rows with top_p = 1.
    drop &= (top_p < 1.0).unsqueeze(1)
    kept &= ~drop
    # Past a dropped token the mass before each token only grows: the rest are dropped as well. (A top-k whose k-th
    # token has ties beyond these weighed only part of its tokens: its cut is looked for again, wider.)
    return ids, values, kept, cut_by_k | ((top_k <= 0) & drop.any(dim=-1)) | (width >= vocab)


def _filtering_rows(batch: SamplingBatch) -> torch.Tensor:
    """[B] bool: the random rows that filter by top-k or top-p."""
    return ((batch.top_p < 1.0) | (batch.top_k > 0)) & ~batch.greedy


def _nucleus_tiers(logits: torch.Tensor, batch: SamplingBatch):
    """Top-k and top-p of the rows that filter (_filtering_rows), each row's cut looked for among its
    TOP_P_CANDIDATES most likely tokens, then the next tier, then the whole row sorted: yields, tier by tier, the
    rows whose cut it found, with their candidates (_nucleus's ids, logits and kept)."""
    pending = _filtering_rows(batch).nonzero().flatten()  # the rows whose cut is not found yet
    if not len(pending):
        return
    # (Only top-p without top-k weighs the whole row.)
    log_total = logits.logsumexp(dim=-1) if batch.any_top_p else logits.new_zeros(len(logits))
    for candidates in (*TOP_P_CANDIDATES, logits.shape[1]):
        rows = logits if len(pending) == len(logits) else logits[pending]
        # One token past the largest k, which tells whether the k-th has ties beyond.
        ids, values, kept, settled = _nucleus(rows, batch.top_k[pending], batch.top_p[pending], log_total[pending],
                                              max(candidates, batch.max_top_k + 1))
        done = pending[settled]
        if len(done):
            yield done, ids[settled], values[settled], kept[settled]
        pending = pending[~settled]
        if not len(pending):
            return


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: p < min_p * p_max  <=>  logit < max_logit + log(min_p); log(0) = -inf keeps every token."""
    floor = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    logits.masked_fill_(logits < floor, float("-inf"))


def filter_logits(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] float32 logits, tempered, then filtered by top-k, top-p and min-p; dropped tokens are -inf (the
    random rows; greedy rows come out tempered alone). The kept sets as whole rows: the sampler draws from the same
    candidates without building them (Sampler._sample); the tests and bench/sampler.py check against these."""
    logits = raw / batch.temperature.unsqueeze(1)  # a fresh tensor, so the filters below work in place
    neg_inf = float("-inf")
    if batch.any_top_p or batch.any_top_k:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        for rows, ids, _, kept in _nucleus_tiers(logits, batch):
            keep[rows] = keep.new_zeros(len(rows), keep.shape[1]).scatter_(1, ids, kept)
        logits.masked_fill_(~keep & _filtering_rows(batch).unsqueeze(1), neg_inf)
    if batch.any_min_p:
        _apply_min_p(logits, batch.min_p)
    return logits


# Tokens per chunk of inverse_cdf's two-level search.
CDF_CHUNK = 256


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[B] token ids drawn from probs [B, V] (rows of non-negative weights, each with some positive, not necessarily
    summing to 1) by inverse transform sampling, uniform [B] float64 in [0, 1): the token whose interval of the
    cumulative weights holds uniform times the row's total. A token of weight 0 has an empty interval and is never
    drawn. One random number a row, where drawing one per token (an exponential race) took 59 of a 64-row step's 69
    ms at 49152 tokens on the CPU. The sums go in two levels, chunks of CDF_CHUNK tokens in float64 and the chosen
    chunk's tokens, so that rounding at the scale of the whole row does not swallow small weights."""
    rows, vocab = probs.shape
    pad = -vocab % CDF_CHUNK
    chunks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(rows, -1, CDF_CHUNK)
    chunk_cdf = chunks.sum(dim=-1).double().cumsum(dim=-1)  # [B, C]
    total = chunk_cdf[:, -1:]
    # Strictly below the total, so that the search lands on a chunk, and then a token, of positive weight.
    target = torch.minimum(uniform.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    chunk = torch.searchsorted(chunk_cdf, target, right=True).clamp_max_(chunk_cdf.shape[1] - 1)
    before = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp_min(0)), 0.0)
    weights = chunks[torch.arange(rows, device=probs.device), chunk.squeeze(1)]  # [B, CDF_CHUNK]
    within = torch.searchsorted(weights.double().cumsum(dim=-1), target - before, right=True)
    # The chunk's own sum may round a hair below its total in chunk_cdf: past its end means its last positive token.
    positions = torch.arange(CDF_CHUNK, device=probs.device)
    last_positive = torch.where(weights > 0, positions, -1).amax(dim=-1, keepdim=True)
    within = torch.where(within < CDF_CHUNK, within, last_positive)
    # (A row with no positive weight, all NaN, has no answer; it still gets a token id.)
    return (chunk * CDF_CHUNK + within).squeeze(1).clamp_(0, vocab - 1)


class Sampler:
    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        # The CPU kernels' vectorised argmax, where the executor has them: torch's CPU argmax is scalar, and
        # took 1.5% of a 64-request decode step.
        self.fused_argmax = argmax

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """argmax(dim=-1) of float logits [B, V]: the first largest of each row (a NaN before any number)."""
        if self.fused_argmax is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1:
            return self.fused_argmax(logits)
        return logits.argmax(dim=-1)

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor | Sequence[int],
        penalty_counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        grammar_mask: tuple[torch.Tensor, list[int]] | None = None,
        banned: tuple[list[int], list[int]] | None = None,
    ) -> SamplerOutput:
        """logits [B, V] (any float dtype; compute in float32). positions[i] = the sequence position of
        the token row i is sampling (used with the seed). penalty_counts: the tokens the batch's penalty rows
        have seen, with their output counts (TokenCounts.gather). grammar_mask: a [B, ceil(V / 32)] int32 token
        bitmask and the rows it applies to (a grammar's allowed tokens). banned: (rows, token ids) that may not be
        sampled (stop tokens before min_tokens, bad words)."""
        raw = logits.float()
        adjusted = raw
        if (batch.bias_rows is not None or batch.penalty_rows is not None or grammar_mask is not None
                or banned is not None or batch.allowed_rows is not None):
            adjusted = raw.clone()  # logprobs stay those of the model's own distribution
            if batch.allowed_rows is not None:
                rows = batch.allowed_rows
                adjusted[rows] = adjusted[rows].masked_fill(~batch.allowed_mask(adjusted.shape[1]), float("-inf"))
            if banned is not None:
                adjusted[banned] = float("-inf")
            if batch.bias_rows is not None:
                adjusted.index_put_((batch.bias_rows, batch.bias_token_ids), batch.bias_values, accumulate=True)
            if batch.penalty_rows is not None:
                apply_penalties(adjusted, batch, *penalty_counts)
            if grammar_mask is not None:
                import xgrammar

                bitmask, rows = grammar_mask
                xgrammar.apply_token_bitmask_inplace(adjusted, bitmask.to(adjusted.device), indices=rows)
        if batch.all_greedy:
            token_ids = self.greedy(adjusted)
        else:
            token_ids = self._sample(adjusted, batch, positions)
            if batch.any_greedy:
                token_ids = torch.where(batch.greedy, self.greedy(adjusted), token_ids)
        if batch.max_num_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        # Raw logprobs, as vLLM reports by default: the model's distribution before temperature and filters.
        logprobs = torch.log_softmax(raw, dim=-1)
        top = logprobs.topk(batch.max_num_logprobs, dim=-1)
        chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        return SamplerOutput(token_ids, chosen, top.indices, top.values)

    def _sample(
        self, raw: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor | Sequence[int]
    ) -> torch.Tensor:
        """The random rows' tokens (greedy rows' are left to the caller): each drawn by inverse_cdf with a uniform
        number of its own, a row with top-k or top-p among its candidates alone, in their order (_nucleus_tiers),
        the others over the whole vocabulary. Which way a row goes is its own parameters' choice, so that a seed
        gives the same tokens whatever the rest of the batch."""
        uniform = torch.rand(raw.shape[0], dtype=torch.float64, device=raw.device)
        if batch.seeded:
            pos = positions.tolist() if isinstance(positions, torch.Tensor) else list(positions)
            for row, seed in batch.seeded:
                gen = torch.Generator(device=raw.device)
                gen.manual_seed(mix_seed(seed, int(pos[row])))
                uniform[row : row + 1].uniform_(generator=gen)
        logits = raw / batch.temperature.unsqueeze(1)
        token_ids = torch.zeros(raw.shape[0], dtype=torch.int64, device=raw.device)
        for rows, ids, values, kept in _nucleus_tiers(logits, batch):
            values.masked_fill_(~kept, float("-inf"))
            if batch.any_min_p:
                _apply_min_p(values, batch.min_p[rows])
            choice = inverse_cdf(values.softmax(dim=-1), uniform[rows])
            token_ids[rows] = ids.gather(1, choice.unsqueeze(1)).squeeze(1)
        whole = (~_filtering_rows(batch) & ~batch.greedy).nonzero().flatten()
        if len(whole):
            rest = logits if len(whole) == len(logits) else logits[whole]
            if batch.any_min_p:
                _apply_min_p(rest, batch.min_p[whole])
            token_ids[whole] = inverse_cdf(rest.softmax(dim=-1), uniform[whole])
        return token_ids
