"""python -m scheduler_svc --port 50052 --kvcache 127.0.0.1:50053 [--executor 127.0.0.1:50054]

With --executor it drives that one executor; without, every executor registered with the KV-cache service
(at least one must register before it starts serving), each step split into one part per executor.
"""
from __future__ import annotations

import time

from pagedserve.config import SchedulerConfig, ServingConfig, parse
from pagedserve.service import Security, Service, channel, configure_logging, pin_to_cpus, set_nice
from pagedserve.v1 import (
    executor_pb2,
    executor_pb2_grpc,
    kvcache_pb2,
    kvcache_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from scheduler_svc.build import build_scheduler
from scheduler_svc.server import RemoteBackends, SchedulerServicer

SECTIONS = {
    ServingConfig: ("host", "port", "log_level", "cpus", "nice", "kvcache", "executor", "startup_timeout", "tls_cert",
                    "tls_key", "tls_ca", "internal_token_file", "drain_timeout_s"),
    SchedulerConfig: None,
}


def parse_args(argv: list[str] | None = None) -> dict:
    return parse("python -m scheduler_svc", __doc__, SECTIONS, argv, required=("kvcache",))


def first_registered_executor(kvcache, timeout: float) -> str:
    """The address of an executor registered with the KV-cache service, waiting up to timeout for one."""
    deadline = time.monotonic() + timeout
    while True:
        registered = kvcache.ListExecutors(kvcache_pb2.ListExecutorsRequest(), wait_for_ready=True, timeout=timeout)
        if registered.executors:
            return registered.executors[0].address
        if time.monotonic() > deadline:
            raise SystemExit(f"scheduler_svc: no executor registered with the KV-cache service within {timeout:g} s")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    configs = parse_args(argv)
    serving = configs[ServingConfig]
    configure_logging(serving.log_level)
    pin_to_cpus(serving.cpus)
    set_nice(serving.nice)
    security = Security.from_config(serving)
    kvcache_channel = channel(serving.kvcache, security)
    kvcache = kvcache_pb2_grpc.KVCacheStub(kvcache_channel)
    wait = dict(wait_for_ready=True, timeout=serving.startup_timeout)
    # The pool must be up before the first step; its size is the block manager's business alone.
    kvcache.GetStats(kvcache_pb2.KVCacheStatsRequest(), **wait)
    # The model's facts (every executor serves the same: the KV-cache service refuses another).
    info_address = serving.executor or first_registered_executor(kvcache, serving.startup_timeout)
    executor_channel = channel(info_address, security)
    executor = executor_pb2_grpc.ExecutorStub(executor_channel)
    info = executor.GetInfo(executor_pb2.ExecutorInfoRequest(), **wait)
    if serving.executor:
        backends = RemoteBackends(kvcache, executor)
    else:
        backends = RemoteBackends(kvcache, open_executor=lambda address: executor_pb2_grpc.ExecutorStub(
            channel(address, security)))
    scheduler = build_scheduler(configs[SchedulerConfig], info, backends.allocate_blocks,
                                one_executor=bool(serving.executor))
    servicer = SchedulerServicer(
        scheduler, backends, tuple(info.eos_token_ids),
        scheduler_pb2.SchedulerInfo(model=info.model, model_dir=info.model_dir,
                                    max_model_len=info.max_model_len, vocab_size=info.vocab_size),
    )
    service = Service("scheduler_svc", serving.host, serving.listen_port("scheduler_svc"), max_workers=64,
                      security=security,
                      dependencies={"kvcache_svc": serving.kvcache,
                                    **({"executor_svc": serving.executor} if serving.executor else {})})
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, service.server)
    servicer.loop.start()
    service.serve_until_signalled(on_stop=servicer.loop.stop, drainable=servicer,
                                  drain_timeout=serving.drain_timeout_s)
    executor_channel.close()
    kvcache_channel.close()


if __name__ == "__main__":
    main()
