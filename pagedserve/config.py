"""The configuration: every default, bound and help text lives here, and nowhere else.

The offline ``LLM``, ``pagedserve up`` and each service's command line are built from these dataclasses
(flags by ``add_arguments``, back to dataclasses by ``from_args``), so that a flag cannot drift from its
field. ``python -m pagedserve.config docs/configuration.md`` renders the reference tables of that doc.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from pagedserve.chat import load_chat_template
from pagedserve.sampling_params import generation_config_defaults

# The KV cache a CPU executor takes without kv_cache_memory at most (vLLM's CPU build default).
CPU_KV_CACHE_CAP = 4 << 30
# The default prompt limit in characters per token of the context: generous for any tokenizer's longest
# tokens, and still refuses a prompt of megabytes before it costs seconds of tokenizing.
PROMPT_CHARS_PER_TOKEN = 16
# The default model (ModelConfig.model "default"): its name, as the HTTP API lists it.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Where each service listens unless told (--port); pagedserve up's public API is the frontend's.
SERVICE_PORTS = {"frontend": 50051, "scheduler_svc": 50052, "kvcache_svc": 50053, "executor_svc": 50054}
# `pagedserve up` restarts a service that dies: the backoff between restarts stops growing here, and a run
# this long counts as healthy (the next failure starts the backoff and the count of rapid failures afresh).
RESTART_BACKOFF_CAP_S = 30.0
RESTART_STABLE_S = 60.0

# The environment variables the services read. Secrets travel here rather than on a command line, which
# `ps` shows to every local user.
INTERNAL_TOKEN_ENV = "PAGEDSERVE_INTERNAL_TOKEN"
API_KEY_ENV = "PAGEDSERVE_API_KEY"
CACHE_DIR_ENV = "PAGEDSERVE_CACHE"
PARENT_PID_ENV = "PAGEDSERVE_PARENT_PID"
# {variable: (the services that read it, what it holds)}: the docs render it, and the deployment tests check
# that compose and Kubernetes give a service no variable it does not read.
ENVIRONMENT = {
    INTERNAL_TOKEN_ENV: (tuple(SERVICE_PORTS), "the shared secret every internal RPC carries (unless "
                                               "`internal_token_file` is given)"),
    API_KEY_ENV: (("frontend",), "an API key the public APIs accept, besides those of `api_key_file` "
                                 "(`pagedserve generate` sends it)"),
    CACHE_DIR_ENV: (("executor_svc",), "where models are converted and kept (default: `$XDG_CACHE_HOME/pagedserve`, "
                                       "else `~/.cache/pagedserve`); the frontend reads the tokenizer from there"),
    PARENT_PID_ENV: (tuple(SERVICE_PORTS), "set by `pagedserve up`: the launcher's pid; a service whose launcher "
                                           "is gone shuts down"),
}


def option(default, help: str, *, choices=None, min=None, max=None, flag: bool = True):
    """A configuration field: its default, bounds (inclusive) or choices, and help. flag=False: a fact that
    the service learns from another one at start-up, not an option."""
    metadata = {"help": help, "choices": choices, "min": min, "max": max, "flag": flag}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for a sequence default")
    return dataclasses.field(default=default, metadata=metadata)


def _kind(hint) -> tuple[type, bool, bool]:
    """(base type, None allowed, a tuple of base) of a field's annotation."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], optional, True
    return hint, optional, False


def _type_ok(value, base: type) -> bool:
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, base)


