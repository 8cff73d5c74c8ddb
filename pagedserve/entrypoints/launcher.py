"""Starts the four services as local processes, in dependency order, and stops them all together."""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from pagedserve.service import wait_until_serving

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class StackConfig:
    model: str = "default"
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 50051  # the public API
    kv_cache_memory: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    attention_backend: str = "auto"  # auto, torch or cupy (executor_svc --attention-backend)
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    offload: str | None = None  # host (default), redis (default with redis_url) or none
    redis_url: str | None = None
    offload_all: bool = False  # copy every block to the tier as it fills
    log_level: str = "WARNING"
    startup_timeout: float = 600.0
    extra_env: dict[str, str] = field(default_factory=dict)


class Stack:
    """The running services; use as a context manager, or call start() and stop()."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.processes: list[tuple[str, subprocess.Popen]] = []
        host = config.host
        self.executor_address = f"{host}:{free_port(host)}"
        self.kvcache_address = f"{host}:{free_port(host)}"
        self.scheduler_address = f"{host}:{free_port(host)}"
        self.address = f"{host}:{config.port or free_port(host)}"

    def start(self) -> "Stack":
        c = self.config
        common = ["--log-level", c.log_level]
        executor = ["--model", c.model, "--device", c.device, "--dtype", c.dtype]
        if c.kv_cache_memory is not None:
            executor += ["--kv-cache-memory", str(c.kv_cache_memory)]
        if c.max_model_len is not None:
            executor += ["--max-model-len", str(c.max_model_len)]
        # The executor captures decode CUDA graphs up to the scheduler's batch limit.
        executor += ["--attention-backend", c.attention_backend, "--max-num-seqs", str(c.max_num_seqs)]
        if c.enforce_eager:
            executor += ["--enforce-eager"]
        if c.offload is not None:
            executor += ["--offload", c.offload]
        if c.redis_url is not None:
            executor += ["--redis-url", c.redis_url]
        try:
            self._spawn("executor_svc", self.executor_address, executor + common)
            kvcache = ["--executor", self.executor_address] + (["--offload-all"] if c.offload_all else [])
            self._spawn("kvcache_svc", self.kvcache_address, kvcache + common)
            self._spawn("scheduler_svc", self.scheduler_address, [
                "--kvcache", self.kvcache_address, "--executor", self.executor_address,
                "--max-num-seqs", str(c.max_num_seqs), "--max-num-batched-tokens", str(c.max_num_batched_tokens),
            ] + common)
            self._spawn("frontend", self.address, ["--scheduler", self.scheduler_address] + common)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, module: str, address: str, args: list[str]) -> None:
        host, port = address.rsplit(":", 1)
        command = [sys.executable, "-m", module, "--host", host, "--port", port, *args]
        env = {**os.environ, **self.config.extra_env}
        process = subprocess.Popen(command, env=env)
        self.processes.append((module, process))
        deadline = time.monotonic() + self.config.startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{module} exited with status {process.returncode} while starting")
            try:
                wait_until_serving(address, timeout=2.0)
                return
            except Exception:  # not listening yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{module} did not report SERVING on {address}") from None

    def stop(self, timeout: float = 10.0) -> None:
        # Front to back, each gone before the next is told, so that no service is left calling one that
        # has already stopped (the scheduler finishes its step before the executor goes).
        for module, process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in time; killing it", module)
                process.kill()
                process.wait()
        self.processes.clear()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
