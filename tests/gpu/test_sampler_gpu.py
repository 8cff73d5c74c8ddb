"""The sampler on CUDA, as the GPU executor runs it: top-k and top-p keep what they keep on the CPU (the candidate
tiers, min-p), every draw lands on a kept token, and a seed gives the same tokens alone or in a batch."""
from __future__ import annotations

import torch

from executor_svc.sampler import Sampler, SamplingBatch, filter_logits, inverse_cdf
from pagedserve.sampling_params import SamplingParams

DEVICE = "cuda"
# Rows whose top-p cut lies among the first candidates, the next, and only further down; top-k with top-p; min-p.
SCALES = [6.0, 2.6, 1.5, 0.2, 6.0, 3.0, 1.0, 0.2]
PARAMS = [SamplingParams(top_p=0.95), SamplingParams(top_p=0.9), SamplingParams(top_p=0.9), SamplingParams(top_p=0.5),
          SamplingParams(top_k=40, top_p=0.8), SamplingParams(top_k=200, top_p=0.99), SamplingParams(min_p=0.05),
          SamplingParams(temperature=0.5, top_p=0.9)]


def scaled_logits(vocab: int = 6000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(len(SCALES), vocab, generator=gen) * torch.tensor(SCALES).unsqueeze(1)


def test_filters_keep_on_cuda_what_they_keep_on_the_cpu():
    logits = scaled_logits()
    on_cpu = torch.isfinite(filter_logits(logits, SamplingBatch.build(PARAMS)))
    on_gpu = torch.isfinite(filter_logits(logits.to(DEVICE), SamplingBatch.build(PARAMS, device=DEVICE))).cpu()
    # The devices' exp and sums may round apart by an ulp: at most the token at a row's top-p cut differs.
    assert ((on_cpu ^ on_gpu).sum(dim=-1) <= 1).all(), (on_cpu.sum(dim=-1), on_gpu.sum(dim=-1))
    assert (on_cpu.sum(dim=-1) > 1).all()


def test_every_draw_is_a_kept_token_and_a_seed_holds_whatever_the_batch():
    logits = scaled_logits().to(DEVICE)
    params = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=row)
              for row, p in enumerate(PARAMS)]
    batch = SamplingBatch.build(params, device=DEVICE)
    kept = torch.isfinite(filter_logits(logits, batch))
    sampler = Sampler()
    draws = []
    for position in range(50):
        tokens = sampler(logits, batch, [position] * len(params)).token_ids
        assert kept.gather(1, tokens.unsqueeze(1)).all(), position
        draws.append(tokens.cpu())
    assert all(len(set(column.tolist())) > 1 for column in torch.stack(draws).T[:4])  # the top-p rows vary
    for row in (1, 6):  # alone, the same tokens as in the batch
        alone = SamplingBatch.build([params[row]], device=DEVICE)
        for position in range(0, 50, 7):
            assert sampler(logits[row:row + 1], alone, [position]).token_ids.item() == draws[position][row].item()


def test_inverse_cdf_on_cuda_never_draws_a_token_of_weight_zero():
    weights = torch.zeros(3, 1000, device=DEVICE)
    weights[0, 999] = 1.0
    weights[1, [0, 500]] = torch.tensor([1e-30, 1.0], device=DEVICE)
    weights[2, :] = 1.0
    for u in (0.0, 0.5, 1.0 - 2.0**-53):
        tokens = inverse_cdf(weights, torch.full((3,), u, dtype=torch.float64, device=DEVICE))
        assert (weights.gather(1, tokens.unsqueeze(1)) > 0).all(), (u, tokens)