class _Config:
    """Checks every field against its annotation and metadata; an error message starts with the field name."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            base, optional, is_tuple = _kind(hints[f.name])
            if value is None:
                if optional:
                    continue
                raise ValueError(f"{f.name} must be given, got None")
            items = value
            if is_tuple:
                if not isinstance(value, (list, tuple)) or not value:
                    raise ValueError(f"{f.name} must be a non-empty sequence of {base.__name__}, got {value!r}")
                object.__setattr__(self, f.name, tuple(value))
            else:
                items = (value,)
            for item in items:
                self._check_one(f, base, value, item)

    @staticmethod
    def _check_one(f: dataclasses.Field, base: type, value, item) -> None:
        meta = f.metadata
        if not _type_ok(item, base):
            raise ValueError(f"{f.name} must be {base.__name__}, got {value!r}")
        if meta["choices"] is not None and item not in meta["choices"]:
            raise ValueError(f"{f.name} must be one of {', '.join(meta['choices'])}, got {value!r}")
        if meta["min"] is not None and item < meta["min"]:
            raise ValueError(f"{f.name} must be at least {meta['min']}, got {value!r}")
        if meta["max"] is not None and item > meta["max"]:
            raise ValueError(f"{f.name} must be at most {meta['max']}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig(_Config):
    """What runs: the checkpoint, its numbers and how the executor runs it."""

    model: str = option("default", f"`default` ({DEFAULT_MODEL_NAME}), a Hugging Face directory or a `.gguf` file")
    tokenizer: str | None = option(None, "tokenizer directory (default: the model's)")
    chat_template: str | None = option(None, "the chat template of the chat APIs and `LLM.chat`: a Jinja template, or "
                                             "a file holding one (default: the tokenizer's; a model whose tokenizer "
                                             "has none needs one for chat)")
    generation_config: str = option(
        "auto", "default sampling parameters of the requests that leave them unset: `auto`, those of the model's "
                "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens "
                "as a cap on max_tokens), as vLLM takes them; `vllm`, vLLM's neutral ones; or a directory whose "
                "generation_config.json sets them")
    device: str = option("auto", "`auto` (CUDA when available, else the CPU), `cpu`, `cuda` or `cuda:N`")
    dtype: str = option("auto", "weights and KV cache; `auto`: bfloat16 on CUDA, and on a CPU with native "
                                "bfloat16 matrix instructions (AMX or AVX512-BF16) that runs a bfloat16 linear "
                                "layer measured at start-up at least 1.3x as fast as float32; else float32",
                        choices=("auto", "float32", "bfloat16", "float16"))
    max_model_len: int | None = option(None, "context length (default: the model's; capped at what the KV "
                                             "cache holds)", min=1)
    seed: int = option(0, "seeds torch at start-up (a request's own seed is a sampling parameter)", min=0)
    attention_backend: str = option("auto", "`auto`: the CuPy CUDA kernels on a CUDA device where they can "
                                            "run, the C++ kernels (`cpu`) on the CPU where they build, else "
                                            "torch", choices=("auto", "torch", "cupy", "cpu"))
    cpu_threads: int | None = option(None, "torch threads on the CPU (default: every core this process may use)",
                                     min=1)
    enforce_eager: bool = option(False, "no CUDA graphs: every decode step runs eagerly")
    benchmark_sleep_ms: float | None = option(
        None, "benchmarking the control plane: the executor loads no weights, each step takes this long on a stand-in "
              "device (steps queue back to back, as on a GPU) and returns deterministic tokens", min=0.001)
    cuda_graph_batch_sizes: tuple[int, ...] | None = option(
        None, "decode batch sizes to capture a CUDA graph for (default: 1, 2, 4, ... 256 up to max_num_seqs)",
        min=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chat_template is not None:
            load_chat_template(self.chat_template)  # a file that is not there, or no template: refused at once
        if self.generation_config not in ("auto", "vllm"):
            if not (Path(self.generation_config) / "generation_config.json").is_file():
                raise ValueError(f"generation_config must be auto, vllm or a directory holding a "
                                 f"generation_config.json, got {self.generation_config!r}")
            generation_config_defaults(self.generation_config, None)  # a bad file: refused at once

    def resolved_device(self) -> str:
        """The device, `auto` made concrete for this machine."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved(self) -> "ModelConfig":
        """This config with `auto` device and dtype made concrete for this machine."""
        device = self.resolved_device()
        dtype = self.dtype
        if dtype == "auto":
            # bfloat16 runs the CUDA kernels on tensor cores, and the CPU's linear layers up to 4x faster where
            # it has bfloat16 matrix instructions; elsewhere on the CPU it is slower than float32.
            native = device.startswith("cuda") or cpu_bf16_choice()[0]
            dtype = "bfloat16" if native else "float32"
        return dataclasses.replace(self, device=device, dtype=dtype)


