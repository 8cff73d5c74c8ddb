"""The batched sampler's cost in a decode step: its time over B rows of a model's own next-token distributions
(the logits at B positions of this repository's README, so that top-p's nucleus is as wide as a real model's),
setting by setting, beside the way it sampled until stop 49 (the whole vocabulary sorted for top-p, and one
exponential draw per token: the race vLLM's GPU sampler runs; the penalties over every row's whole vocabulary) and beside the model's linear layers over B rows (a
decode step's bound). Writes bench/results/sampler.json: `<setting>_vs_reference` is the sampler's time ÷ the
reference's, `<setting>_share_of_decode` its time ÷ (its time + the linear layers').

    python bench/sampler.py [--model default] [--rows 64] [--repeats 20]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402
from executor_svc.costs import linear_layers_seconds  # noqa: E402
from executor_svc.model_loader import resolve_model_dir  # noqa: E402
from executor_svc.model_runner import ModelRunner  # noqa: E402
from executor_svc.sampler import SamplingBatch, TokenCounts, _top_k_threshold, filter_logits  # noqa: E402
from pagedserve.config import CacheConfig, ModelConfig  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402

SETTINGS = {
    "temperature": SamplingParams(temperature=1.0),  # OpenAI's default
    "top_p": SamplingParams(temperature=0.7, top_p=0.9),
    "top_k": SamplingParams(temperature=0.7, top_k=50),
    "top_k_top_p": SamplingParams(temperature=0.7, top_k=50, top_p=0.95),
    "min_p": SamplingParams(temperature=0.7, min_p=0.05),
    "seeded_top_p": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
    "repetition_penalty": SamplingParams(temperature=0.0, repetition_penalty=1.1),
    "all_penalties": SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.3,
                                    presence_penalty=0.3),
}
# Each row's history, for the penalties: prompt and output tokens drawn at random from the vocabulary.
HISTORY_PROMPT, HISTORY_OUTPUT = 512, 64


def reference_penalties(logits: torch.Tensor, batch: SamplingBatch, output_counts: torch.Tensor,
                        seen: torch.Tensor) -> torch.Tensor:
    """The penalties as the sort-and-race sampler applied them: over every row's whole vocabulary, from dense
    [P, V] output counts and seen flags."""
    logits = logits.clone()
    sub, counts, in_output = logits[batch.penalty_rows], output_counts.float(), output_counts > 0
    rep = batch.repetition_penalty
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= batch.frequency_penalty * counts + batch.presence_penalty * in_output
    logits[batch.penalty_rows] = sub
    return logits


def reference_sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The sort-and-race sampler: tempered logits, top-k and top-p on the whole vocabulary sorted, min-p, then
    argmax(p / q) for q ~ Exp(1) drawn for every token (a generator of its own for each seeded row)."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    logits = logits / batch.temperature.unsqueeze(1)
    if batch.any_top_p:
        values, ids = logits.sort(dim=-1, descending=True)
        values.masked_fill_(values < _top_k_threshold(values, batch.top_k), float("-inf"))
        probs = values.softmax(dim=-1)
        drop = (probs.cumsum(dim=-1) - probs >= batch.top_p.unsqueeze(1)) & (batch.top_p < 1.0).unsqueeze(1)
        drop[:, 0] = False
        logits = torch.empty_like(values).scatter_(1, ids, values.masked_fill(drop, float("-inf")))
    elif batch.any_top_k:
        kth = _top_k_threshold(logits.topk(min(batch.max_top_k, logits.shape[1]), dim=-1).values, batch.top_k)
        logits.masked_fill_(logits < kth, float("-inf"))
    if batch.any_min_p:
        logits.masked_fill_(logits < logits.amax(dim=-1, keepdim=True) + batch.min_p.log().unsqueeze(1), float("-inf"))
    probs = logits.softmax(dim=-1)
    q = torch.empty_like(probs).exponential_()
    for row, seed in batch.seeded:
        q[row].exponential_(generator=torch.Generator().manual_seed(seed))
    return probs.div_(q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=-1)


def model_logits(model_dir: Path, rows: int) -> torch.Tensor:
    """[rows, V] float32: the model's logits (transformers') at the first `rows` positions of the README."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    ids = AutoTokenizer.from_pretrained(model_dir)(text, return_tensors="pt").input_ids[:, :rows]
    assert ids.shape[1] == rows, f"the README holds {ids.shape[1]} tokens, fewer than --rows"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(ids).logits[0].float()


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--name", default="sampler", help="result file name under bench/results/")
    args = parser.parse_args()

    logits = model_logits(resolve_model_dir(args.model), args.rows)
    runner = ModelRunner(ModelConfig(args.model, device="cpu", dtype="float32"), CacheConfig(kv_cache_memory=1 << 26))
    decode_s = linear_layers_seconds(runner.model, args.rows, args.rows, repeats=5)
    sampler = runner.sampler  # the executor's own (with the CPU kernels' argmax)
    positions = list(range(args.rows))
    counts, gen = TokenCounts(logits.shape[1], "cpu"), torch.Generator().manual_seed(0)
    request_ids = [str(row) for row in range(args.rows)]
    for request_id in request_ids:
        counts.add(request_id)
        history = torch.randint(logits.shape[1], (HISTORY_PROMPT + HISTORY_OUTPUT,), generator=gen).tolist()
        counts.record([request_id] * len(history), history, [i >= HISTORY_PROMPT for i in range(len(history))])
    rows = counts.output_counts.new_tensor([counts.rows[r] for r in request_ids])
    ratios, cases = {}, {}
    for name, params in SETTINGS.items():
        batch = SamplingBatch.build([params] * args.rows)
        penalized = params.has_penalties
        # Both times include what the step gathers for the penalties: the rows' seen tokens, or their dense rows.
        sampler_s = median_seconds(lambda: sampler(
            logits, batch, positions, counts.gather(request_ids) if penalized else None), args.repeats)
        reference_s = median_seconds(lambda: reference_sample(
            reference_penalties(logits, batch, counts.output_counts[rows], counts.seen[rows]) if penalized else logits, batch), args.repeats)
        kept = torch.isfinite(filter_logits(logits, batch)).sum(dim=-1).float()
        cases[name] = {"sampler_s": sampler_s, "reference_s": reference_s,
                       "tokens_kept_median": kept.median().item(), "tokens_kept_max": kept.max().item()}
        ratios[f"{name}_vs_reference"] = sampler_s / reference_s
        ratios[f"{name}_share_of_decode"] = sampler_s / (sampler_s + decode_s)
        print(f"{name:14s} sampler {sampler_s * 1e3:7.2f} ms, reference {reference_s * 1e3:7.2f} ms "
              f"({sampler_s / reference_s:.3f}); {sampler_s / (sampler_s + decode_s):.1%} of a decode step "
              f"whose linear layers take {decode_s * 1e3:.1f} ms; tokens kept: median "
              f"{cases[name]['tokens_kept_median']:.0f}", flush=True)
    metrics = {"rows": args.rows, "vocab_size": logits.shape[1], "torch_threads": torch.get_num_threads(),
               "linear_layers_decode_s": decode_s, "settings": {name: repr(p) for name, p in SETTINGS.items()},
               "cases": cases}
    print(f"wrote {write_result(args.name, ratios, metrics)}")


if __name__ == "__main__":
    main()
