"""The KV tensors: allocated once at start-up, sized from a memory budget."""
from __future__ import annotations

import logging
import mmap

import torch

from executor_svc.model_config import ModelArchitecture
from pagedserve.config import CPU_KV_CACHE_CAP, CacheConfig

logger = logging.getLogger(__name__)

# Attention reads a request's blocks scattered over the pool, each on a page of its own with 4 kB pages, so
# every block costs a TLB miss (a two-level walk inside a VM). With 2 MB pages the TLB covers the pool: decode
# attention over 30 layers' pools ran 14% faster in bfloat16 and 7% in float32 on an AMD EPYC (docs/benchmarks.md).
# Linux's transparent huge pages, in their common "madvise" mode, back only memory advised so before its first
# touch.
HUGE_PAGE = 2 << 20


def kv_cache_budget(cache: CacheConfig, device: torch.device, bytes_per_token: int, max_model_len: int,
                    max_num_seqs: int) -> int:
    """Bytes for the KV tensors: kv_cache_memory when given. Else, on CUDA, kv_cache_fraction of the device
    memory free once the weights are loaded; on the CPU, what max_num_seqs requests of max_model_len tokens
    take, capped at CPU_KV_CACHE_CAP and at kv_cache_fraction of the host's total memory (total, not
    available, so that the same config gives the same pool on every start)."""
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * cache.kv_cache_fraction)
    wanted = bytes_per_token * max_model_len * max_num_seqs
    return min(wanted, CPU_KV_CACHE_CAP, int(host_memory_total() * cache.kv_cache_fraction))


def host_memory_total() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemTotal from /proc/meminfo; pass kv_cache_memory")


def kv_cache_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The K/V tensors' dtype for CacheConfig.kv_cache_dtype: `auto` is the model's."""
    return model_dtype if setting == "auto" else getattr(torch, setting)


def num_blocks_for_budget(config: ModelArchitecture, dtype: torch.dtype, block_size: int, memory_bytes: int) -> int:
    block_bytes = config.kv_bytes_per_token(dtype) * block_size
    num_blocks = memory_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory of {memory_bytes} bytes holds no block; one block of {block_size} tokens "
            f"needs {block_bytes} bytes"
        )
    return int(num_blocks)


def allocate_kv_caches(
    config: ModelArchitecture, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Zeros, not empty: attention masks padded key slots, and a masked NaN would still poison the sum.
    shape = (num_blocks, config.num_kv_heads, block_size, config.head_dim)  # HND, see the attention backend
    if device.type != "cpu":
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(config.num_layers)]
    numel = num_blocks * config.num_kv_heads * block_size * config.head_dim
    pool = huge_page_zeros(2 * config.num_layers * numel * dtype.itemsize).view(dtype)
    halves = [pool[i * numel:(i + 1) * numel].view(shape) for i in range(2 * config.num_layers)]
    return list(zip(halves[0::2], halves[1::2]))


def huge_page_zeros(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed host memory (uint8) starting on a 2 MB boundary, from a fresh anonymous mapping advised
    for transparent huge pages before it is touched (where Linux offers them; elsewhere ordinary pages). Fresh,
    because memory the allocator hands back from its heap may have its small pages already."""
    whole = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # Private: a shared anonymous mapping is shmem, whose huge pages another setting governs (off by default).
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
    region = mmap.mmap(-1, whole + HUGE_PAGE, **private)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive
    offset = -raw.data_ptr() % HUGE_PAGE
    if whole and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, offset, whole)
        except OSError as error:
            logger.info("transparent huge pages not available for the KV pool: %s", error)
    return raw[offset:offset + nbytes].zero_()  # faulted in now, as the pool always was
