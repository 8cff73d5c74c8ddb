"""The ``pagedserve`` command."""
from __future__ import annotations

import argparse
import json
import logging
import sys


def _generate(args: argparse.Namespace) -> int:
    from pagedserve import LLM, SamplingParams

    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            seed=args.seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
        )
    except ValueError as error:
        print(f"pagedserve: {error}", file=sys.stderr)
        return 2
    llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory)
    if args.chat:
        [result] = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        [result] = llm.generate(args.prompt, params)
    if args.json:
        print(json.dumps({
            "token_ids": result.token_ids, "text": result.text, "finish_reason": result.finish_reason,
        }))
    else:
        print(result.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text for one prompt in this process")
    generate.add_argument("prompt")
    generate.add_argument("--model", default="default", help="'default', a Hugging Face directory or a .gguf file")
    generate.add_argument("--device", default="cpu")
    generate.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    generate.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=1.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--min-p", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--json", action="store_true", help="print token ids, text and finish reason as JSON")
    generate.set_defaults(handler=_generate)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
