"""Beam search by vLLM's rule on transformers' logits, the reference of the server's and the offline LLM's."""
from __future__ import annotations

import torch


def reference_beam_search(model, eos: int, prompt: list[int], width: int, max_tokens: int,
                          length_penalty: float) -> list[tuple[tuple[int, ...], float]]:
    """vLLM's beam search on transformers' logits: every live beam extended by its 2 x width likeliest tokens, EOS
    completing one, the best width of the rest living on; ranked by cumulative logprob / length ** penalty."""
    live, complete = [((), 0.0)], []
    for _ in range(max_tokens):
        extended = []
        for tokens, logprob in live:
            with torch.no_grad():
                row = model(torch.tensor([prompt + list(tokens)])).logits[0, -1].float().log_softmax(-1)
            top = row.topk(2 * width)
            for token, value in zip(top.indices.tolist(), top.values.tolist()):
                (complete if token == eos else extended).append((tokens + (token,), logprob + value))
        live = sorted(extended, key=lambda beam: beam[1], reverse=True)[:width]
        if not live:
            break

    def score(beam):
        return beam[1] / (len(prompt) + len(beam[0]) - (beam[0][-1] == eos)) ** length_penalty
    return [(tokens, score((tokens, logprob))) for tokens, logprob in
            sorted(complete + live, key=score, reverse=True)[:width]]


def beam_score(model, eos: int, prompt: list[int], tokens: list[int], length_penalty: float) -> float:
    with torch.no_grad():
        rows = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
    logprob = rows.gather(1, torch.tensor(tokens).unsqueeze(1)).sum().item()
    return logprob / (len(prompt) + len(tokens) - (tokens[-1] == eos)) ** length_penalty
