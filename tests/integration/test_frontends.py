"""Several frontends on one scheduler (`pagedserve up --frontends 2`), and a graceful drain on SIGTERM: each
frontend's requests come back on that frontend alone; a frontend that dies takes only its own requests
with it (aborted, their blocks freed); a frontend or a scheduler told to stop turns NOT_SERVING, refuses new
requests with UNAVAILABLE (HTTP 503) and finishes those in flight in full before it exits. A tiny random
Llama on the CPU; outputs are compared with the offline LLM's greedy tokens."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2

from pagedserve import LLM, SamplingParams
from pagedserve.client import GenerateClient, build_request
from pagedserve.config import PagedServeConfig
from pagedserve.entrypoints.launcher import Stack
from tests.support.probes import health, wait_for
from tests.support.tiny_stack import kv_stats, write_tiny_model_with_tokenizer

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Room for long generations: a request that runs for seconds while the test acts.
CONTEXT = 4096
DRAIN_TIMEOUT_S = 60.0
PROMPT = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-llama-long"),
                                               max_position_embeddings=CONTEXT))


@pytest.fixture(scope="module")
def reference(model):
    return LLM(model, device="cpu", dtype="float32", kv_cache_memory=64 << 20)


def greedy(reference: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    [result] = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return result.token_ids


@pytest.fixture(scope="module")
def stack(model):
    config = PagedServeConfig.from_kwargs(
        model=model, device="cpu", dtype="float32", port=0, http_address="127.0.0.1:0", log_level="WARNING",
        kv_cache_memory=64 << 20, frontends=2, drain_timeout_s=DRAIN_TIMEOUT_S, restart_backoff=0.5,
    )
    with Stack(config) as running:
        yield running


def request(prompt: list[int], max_tokens: int):
    return build_request(prompt_token_ids=prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class Streaming:
    """A greedy request streamed on a thread: its tokens as they come, then its end (tokens or error)."""

    def __init__(self, address: str, prompt: list[int], max_tokens: int) -> None:
        self.tokens: list[int] = []
        self.error: grpc.RpcError | None = None
        self.client = GenerateClient(address)
        self.thread = threading.Thread(target=self._run, args=(request(prompt, max_tokens),))
        self.thread.start()

    def _run(self, message) -> None:
        try:
            for response in self.client.stream(message, timeout=300):
                self.tokens.extend(response.token_ids)
        except grpc.RpcError as error:
            self.error = error

    def wait_for_tokens(self, count: int) -> None:
        assert wait_for(lambda: len(self.tokens) >= count or not self.thread.is_alive(), 60)
        assert len(self.tokens) >= count, f"ended early: {self.error}"

    def join(self) -> None:
        self.thread.join(timeout=300)
        self.client.close()


def test_each_frontend_serves_on_the_public_port_plus_k(stack, reference):
    first = int(stack.address.rsplit(":", 1)[1])
    assert [stack.addresses[name] for name in stack.frontends] == [f"127.0.0.1:{first}", f"127.0.0.1:{first + 1}"]
    http_first = int(stack.http_address.rsplit(":", 1)[1])
    assert stack.http_addresses["frontend-1"] == f"127.0.0.1:{http_first + 1}"
    expected = greedy(reference, PROMPT, 32)
    for name in stack.frontends:
        with GenerateClient(stack.addresses[name]) as client:
            assert client.generate(request(PROMPT, 32), timeout=60).token_ids == expected, name
        body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        completion = httpx.post(f"http://{stack.http_addresses[name]}/v1/completions", json=body, timeout=60).json()
        assert completion["usage"]["completion_tokens"] == 32, name


def test_a_frontend_that_dies_takes_only_its_own_requests(stack, reference):
    survivor_prompt, victim_prompt = [21, 22, 23, 24], [31, 32, 33]
    survivor = Streaming(stack.addresses["frontend"], survivor_prompt, 400)
    victim = Streaming(stack.addresses["frontend-1"], victim_prompt, CONTEXT - 16)
    survivor.wait_for_tokens(5)
    victim.wait_for_tokens(5)
    assert kv_stats(stack).num_requests == 2
    stack.processes["frontend-1"].send_signal(signal.SIGKILL)
    victim.join()
    assert victim.error is not None and victim.error.code() == grpc.StatusCode.UNAVAILABLE
    # The scheduler aborts the dead frontend's request at once (it had thousands of tokens to go) ...
    assert wait_for(lambda: kv_stats(stack).num_requests == 1, timeout=10)
    survivor.join()
    # ... and the other frontend's request, in flight meanwhile, completes unchanged.
    assert survivor.error is None and survivor.tokens == greedy(reference, survivor_prompt, 400)
    assert wait_for(lambda: kv_stats(stack).num_requests == 0 and kv_stats(stack).num_in_use == 0, timeout=10)
    assert wait_for(lambda: stack.supervisor.restarts.get("frontend-1") == 1, timeout=60)


def test_a_frontend_drains_on_sigterm(stack, reference):
    """In flight: finishes in full. New: UNAVAILABLE on gRPC, 503 on HTTP. Then it exits, well within its
    drain timeout, and the supervisor starts it again."""
    address, http = stack.addresses["frontend"], stack.http_addresses["frontend"]
    process = stack.processes["frontend"]
    long = Streaming(address, PROMPT, 800)
    long.wait_for_tokens(5)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert wait_for(lambda: health(address) == NOT_SERVING, timeout=5)
    with GenerateClient(address) as client, pytest.raises(grpc.RpcError) as refused:
        client.generate(request(PROMPT, 4), timeout=30)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down and takes no new requests" in refused.value.details()
    for stream in (False, True):
        response = httpx.post(f"http://{http}/v1/completions", timeout=30,
                              json={"prompt": PROMPT, "max_tokens": 4, "stream": stream})
        assert response.status_code == 503 and "takes no new requests" in response.json()["error"]["message"]
    assert httpx.get(f"http://{http}/health", timeout=5).status_code == 503
    assert long.thread.is_alive(), "the request must still be in flight while new ones are refused"
    long.join()
    assert long.error is None and long.tokens == greedy(reference, PROMPT, 800)
    process.wait(timeout=DRAIN_TIMEOUT_S)
    assert process.returncode == 0 and time.monotonic() - signalled < DRAIN_TIMEOUT_S
    assert wait_for(lambda: stack.supervisor.restarts.get("frontend") == 1, timeout=60)


def test_the_scheduler_drains_on_sigterm(stack, reference):
    """Its request in flight finishes in full; one submitted meanwhile, through either frontend, is refused
    with UNAVAILABLE; it exits and comes back, and the stack serves again."""
    process = stack.processes["scheduler_svc"]
    long = Streaming(stack.addresses["frontend-1"], PROMPT, 600)
    long.wait_for_tokens(5)
    process.send_signal(signal.SIGTERM)
    assert wait_for(lambda: health(stack.scheduler_address) == NOT_SERVING, timeout=5)
    with GenerateClient(stack.addresses["frontend"]) as client, pytest.raises(grpc.RpcError) as refused:
        client.generate(request(PROMPT, 4), timeout=30)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "the scheduler is shutting down" in refused.value.details()
    long.join()
    assert long.error is None and long.tokens == greedy(reference, PROMPT, 600)
    process.wait(timeout=DRAIN_TIMEOUT_S)
    assert process.returncode == 0
    assert wait_for(lambda: stack.supervisor.restarts.get("scheduler_svc") == 1, timeout=60)
    with GenerateClient(stack.address) as client:
        assert client.generate(request(PROMPT, 16), timeout=120).token_ids == greedy(reference, PROMPT, 16)


@pytest.mark.slow  # a stack of its own: about 45 s
def test_pagedserve_up_drains_on_sigterm(model, reference):
    """The whole `pagedserve up` told to stop: it prints every process's address on start; on SIGTERM the
    frontends drain first (a new request is refused, the one in flight finishes in full), then the others
    stop, and the launcher exits 0 within the drain timeout, leaving nothing listening."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.entrypoints.cli", "up", "--model", model, "--device", "cpu",
         "--dtype", "float32", "--port", "0", "--http-address", "", "--kv-cache-memory", str(64 << 20),
         "--log-level", "WARNING", "--frontends", "2", "--drain-timeout-s", str(DRAIN_TIMEOUT_S)],
        stdout=subprocess.PIPE, text=True)
    try:
        printed = []
        for line in launcher.stdout:
            printed.append(line)
            if "serving the Generate API" in line:
                break
        listed = dict(re.findall(r"^  ([\w-]+): (\S+)", "".join(printed), re.M))
        assert set(listed) == {"executor_svc", "kvcache_svc", "scheduler_svc", "frontend", "frontend-1"}, printed
        threading.Thread(target=launcher.stdout.read, daemon=True).start()
        # On the frontend asked below: an idle one drains at once and is gone before it can be asked.
        long = Streaming(listed["frontend"], PROMPT, 800)
        long.wait_for_tokens(5)
        signalled = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        assert wait_for(lambda: health(listed["frontend"]) == NOT_SERVING, timeout=5)
        with GenerateClient(listed["frontend"]) as client, pytest.raises(grpc.RpcError) as refused:
            client.generate(request(PROMPT, 4), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        long.join()
        assert long.error is None and long.tokens == greedy(reference, PROMPT, 800)
        assert launcher.wait(timeout=DRAIN_TIMEOUT_S) == 0
        assert time.monotonic() - signalled < DRAIN_TIMEOUT_S
        assert [address for address in listed.values() if health(address) is not None] == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