def model_name(model: str) -> str:
    """A model's own name (ModelConfig.model): the default model's, or its directory's or GGUF file's."""
    if model == ModelConfig.model:
        return DEFAULT_MODEL_NAME
    return Path(model).expanduser().resolve().name.removesuffix(".gguf")


# CPU flags (as /proc/cpuinfo names them) of native bfloat16 matrix arithmetic: AMX tiles, AVX512 dot products.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


# The flags are not enough: some CPUs report AVX512-BF16 and still run bfloat16 products slower than float32
# (one measured here: the model's linear layers 1.6x slower). So `auto` takes bfloat16 on the CPU only where,
# besides the flags, a linear layer measured at start-up runs at least this much faster in bfloat16.
BF16_MIN_SPEEDUP = 1.3


# (rows, in, out) of the linear layers timed: a small model's MLP projections both ways, and a wider square one.
BF16_PROBE_SHAPES = ((256, 576, 1536), (256, 1536, 576), (256, 2048, 2048))


@functools.cache
def cpu_bf16_speedup() -> float:
    """float32 time over bfloat16 time of the linear layers of BF16_PROBE_SHAPES (F.linear, as the model runs
    them) on this CPU: each layer's best of 7 runs, summed; the two dtypes interleaved so that other load
    falls on both alike. About half a second, once per process."""
    import time

    import torch
    import torch.nn.functional as F

    layers = {dtype: [(torch.randn(rows, fan_in, dtype=dtype), torch.randn(fan_out, fan_in, dtype=dtype))
                      for rows, fan_in, fan_out in BF16_PROBE_SHAPES]
              for dtype in (torch.float32, torch.bfloat16)}
    best = {dtype: [float("inf")] * len(BF16_PROBE_SHAPES) for dtype in layers}
    for run in range(8):
        for dtype, pairs in layers.items():
            for k, (x, weight) in enumerate(pairs):
                start = time.perf_counter()
                F.linear(x, weight)
                if run:  # the first is a warm-up: first-call dispatch and packing
                    best[dtype][k] = min(best[dtype][k], time.perf_counter() - start)
    return sum(best[torch.float32]) / sum(best[torch.bfloat16])


def cpu_bf16_choice() -> tuple[bool, str]:
    """Whether `auto` takes bfloat16 on this CPU, and why (logged by the executor)."""
    flags = cpu_bf16_flags()
    if not flags:
        return False, "the CPU has no native bfloat16 matrix support"
    speedup = cpu_bf16_speedup()
    verdict = "at least" if speedup >= BF16_MIN_SPEEDUP else "under"
    return speedup >= BF16_MIN_SPEEDUP, (f"the CPU has {', '.join(flags)} and runs bfloat16 linear layers "
                                         f"{speedup:.2f}x as fast as float32, {verdict} {BF16_MIN_SPEEDUP}x")


