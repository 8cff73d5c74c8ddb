"""The ``pagedserve`` command: ``up`` starts the four services (or a compose file's), ``generate`` streams
from them, ``chat`` holds a conversation with them."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading

from pagedserve.config import (
    SERVICE_PORTS,
    CacheConfig,
    ModelConfig,
    PagedServeConfig,
    SchedulerConfig,
    ServingConfig,
    add_arguments,
    dtype_reason,
    from_args,
)

DEFAULT_ADDRESS = f"{ServingConfig().host}:{SERVICE_PORTS['frontend']}"
UP_SECTIONS = {
    ModelConfig: None, CacheConfig: None, SchedulerConfig: None,
    ServingConfig: ("host", "port", "log_level", "startup_timeout", "max_streams", "restart_backoff", "max_restarts",
                    "max_message_bytes", "max_prompt_chars", "tls_cert", "tls_key", "tls_ca", "tls_client_ca",
                    "api_key_file", "internal_token_file", "http_address", "served_model_name", "drain_timeout_s",
                    "enable_auto_tool_choice", "tool_call_parser", "reasoning_parser", "responses_store_size",
                    "frontends", "executors", "cpus", "control_plane_cpus", "nice", "frontend_nice"),
}
# What still applies with --compose (the launcher's own behaviour): the file gives everything else.
COMPOSE_OPTIONS = ("restart_backoff", "max_restarts", "startup_timeout")


def _scale(text: str) -> tuple[str, int]:
    service, _, count = text.partition("=")
    if not service or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"expected SERVICE=N with N at least 1, got {text!r}")
    return service, int(count)


def _compose_stack(args: argparse.Namespace, configs: dict):
    from pagedserve.entrypoints.compose import ComposeStack
    from pagedserve.entrypoints.supervisor import RestartPolicy

    serving = configs[ServingConfig]
    given = [name for cls, config in configs.items() for name, value in vars(config).items()
             if name not in COMPOSE_OPTIONS and value != getattr(cls(), name)]
    if given:
        args.parser.error(f"--compose takes the services' configuration from the file; these flags would be "
                          f"ignored: {', '.join('--' + n.replace('_', '-') for n in given)}")
    return ComposeStack(args.compose, dict(args.scale or ()), tuple(args.profile or ()),
                        policy=RestartPolicy(serving.restart_backoff, serving.max_restarts),
                        startup_timeout=serving.startup_timeout)


def _up(args: argparse.Namespace) -> int:
    from pagedserve.entrypoints.launcher import Stack
    from pagedserve.service import stop_on_signals

    configs = from_args(args.parser, args, UP_SECTIONS)
    if (args.scale or args.profile) and not args.compose:
        args.parser.error("--scale and --profile need --compose (without it: --frontends, --executors)")
    try:
        if args.compose:
            stack = _compose_stack(args, configs)
            print(f"starting the services of {args.compose} ...", flush=True)
        else:
            requested_dtype = configs[ModelConfig].dtype
            model = configs[ModelConfig].resolved()
            config = PagedServeConfig(model, configs[CacheConfig], configs[SchedulerConfig], configs[ServingConfig])
            stack = Stack(config)
            # The executor is given the resolved dtype; why `auto` chose it is said here.
            why = f", {dtype_reason(requested_dtype, model.device)}" if requested_dtype == "auto" else ""
            print(f"starting pagedserve ({model.model} on {model.device}, {model.dtype}{why}) ...", flush=True)
    except (ValueError, OSError) as error:
        args.parser.error(str(error))
    stopping = threading.Event()
    stop_on_signals(stopping)
    # What the supervisor does (a service died, restarted, given up on) is news for whoever runs this.
    supervisor_log = logging.getLogger("pagedserve.entrypoints.supervisor")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("pagedserve: %(message)s"))
    supervisor_log.addHandler(handler)
    supervisor_log.setLevel(logging.INFO)
    supervisor_log.propagate = False
    with stack:
        print("every process, and where it listens:", *stack.listing(), sep="\n  ", flush=True)
        if not args.compose:
            print(f"pagedserve is serving the Generate API on {stack.address} (Ctrl-C stops it)", flush=True)
            address = "" if stack.address == DEFAULT_ADDRESS else f" --address {stack.address}"
            print(f'try: pagedserve generate{address} --chat --temperature 0 "What is the capital of France?"',
                  flush=True)
            if stack.http_url:
                print(f"and the OpenAI-compatible HTTP API on {stack.http_url}/v1", flush=True)
        else:
            print("pagedserve is serving (Ctrl-C stops it)", flush=True)
        while not stopping.wait(0.5):
            if stack.supervisor.gave_up.is_set():
                print("stopping every service ...", flush=True)
                return 1
        print("stopping ...", flush=True)
    return 0


def _client(args: argparse.Namespace):
    from pagedserve.client import GenerateClient
    from pagedserve.service import API_KEY_ENV

    api_key = open(args.api_key_file).read().strip() if args.api_key_file else os.environ.get(API_KEY_ENV)
    return GenerateClient(args.address, api_key=api_key, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                          tls_key=args.tls_key)


def _sampling(args: argparse.Namespace) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=args.seed, stop=args.stop or None)


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from pagedserve.client import build_request
    from pagedserve.convert import FINISH_REASON_NAMES

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    request = build_request(
        messages=[{"role": "user", "content": prompt}] if args.chat else None,
        prompt=None if args.chat else prompt, ignore_eos=args.ignore_eos or None, **_sampling(args))
    token_ids, finish = [], None
    with _client(args) as client:
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


def _chat(args: argparse.Namespace) -> int:
    """A conversation: each line read is the user's turn, the answer streams back and joins the conversation."""
    import grpc

    from pagedserve.client import build_request

    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    with _client(args) as client:
        while True:
            if interactive:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            answer = ""
            try:
                for response in client.stream(build_request(messages=messages, **_sampling(args))):
                    print(response.text, end="", flush=True)
                    answer += response.text
            except grpc.RpcError as error:
                print(f"\npagedserve: {error.code().name}: {error.details()}", file=sys.stderr)
                return 1
            print()
            messages.append({"role": "assistant", "content": answer})


