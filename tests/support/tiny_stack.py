"""A tiny random Llama that the frontend can tokenize for: what the tests of a whole stack start, in seconds."""
from __future__ import annotations

import shutil
import time

from pagedserve.v1 import kvcache_pb2, kvcache_pb2_grpc
from tests.conftest import write_tiny_model


def write_tiny_model_with_tokenizer(path, **config_overrides):
    """A tiny random Llama whose ids all decode with the default model's tokenizer (the frontend needs one)."""
    from executor_svc.model_loader import resolve_model_dir

    write_tiny_model("llama", path, **config_overrides)
    for source in resolve_model_dir("default").iterdir():
        if source.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(source, path / source.name)
    return path


def kv_stats(stack) -> kvcache_pb2.KVCacheStats:
    with stack.channel("kvcache_svc") as ch:
        return kvcache_pb2_grpc.KVCacheStub(ch).GetStats(kvcache_pb2.KVCacheStatsRequest(), timeout=10)


def wait_until_idle(stack, timeout: float = 20.0) -> kvcache_pb2.KVCacheStats:
    """The KV-cache service's stats once no request holds a block (freed a step after a request ends)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = kv_stats(stack)
        if (stats.num_requests == 0 and stats.num_in_use == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)