def dtype_reason(requested: str, device: str) -> str:
    """Why a model config of dtype `requested` runs in the dtype resolved() gives it on `device`."""
    if requested != "auto":
        return "requested"
    if device.startswith("cuda"):
        return "auto: CUDA"
    return f"auto: {cpu_bf16_choice()[1]}"


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """Which of CPU_BF16_FLAGS this CPU reports; none where the flags cannot be read (never assumed)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return tuple(flag for flag in CPU_BF16_FLAGS if flag in flags)
    except OSError:
        pass
    return ()


@dataclass(frozen=True)
class CacheConfig(_Config):
    """The paged KV cache: its blocks, its size, prefix caching, the offload tier and preemption."""

    block_size: int = option(16, "tokens per KV block", min=1, max=1024)
    kv_cache_dtype: str = option(
        "auto", "dtype of the K/V tensors: `auto`, the model's. `bfloat16` halves a float32 model's KV memory and "
                "the bytes decode attention reads; attention then runs in bfloat16, so outputs are close to "
                "float32's, not equal to them", choices=("auto", "bfloat16", "float32"))
    kv_cache_memory: int | None = option(
        None, "bytes for the KV cache (default: on CUDA `kv_cache_fraction` of free device memory after the "
              "weights load; on the CPU what `max_num_seqs` requests of `max_model_len` tokens take, at most "
              f"{CPU_KV_CACHE_CAP >> 30} GiB and at most `kv_cache_fraction` of the host's memory)", min=1)
    kv_cache_fraction: float = option(0.3, "without `kv_cache_memory`: the share of free device memory (CUDA) "
                                           "or the cap as a share of total host memory (CPU)", min=0.01, max=1.0)
    enable_prefix_caching: bool = option(True, "reuse the KV of full blocks already computed for the same prefix")
    offload: str | None = option(None, "where evicted prefix blocks go (default: `host`, or `redis` with "
                                       "`redis_url`)", choices=("host", "redis", "none"))
    offload_host_bytes: int = option(1 << 30, "bytes of host memory for the `host` offload tier", min=1)
    redis_url: str | None = option(None, "`redis://[user:password@]host:port/db` for the offload tier (an ACL "
                                         "user and password go in the URL; `rediss://` for TLS)")
    redis_namespace: str = option("pagedserve", "prefix of every Redis key: one per deployment sharing a Redis")
    redis_ttl: int | None = option(None, "seconds an offloaded block lives in Redis (default: until evicted)",
                                   min=1)
    offload_all: bool = option(False, "copy every block to the offload tier as it fills, not only on eviction")
    preemption_mode: str = option(
        "auto", "when the pool runs short, the preempted request's K/V is `recompute`d when it resumes, or its "
                "blocks are copied to host memory and loaded back (`swap`); `auto`: whichever the executor's "
                "measured prefill and copy speeds make cheaper, per request. Without room in `swap_host_bytes`, "
                "recompute", choices=("recompute", "swap", "auto"))
    swap_host_bytes: int = option(1 << 30, "bytes of host memory for the blocks of requests preempted by swap",
                                  min=1)
    routing: str = option("kv", "with several executors, where kvcache_svc admits a new request: `kv`, the executor "
                                "whose pool (then offload tier) holds the longest cached prefix of it, ties and "
                                "misses to the least loaded (KV usage, then tokens queued); `round_robin`, in turn",
                          choices=("kv", "round_robin"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.offload == "redis" and not self.redis_url:
            raise ValueError("offload 'redis' needs redis_url")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.redis_namespace):
            raise ValueError("redis_namespace must be 1 to 64 letters, digits, '_', '.' or '-', "
                             f"got {self.redis_namespace!r}")

    @property
    def offload_kind(self) -> str:
        return self.offload or ("redis" if self.redis_url else "host")


@dataclass(frozen=True)
class SchedulerConfig(_Config):
    """Continuous batching: how many requests and tokens one step takes."""

    max_num_seqs: int = option(256, "requests in one step (also the largest decode batch given a CUDA graph)",
                               min=1)
    max_num_batched_tokens: int = option(2048, "token budget of one step (prefill chunks + decodes); without "
                                               "chunked prefill at least the context length", min=1)
    max_waiting: int = option(1024, "requests waiting for admission; beyond it a new request is refused at "
                                    "once (RESOURCE_EXHAUSTED)", min=1)
    enable_chunked_prefill: bool = option(True, "split a long prompt across steps so running decodes keep "
                                                "their pace")
    scheduling_policy: str = option("fcfs", "`fcfs`: first come, first served; `priority`: by each request's "
                                            "`priority` (lower first), ties by arrival; preemption takes the "
                                            "lowest priority, then the newest", choices=("fcfs", "priority"))
    long_prefill_token_threshold: int = option(0, "most prompt tokens one request computes in a step (0: no "
                                                  "limit but the budget), so that a huge prompt leaves room to "
                                                  "others in every step", min=0)
    max_num_partial_prefills: int = option(0, "requests part-way through their prompt at once (0: no limit); "
                                              "a prompt that would start another waits while shorter ones that "
                                              "finish within the step go ahead", min=0)
    async_scheduling: bool = option(True, "plan each step while the executor runs the one before (two steps out, "
                                          "three while the scheduler's own work takes most of a step), so that "
                                          "it never waits on the scheduler; the executor feeds in the tokens it "
                                          "sampled, and a request found finished late emits nothing more")
    stream_interval: int = option(1, "tokens a request gathers before they go to its frontend (its first and "
                                     "last go at once): fewer, bigger messages cost the frontend and the "
                                     "client less CPU per token, at a coarser stream", min=1, max=1024)
    # Facts, not options: none until build_scheduler fills them in from what the executor reports.
    block_size: int | None = option(None, "tokens per KV block, as the executor reports it", min=1, flag=False)
    max_model_len: int | None = option(None, "context length, as the executor reports it (what its KV cache "
                                             "holds and the model allows)", min=1, flag=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                "max_num_batched_tokens must be at least max_model_len "
                f"({self.max_model_len}) without chunked prefill, so that any prompt fits in one step"
            )


@dataclass(frozen=True)
class ServingConfig(_Config):
    """The processes: where each listens, where it finds the others, how it logs and waits."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int | None = option(None, "port to listen on (default: frontend and `pagedserve up` "
                                     f"{SERVICE_PORTS['frontend']}, scheduler_svc {SERVICE_PORTS['scheduler_svc']}, "
                                     f"kvcache_svc {SERVICE_PORTS['kvcache_svc']}, executor_svc "
                                     f"{SERVICE_PORTS['executor_svc']}; 0: a free one)", min=0, max=65535)
    executor: str | None = option(None, "host:port of executor_svc")
    kvcache: str | None = option(None, "host:port of kvcache_svc (executor_svc: registers there, and renews "
                                       "its registration by heartbeat)")
    advertise_address: str | None = option(None, "executor_svc: host:port the other services reach it at, which "
                                                 "it registers under (default: the address it listens on; on 0.0.0.0, its host "
                                                 "name at that port)")
    heartbeat_ttl: float = option(3.0, "kvcache_svc: seconds after which an executor that registered and sent no "
                                       "heartbeat is dropped, with its pool (executors beat 3 times as often)",
                                  min=0.1)
    scheduler: str | None = option(None, "host:port of scheduler_svc")
    log_level: str = option("INFO", "logging threshold", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    startup_timeout: float = option(600.0, "seconds to wait for the service this one needs (or, for "
                                           "`pagedserve up`, for each service) to come up", min=1.0)
    max_streams: int = option(512, "concurrent Generate streams the frontend serves", min=1)
    http_address: str = option("127.0.0.1:8000", "host:port of the frontend's OpenAI-compatible HTTP API (empty: "
                                                 "none; a Stack with port 0 picks a free port)")
    served_model_name: tuple[str, ...] | None = option(
        None, "the model's names on the HTTP API: requests may name any, responses give the first (default: "
              "the model's own: its directory's or GGUF file's name, `SmolLM2-135M-Instruct` for `default`)")
    restart_backoff: float = option(1.0, "`pagedserve up`: seconds before restarting a service that died; "
                                          "doubles with each rapid failure in a row, up to "
                                          f"{RESTART_BACKOFF_CAP_S:g}", min=0.01)
    max_restarts: int = option(5, "`pagedserve up`: rapid failures of one service in a row (each within "
                                  f"{RESTART_STABLE_S:g} s of its start) after which it gives up and stops "
                                  "everything", min=0)
    max_message_bytes: int = option(4 << 20, "largest request or response on the public port, in bytes (the "
                                              "internal ports take a step of the longest context)",
                                    min=64 << 10, max=256 << 20)
    enable_auto_tool_choice: bool = option(False, "the HTTP API's tool_choice \"auto\" (also the default when a "
                                                  "request gives tools): the model chooses between text and tool "
                                                  "calls, which `tool_call_parser` reads from its output")
    tool_call_parser: str | None = option(None, "how the model writes a tool call, for tool_choice \"auto\": "
                                                "`hermes` (<tool_call>{\"name\": ..., \"arguments\": ...}"
                                                "</tool_call>: Qwen2.5, Qwen3, Hermes and others), `mistral` "
                                                "([TOOL_CALLS] and a JSON list, or name[ARGS]{...} per call), "
                                                "`llama3_json` (Llama 3.1-3.3: the output a JSON call, or several "
                                                "separated by ;), `granite` (<|tool_call|> and a JSON list) or "
                                                "`pythonic` (the output a Python list of calls with keyword "
                                                "arguments: Llama 3.2 and 4)",
                                          choices=("hermes", "mistral", "llama3_json", "granite", "pythonic"))
    reasoning_parser: str | None = option(None, "splits a reasoning model's thinking (<think>...</think>) from its "
                                                "answer on the HTTP API, into the message's `reasoning`: `qwen3` "
                                                "(thinking where the answer opens with <think>), `deepseek_r1` "
                                                "(the prompt opens it: the answer thinks until </think>) or "
                                                "`mistral` (Magistral: [THINK]...[/THINK] where the answer opens "
                                                "with it)",
                                          choices=("qwen3", "deepseek_r1", "mistral"))
    responses_store_size: int = option(1000, "the Responses API's stored responses, for previous_response_id and "
                                             "GET/DELETE /v1/responses/{id}: the newest this many, in each "
                                             "frontend's memory (a follow-up goes to the frontend that served the "
                                             "response); 0: none kept, store comes back false", min=0)
    max_prompt_chars: int | None = option(
        None, "longest prompt in characters (chat messages counted together), refused before tokenizing "
              f"(default: {PROMPT_CHARS_PER_TOKEN} per token of the context length)", min=1)
    tls_cert: str | None = option(None, "PEM certificate (chain) every server presents; with it every port "
                                        "serves TLS only")
    tls_key: str | None = option(None, "PEM private key of `tls_cert`")
    tls_ca: str | None = option(None, "PEM CA of the services' certificates: channels between services verify "
                                      "servers with it and present `tls_cert`, internal ports require a client "
                                      "certificate it signed (mutual TLS)")
    tls_client_ca: str | None = option(None, "PEM CA of client certificates: with it the public port requires "
                                             "one (mutual TLS)")
    api_key_file: str | None = option(None, "file of API keys, one a line: the public API then requires "
                                            "`authorization: Bearer <key>` (also: `PAGEDSERVE_API_KEY`)")
    internal_token_file: str | None = option(
        None, "file holding the shared secret that internal RPCs must carry (default: `PAGEDSERVE_INTERNAL_TOKEN`"
              "; `pagedserve up` makes one per stack)")
    drain_timeout_s: float = option(30.0, "on SIGTERM: seconds the frontend and the scheduler go on serving the "
                                          "requests in flight (refusing new ones with UNAVAILABLE, health "
                                          "NOT_SERVING) before they exit", min=0)
    frontends: int = option(1, "`pagedserve up`: frontend processes; frontend k listens on the public port + k "
                               "and the HTTP port + k", min=1, max=64)
    executors: int = option(1, "`pagedserve up`: executor processes, on consecutive internal ports", min=1, max=64)
    cpus: str | None = option(None, "the CPUs this process runs on, listed as taskset lists them (`0`, `0-3,6`); "
                                    "all its threads, torch's too, stay there (default: every CPU it was given)")
    control_plane_cpus: str | None = option(
        None, "`pagedserve up`: CPUs for the scheduler and the KV-cache service alone, the other processes on the "
              "rest. The two call each other in turn every step, and a gRPC call hands work between threads several "
              "times: on one core no hand-off has to wake another, which on a virtual machine costs tens of "
              "microseconds each. For machines with a core to spare: the executor loses these CPUs' compute")
    nice: int | None = option(
        None, "this process's CPU priority, as Linux's nice: where processes contend for cores, a higher "
              "value yields them to the others; below the nice it started at needs CAP_SYS_NICE (default: that one)",
        min=-20, max=19)
    frontend_nice: int | None = option(
        None, "`pagedserve up`: the frontends' nice (default: `nice`). On a host with few cores, the "
           "frontends' streaming (a message per stream per step) contends with each step's critical path (scheduler, "
           "block manager, executor); a higher value lets the steps go first, and each message then carries more "
           "tokens", min=-20, max=19)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.served_model_name is not None and not all(name.strip() for name in self.served_model_name):
            raise ValueError(f"served_model_name must be non-empty names, got {self.served_model_name!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser: how the model writes its calls")
        if self.http_address and not re.fullmatch(r"(\[[0-9a-fA-F:]+\]|[^:\s]+):\d{1,5}", self.http_address):
            raise ValueError(f"http_address must be host:port, got {self.http_address!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_cert is None and (self.tls_ca or self.tls_client_ca):
            raise ValueError("tls_ca and tls_client_ca need tls_cert and tls_key")
        for name in ("cpus", "control_plane_cpus"):
            if getattr(self, name) is not None:
                parse_cpu_list(getattr(self, name), name)
        for name in ("tls_cert", "tls_key", "tls_ca", "tls_client_ca", "api_key_file", "internal_token_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name} must name a readable file, got {path!r}")

    def listen_port(self, service: str) -> int:
        return SERVICE_PORTS[service] if self.port is None else self.port


def parse_cpu_list(text: str, name: str = "cpus") -> frozenset[int]:
    """A CPU list as taskset and /sys write them (`0-3,6`): the CPUs it names."""
    cpus = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            raise ValueError(f"{name} must be a CPU list such as 0-3,6, got {text!r}")
        cpus.update(range(int(match[1]), int(match[2] or match[1]) + 1))
    return frozenset(cpus)


def format_cpu_list(cpus) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus))


