"""python -m executor_svc --port 50054 --model default --device cpu --dtype float32"""
from __future__ import annotations

import argparse

from executor_svc.model_runner import ModelRunner
from executor_svc.offload import make_tier
from executor_svc.server import ExecutorServicer
from pagedserve.service import Service, add_service_arguments, configure_logging
from pagedserve.v1 import executor_pb2_grpc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m executor_svc", description=__doc__)
    add_service_arguments(parser, default_port=50054)
    parser.add_argument("--model", default="default", help="'default', a Hugging Face directory or a .gguf file")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=int, help="bytes for the KV cache")
    parser.add_argument("--kv-cache-fraction", type=float, default=0.3, help="of available memory, without --kv-cache-memory")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cupy"],
                        help="auto: the CuPy CUDA kernels on a CUDA device where they can run, else torch")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="largest decode batch to capture a CUDA graph for")
    parser.add_argument("--cuda-graph-batch-sizes", type=int, nargs="+",
                        help="decode batch sizes to capture (default: 1, 2, 4, ... 256 up to --max-num-seqs)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: every step runs eagerly")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--offload", choices=["host", "redis", "none"],
                        help="where evicted prefix blocks go: host memory (default), or Redis when --redis-url is given")
    parser.add_argument("--offload-host-bytes", type=int, default=1 << 30)
    parser.add_argument("--redis-url", help="redis://host:port/db for the offload tier")
    parser.add_argument("--redis-ttl", type=int, help="seconds an offloaded block lives in Redis")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    import torch

    torch.manual_seed(args.seed)
    offload = args.offload or ("redis" if args.redis_url else "host")
    tier = make_tier(offload, host_bytes=args.offload_host_bytes, redis_url=args.redis_url, redis_ttl=args.redis_ttl)
    runner = ModelRunner(
        args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, kv_cache_fraction=args.kv_cache_fraction,
        max_model_len=args.max_model_len, offload_tier=tier, attention_backend=args.attention_backend,
        max_num_seqs=args.max_num_seqs, cuda_graph_batch_sizes=args.cuda_graph_batch_sizes,
        enforce_eager=args.enforce_eager,
    )
    service = Service("executor_svc", args.host, args.port, max_workers=4)
    servicer = ExecutorServicer(runner, args.model)
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, service.server)
    service.serve_until_signalled(main_loop=servicer.worker.run)


if __name__ == "__main__":
    main()
