"""The ``pagedserve`` command: ``up`` starts the four services, ``generate`` streams from them."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

DEFAULT_ADDRESS = "127.0.0.1:50051"


def _up(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.launcher import Stack, StackConfig

    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    # bfloat16 runs the CUDA kernels on tensor cores; float32 keeps CPU outputs equal to the reference.
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    host, port = args.address.rsplit(":", 1)
    config = StackConfig(
        model=args.model, device=device, dtype=dtype, host=host, port=int(port),
        kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        offload=args.offload, redis_url=args.redis_url, offload_all=args.offload_all, log_level=args.log_level,
    )
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    print(f"starting pagedserve ({args.model} on {device}, {dtype}) ...", flush=True)
    with Stack(config) as stack:
        print(f"pagedserve is serving the Generate API on {stack.address} (Ctrl-C stops it)", flush=True)
        print(f'try: pagedserve generate --chat --temperature 0 "What is the capital of France?"', flush=True)
        stopping.wait()
        print("stopping ...", flush=True)
    return 0


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from pagedserve.client import GenerateClient, build_request
    from pagedserve.convert import FINISH_REASON_NAMES

    request = build_request(
        messages=[{"role": "user", "content": args.prompt}] if args.chat else None,
        prompt=None if args.chat else args.prompt,
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop or None, ignore_eos=args.ignore_eos or None,
    )
    token_ids, finish = [], None
    with GenerateClient(args.address) as client:
        try:
            for response in client.stream(request):
                token_ids.extend(response.token_ids)
                if not args.json:
                    print(response.text, end="", flush=True)
                if response.finish_reason:
                    finish = FINISH_REASON_NAMES[response.finish_reason]
        except grpc.RpcError as error:
            print(f"\npagedserve: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"token_ids": token_ids, "finish_reason": finish}))
    else:
        print()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start frontend, scheduler, KV-cache and executor services")
    up.add_argument("--model", default="default", help="'default', a Hugging Face directory or a .gguf file")
    up.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda")
    up.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto: bfloat16 on CUDA, float32 on the CPU")
    up.add_argument("--address", default=DEFAULT_ADDRESS, help="host:port of the public API")
    up.add_argument("--kv-cache-memory", type=int, help="bytes for the KV cache")
    up.add_argument("--max-model-len", type=int)
    up.add_argument("--max-num-seqs", type=int, default=256)
    up.add_argument("--max-num-batched-tokens", type=int, default=2048)
    up.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cupy"],
                    help="auto: the CuPy CUDA kernels on a CUDA device where they can run, else torch")
    up.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    up.add_argument("--offload", choices=["host", "redis", "none"],
                    help="where evicted prefix blocks go (default: host memory, or Redis with --redis-url)")
    up.add_argument("--redis-url", help="redis://host:port/db for the KV offload tier")
    up.add_argument("--offload-all", action="store_true", help="copy every block to the tier as it fills")
    up.add_argument("--log-level", default="WARNING")
    up.set_defaults(handler=_up)

    generate = commands.add_parser("generate", help="stream a completion from a running server")
    generate.add_argument("prompt")
    generate.add_argument("--address", default=DEFAULT_ADDRESS)
    generate.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float)
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", help="a stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--json", action="store_true", help="print token ids and the finish reason as JSON")
    generate.set_defaults(handler=_generate)

    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
