"""python -m executor_svc --port 50054 --model default --device cpu --dtype float32"""
from __future__ import annotations

import argparse

from executor_svc.model_runner import ModelRunner
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
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    import torch

    torch.manual_seed(args.seed)
    runner = ModelRunner(
        args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, kv_cache_fraction=args.kv_cache_fraction,
        max_model_len=args.max_model_len,
    )
    service = Service("executor_svc", args.host, args.port, max_workers=4)
    executor_pb2_grpc.add_ExecutorServicer_to_server(ExecutorServicer(runner, args.model), service.server)
    service.serve_until_signalled()


if __name__ == "__main__":
    main()
