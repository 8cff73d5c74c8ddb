"""python -m scheduler_svc --port 50052 --kvcache 127.0.0.1:50053 --executor 127.0.0.1:50054"""
from __future__ import annotations

import argparse

from pagedserve.service import Service, add_service_arguments, channel, configure_logging
from pagedserve.v1 import (
    executor_pb2,
    executor_pb2_grpc,
    kvcache_pb2,
    kvcache_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.server import RemoteBackends, SchedulerServicer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scheduler_svc", description=__doc__)
    add_service_arguments(parser, default_port=50052)
    parser.add_argument("--kvcache", required=True, help="KV-cache service address")
    parser.add_argument("--executor", required=True, help="executor address")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-chunked-prefill", action="store_true")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)

    executor_channel, kvcache_channel = channel(args.executor), channel(args.kvcache)
    executor = executor_pb2_grpc.ExecutorStub(executor_channel)
    kvcache = kvcache_pb2_grpc.KVCacheStub(kvcache_channel)
    info = executor.GetInfo(executor_pb2.ExecutorInfoRequest(), wait_for_ready=True, timeout=args.startup_timeout)
    # The pool must be up before the first step; its size is the block manager's business alone.
    kvcache.GetStats(kvcache_pb2.KVCacheStatsRequest(), wait_for_ready=True, timeout=args.startup_timeout)
    chunked = not args.no_chunked_prefill
    config = SchedulerConfig(
        block_size=info.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens if chunked else max(args.max_num_batched_tokens, info.max_model_len),
        max_model_len=info.max_model_len, enable_chunked_prefill=chunked,
    )
    backends = RemoteBackends(kvcache, executor)
    scheduler = Scheduler(config, backends.allocate_blocks)
    servicer = SchedulerServicer(
        scheduler, backends, tuple(info.eos_token_ids),
        scheduler_pb2.SchedulerInfo(model=info.model, model_dir=info.model_dir,
                                    max_model_len=info.max_model_len, vocab_size=info.vocab_size),
    )
    service = Service("scheduler_svc", args.host, args.port, max_workers=64)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, service.server)
    servicer.loop.start()
    service.serve_until_signalled(on_stop=servicer.loop.stop)
    executor_channel.close()
    kvcache_channel.close()


if __name__ == "__main__":
    main()
