"""python -m executor_svc --port 50054 --model default --device cpu --dtype float32 [--kvcache 127.0.0.1:50053]

With --kvcache, the executor registers with the KV-cache service (under --advertise-address, by default the
address it listens on) and renews the registration by heartbeat; refused (another model or block size than
the executors registered there), it exits with the reason.
"""
from __future__ import annotations

import os
import signal
import socket

from pagedserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServingConfig, parse
from pagedserve.service import Security, Service, channel, configure_logging, pin_to_cpus, set_nice
from pagedserve.v1 import executor_pb2_grpc, kvcache_pb2_grpc

# What this service takes: the launcher passes these, and only these, as flags.
SECTIONS = {
    ServingConfig: ("host", "port", "log_level", "cpus", "nice", "tls_cert", "tls_key", "tls_ca", "internal_token_file",
                    "kvcache", "advertise_address"),
    ModelConfig: ("model", "device", "dtype", "max_model_len", "seed", "attention_backend", "cpu_threads",
                  "enforce_eager", "cuda_graph_batch_sizes", "benchmark_sleep_ms"),
    CacheConfig: ("block_size", "kv_cache_dtype", "kv_cache_memory", "kv_cache_fraction", "offload", "offload_host_bytes",
                  "redis_url", "redis_ttl", "redis_namespace", "swap_host_bytes"),
    SchedulerConfig: ("max_num_seqs",),
}


def parse_args(argv: list[str] | None = None) -> dict:
    return parse("python -m executor_svc", __doc__, SECTIONS, argv)


def main(argv: list[str] | None = None) -> None:
    configs = parse_args(argv)
    serving = configs[ServingConfig]
    configure_logging(serving.log_level)
    pin_to_cpus(serving.cpus)
    set_nice(serving.nice)
    # Imported here, not above: the launcher reads SECTIONS without loading torch.
    from executor_svc.build import build_model_runner
    from executor_svc.server import ExecutorServicer, KVCacheRegistration, executor_info

    runner = build_model_runner(configs[ModelConfig], configs[CacheConfig], configs[SchedulerConfig])
    security = Security.from_config(serving)
    service = Service("executor_svc", serving.host, serving.listen_port("executor_svc"), max_workers=4,
                      security=security)
    servicer = ExecutorServicer(runner)
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, service.server)
    registration = None
    if serving.kvcache:
        registration = KVCacheRegistration(
            kvcache_pb2_grpc.KVCacheStub(channel(serving.kvcache, security)),
            serving.advertise_address or advertised(service.address), lambda: executor_info(runner),
            on_refused=lambda: os.kill(os.getpid(), signal.SIGTERM))
        registration.start()
    service.serve_until_signalled(main_loop=servicer.worker.run,
                                  on_stop=registration.stop if registration is not None else None)
    if registration is not None and registration.refused:
        raise SystemExit(f"executor_svc: the KV-cache service at {serving.kvcache} refused it: {registration.refused}")


def advertised(listen_address: str) -> str:
    """Where the others reach an executor listening on every interface: its host name (a container's, which
    the compose network resolves) at its port."""
    host, port = listen_address.rsplit(":", 1)
    return f"{socket.gethostname()}:{port}" if host in ("0.0.0.0", "[::]") else listen_address


if __name__ == "__main__":
    main()