CONFIG_CLASSES = (ModelConfig, CacheConfig, SchedulerConfig, ServingConfig)


@dataclass(frozen=True)
class PagedServeConfig:
    """All four parts together (vLLM's VllmConfig)."""

    model_config: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cache_config: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    serving_config: ServingConfig = dataclasses.field(default_factory=ServingConfig)

    @classmethod
    def from_kwargs(cls, caller: str = "PagedServeConfig", classes=CONFIG_CLASSES, **kwargs) -> "PagedServeConfig":
        """Flat keyword arguments (the options of `classes`) sorted into their parts; an unknown one is refused."""
        parts = {}
        for config_cls in classes:
            names = [f.name for f in option_fields(config_cls)]
            parts[config_cls] = config_cls(**{n: kwargs.pop(n) for n in names if n in kwargs})
        if kwargs:
            raise TypeError(f"{caller}() got an unexpected keyword argument {next(iter(kwargs))!r}")
        return cls(*(parts.get(c, c()) for c in CONFIG_CLASSES))


# ---------------------------------------------------------------------------------------------- flags
# A service declares what it takes as {config class: field names, or None for all its options}.

def option_fields(cls, names=None) -> list[dataclasses.Field]:
    found = [f for f in dataclasses.fields(cls) if f.metadata["flag"]]
    if names is None:
        return found
    unknown = set(names) - {f.name for f in found}
    if unknown:
        raise ValueError(f"{cls.__name__} has no option {sorted(unknown)}")
    return [f for f in found if f.name in names]


