"""python -m kvcache_svc --port 50053 --executor 127.0.0.1:50054

The pool is sized from the executor (its KV tensors hold num_blocks blocks of block_size tokens), or
from --num-blocks and --block-size.
"""
from __future__ import annotations

import argparse
import logging

from kvcache_svc.kv_cache_manager import KVCacheManager
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
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    if args.executor:
        with channel(args.executor) as ch:
            info = executor_pb2_grpc.ExecutorStub(ch).GetInfo(
                executor_pb2.ExecutorInfoRequest(), wait_for_ready=True, timeout=args.startup_timeout
            )
        num_blocks, block_size = info.num_blocks, info.block_size
    elif args.num_blocks and args.block_size:
        num_blocks, block_size = args.num_blocks, args.block_size
    else:
        parser.error("give --executor, or both --num-blocks and --block-size")
    service = Service("kvcache_svc", args.host, args.port)
    kvcache_pb2_grpc.add_KVCacheServicer_to_server(KVCacheServicer(KVCacheManager(num_blocks, block_size)), service.server)
    logger.info("block pool: %d blocks of %d tokens", num_blocks, block_size)
    service.serve_until_signalled()


if __name__ == "__main__":
    main()
