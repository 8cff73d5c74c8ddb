"""The KV tensors: allocated once at start-up, sized from a memory budget."""
from __future__ import annotations

import torch

from executor_svc.model_config import ModelConfig


def available_memory(device: torch.device) -> int:
    """Bytes the KV cache may draw on: free device memory on CUDA, MemAvailable on the host."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass kv_cache_memory")


def num_blocks_for_budget(config: ModelConfig, dtype: torch.dtype, block_size: int, memory_bytes: int) -> int:
    block_bytes = config.kv_bytes_per_token(dtype) * block_size
    num_blocks = memory_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory of {memory_bytes} bytes holds no block; one block of {block_size} tokens "
            f"needs {block_bytes} bytes"
        )
    return int(num_blocks)


def allocate_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Zeros, not empty: attention masks padded key slots, and a masked NaN would still poison the sum.
    shape = (num_blocks, config.num_kv_heads, block_size, config.head_dim)  # HND, see the attention backend
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_layers)
    ]
