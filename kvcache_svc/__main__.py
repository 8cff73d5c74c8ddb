"""python -m kvcache_svc --port 50053 --executor 127.0.0.1:50054

The pool is sized from the executor (its KV tensors hold num_blocks blocks of block_size tokens), or
from --num-blocks and --block-size.
"""
from __future__ import annotations

import argparse
import logging

from kvcache_svc.kv_cache_manager import KVCacheManager
from kvcache_svc.offload_index import make_tier_index
from kvcache_svc.server import KVCacheServicer
from pagedserve.service import Service, add_service_arguments, channel, configure_logging
from pagedserve.v1 import executor_pb2, executor_pb2_grpc, kvcache_pb2_grpc

logger = logging.getLogger("kvcache_svc")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvcache_svc", description=__doc__)
    add_service_arguments(parser, default_port=50053)
    parser.add_argument("--executor", help="executor address to size the pool from")
    parser.add_argument("--num-blocks", type=int)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--model-id", help="names the K/V in prefix hashes (default: from the executor)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--offload-all", action="store_true",
                        help="copy every block to the offload tier as it fills, not only on eviction")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    if args.executor:
        with channel(args.executor) as ch:
            info = executor_pb2_grpc.ExecutorStub(ch).GetInfo(
                executor_pb2.ExecutorInfoRequest(), wait_for_ready=True, timeout=args.startup_timeout
            )
        num_blocks, block_size = info.num_blocks, info.block_size
        model_id = args.model_id or info.model_id
        tier = make_tier_index(info.offload, info.offload_capacity_blocks, info.offload_redis_url)
        block_bytes = info.block_bytes
    elif args.num_blocks and args.block_size and args.model_id:
        num_blocks, block_size, model_id = args.num_blocks, args.block_size, args.model_id
        tier, block_bytes = None, 0
    else:
        parser.error("give --executor, or --num-blocks, --block-size and --model-id")
    service = Service("kvcache_svc", args.host, args.port)
    kvcache_pb2_grpc.add_KVCacheServicer_to_server(KVCacheServicer(KVCacheManager(
        num_blocks, block_size, enable_prefix_caching=not args.no_prefix_caching, model_id=model_id,
        tier=tier, write_through=args.offload_all, block_bytes=block_bytes,
    )), service.server)
    logger.info("block pool: %d blocks of %d tokens", num_blocks, block_size)
    service.serve_until_signalled()


if __name__ == "__main__":
    main()
