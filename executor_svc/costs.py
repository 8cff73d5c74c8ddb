"""What the executor's work costs on this machine: the model's linear layers alone over a number of tokens,
and copying K/V blocks between the pool and host memory.

The executor measures both at start-up (milliseconds) and reports them (ExecutorInfo): they are the figures
the block manager weighs when the pool runs short, between recomputing a preempted request's tokens when it
resumes and copying its blocks out and back (see kvcache_svc/kv_cache_manager.py). The benchmarks time the
linear layers with the same code (bench/roofline.py, bench/throughput.py).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from executor_svc.models.llama import SparseMoE

# Rows of the start-up prefill probe: enough for the matrix multiplications to run at their chunked-prefill
# speed, few enough to cost milliseconds on the CPU.
PROBE_TOKENS = 128
PROBE_BLOCKS = 4


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def linear_layers_seconds(model, num_tokens: int, num_logits: int, num_layers: int | None = None,
                          repeats: int = 1) -> float:
    """Median seconds of the model's linear layers alone on random activations: every nn.Linear of its first
    num_layers decoder layers (all by default; q/k/v, o, gate/up and down projections) over num_tokens rows,
    and a mixture of experts' routed experts over the rows they would get on average (num_tokens times the
    experts per token, spread evenly), then the LM head over num_logits rows. No attention, norms or
    activations. An untimed run comes first."""
    weight = model.embed_tokens.weight
    device, dtype = weight.device, weight.dtype
    linears, inputs = [], []
    for layer in list(model.layers)[:num_layers]:
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                linears.append(module)
                inputs.append(torch.randn(num_tokens, module.in_features, device=device, dtype=dtype))
            elif isinstance(module, SparseMoE):
                moe = module.moe
                rows = max(1, round(num_tokens * moe.experts_per_token / moe.num_experts))
                linears.append(module.expert_products)
                inputs.append(torch.randn(rows, weight.shape[1], device=device, dtype=dtype))
    hidden = torch.randn(num_logits, weight.shape[1], device=device, dtype=dtype)
    times = []
    for _ in range(repeats + 1):
        _synchronize(device)
        start = time.perf_counter()
        for linear, x in zip(linears, inputs):
            linear(x)
        if num_logits:
            model.compute_logits(hidden)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def prefill_tokens_per_s(model, num_tokens: int = PROBE_TOKENS) -> float:
    """Prefill tokens/s as the linear layers allow: one decoder layer's over num_tokens rows, times the number
    of layers. Attention and the LM head are left out, which makes recomputing look cheaper than it is."""
    return num_tokens / (linear_layers_seconds(model, num_tokens, 0, num_layers=1, repeats=3) * len(model.layers))


def copy_bytes_per_s(read_blocks: Callable[[list[int]], list[bytes]],
                     write_blocks: Callable[[list[int], list[bytes]], None], num_blocks: int, block_bytes: int,
                     device: torch.device) -> float:
    """Bytes/s of copying blocks from the pool to host memory and back, as a swap does: the pool's first
    PROBE_BLOCKS blocks read and written back unchanged (before any request holds them), best of three."""
    block_ids = list(range(min(PROBE_BLOCKS, num_blocks)))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        write_blocks(block_ids, read_blocks(block_ids))
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * len(block_ids) * block_bytes / best