def _add_client_arguments(command: argparse.ArgumentParser) -> None:
    """Where the server is, how to reach it, and the sampling of its answers."""
    command.add_argument("--address", default=DEFAULT_ADDRESS)
    command.add_argument("--max-tokens", type=int, default=128,
                         help="default 128: more than the API's 16 (vLLM's), so that an answer is not cut short")
    command.add_argument("--temperature", type=float)
    command.add_argument("--top-p", type=float)
    command.add_argument("--top-k", type=int)
    command.add_argument("--seed", type=int)
    command.add_argument("--stop", action="append", help="a stop string (repeatable)")
    command.add_argument("--api-key-file", help="file holding the API key (default: $PAGEDSERVE_API_KEY)")
    command.add_argument("--tls-ca", help="CA file: connect with TLS and verify the server with it")
    command.add_argument("--tls-cert", help="client certificate file, for mutual TLS")
    command.add_argument("--tls-key", help="key file of --tls-cert")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start frontend, scheduler, KV-cache and executor services")
    add_arguments(up, UP_SECTIONS)
    compose = up.add_argument_group("compose", "run the services of a compose file as local processes instead")
    compose.add_argument("--compose", metavar="FILE", help="a compose file (docker-compose.yml)")
    compose.add_argument("--scale", metavar="SERVICE=N", type=_scale, action="append",
                         help="replicas of a compose service (repeatable)")
    compose.add_argument("--profile", action="append",
                         help="a compose profile to enable, e.g. cpu (repeatable; default: $COMPOSE_PROFILES)")
    up.set_defaults(handler=_up, parser=up)

    generate = commands.add_parser("generate", help="stream a completion from a running server")
    generate.add_argument("prompt", help="the prompt, or - to read it from standard input")
    generate.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--json", action="store_true", help="print token ids and the finish reason as JSON")
    _add_client_arguments(generate)
    generate.set_defaults(handler=_generate)

    chat = commands.add_parser("chat", help="a conversation with a running server: each line is a turn")
    chat.add_argument("--system", help="a system message to open the conversation")
    _add_client_arguments(chat)
    chat.set_defaults(handler=_chat)

    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