def _flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, sections: dict) -> None:
    for cls, names in sections.items():
        group = parser.add_argument_group(cls.__name__, cls.__doc__)
        hints = typing.get_type_hints(cls)
        for f in option_fields(cls, names):
            base, _optional, is_tuple = _kind(hints[f.name])
            meta = f.metadata
            kwargs = {"default": f.default, "help": meta["help"], "dest": f.name}
            if f.default is not None and base is not bool:  # argparse adds it for booleans
                kwargs["help"] += " (default: %(default)s)"
            if base is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs.update(type=base, choices=meta["choices"], metavar=None if meta["choices"] else f.name.upper())
                if is_tuple:
                    kwargs["nargs"] = "+"
            group.add_argument(_flag(f), **kwargs)


def from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, sections: dict) -> dict:
    """The dataclasses back from parsed flags: {config class: instance}; a refused value is a usage error."""
    try:
        return {cls: cls(**{f.name: getattr(args, f.name) for f in option_fields(cls, names)})
                for cls, names in sections.items()}
    except ValueError as error:
        parser.error(str(error))


def parse(prog: str, description: str | None, sections: dict, argv: list[str] | None = None,
          required: tuple[str, ...] = ()) -> dict:
    """A service's command line; `required` names options (optional in the config) it cannot start without."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser, sections)
    args = parser.parse_args(argv)
    missing = [f"--{name.replace('_', '-')}" for name in required if getattr(args, name) is None]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    return from_args(parser, args, sections)


def to_argv(config: PagedServeConfig, sections: dict) -> list[str]:
    """The flags that give a service (declared by `sections`) these config values."""
    by_class = {type(part): part for part in (getattr(config, f.name) for f in dataclasses.fields(config))}
    argv: list[str] = []
    for cls, names in sections.items():
        for f in option_fields(cls, names):
            value = getattr(by_class[cls], f.name)
            if isinstance(value, bool):
                argv.append(_flag(f) if value else "--no-" + _flag(f)[2:])
            elif isinstance(value, tuple):
                argv += [_flag(f), *map(str, value)]
            elif value is not None:
                argv += [_flag(f), str(value)]
    return argv


# ---------------------------------------------------------------------------------------------- docs
TABLES_BEGIN = "<!-- the tables below are rendered from pagedserve/config.py: python -m pagedserve.config -->"
TABLES_END = "<!-- end of rendered tables -->"


def _cell(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ", ".join(f"`{v}`" for v in value)
    return f"`{value}`"


def render_tables() -> str:
    out = ["### Environment variables", "", "| variable | read by | meaning |", "|---|---|---|"]
    for name, (services, meaning) in ENVIRONMENT.items():
        out.append(f"| `{name}` | {', '.join(services)} | {meaning} |")
    out.append("")
    for cls in CONFIG_CLASSES:
        out += [f"### `{cls.__name__}`", "", cls.__doc__, "",
                "| field | flag | default | allowed | meaning |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            meta = f.metadata
            low, high = meta["min"], meta["max"]
            allowed = (_cell(meta["choices"]) if meta["choices"] else f"{low} to {high}" if high is not None
                       else f"≥ {low}" if low is not None else "")
            flag = f"`{_flag(f)}`" if meta["flag"] else "(from the executor)"
            out.append(f"| `{f.name}` | {flag} | {_cell(f.default)} | {allowed} | {meta['help']} |")
        out.append("")
    return "\n".join(out)


def render_doc(text: str) -> str:
    """The doc with the text between its table markers replaced by the rendered tables."""
    head, rest = text.split(TABLES_BEGIN)
    _, tail = rest.split(TABLES_END)
    return f"{head}{TABLES_BEGIN}\n\n{render_tables()}\n{TABLES_END}{tail}"


if __name__ == "__main__":
    doc = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/configuration.md")
    doc.write_text(render_doc(doc.read_text()))
