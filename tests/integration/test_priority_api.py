"""`priority` through both public APIs: under --scheduling-policy priority, requests that wait for the one
running slot are admitted lowest priority first, whichever API sent them. The executor is the benchmarking
one (a fixed sleep per step, no model), so that the running request outlasts the others' arrival."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from pagedserve.client import GenerateClient, build_request
from pagedserve.config import PagedServeConfig
from pagedserve.entrypoints.launcher import Stack
from tests.integration.conftest import MODEL

STEP_MS = 20
BLOCKER_TOKENS = 100  # about 2 s of steps


@pytest.fixture(scope="module")
def priority_stack():
    config = PagedServeConfig.from_kwargs(model="default", device="cpu", port=0, log_level="WARNING",
                                          benchmark_sleep_ms=STEP_MS, max_num_seqs=1,
                                          scheduling_policy="priority")
    with Stack(config) as running:
        yield running


def test_waiting_requests_are_admitted_by_priority_from_either_api(priority_stack):
    first_token_at: dict[str, float] = {}
    submitted_at: dict[str, float] = {}

    def over_grpc(name: str, priority: int, max_tokens: int) -> None:
        request = build_request(prompt_token_ids=[1, 2, 3], max_tokens=max_tokens, ignore_eos=True,
                                temperature=0.0, priority=priority)
        with GenerateClient(priority_stack.address) as client:
            submitted_at[name] = time.monotonic()
            for response in client.stream(request, timeout=60):
                first_token_at.setdefault(name, time.monotonic())

    def over_http(name: str, priority: int) -> None:
        body = {"model": MODEL, "prompt": [4, 5, 6], "max_tokens": 2, "ignore_eos": True, "temperature": 0,
                "priority": priority, "stream": True}
        submitted_at[name] = time.monotonic()
        with httpx.stream("POST", f"{priority_stack.http_url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    first_token_at.setdefault(name, time.monotonic())

    blocker = threading.Thread(target=over_grpc, args=("blocker", 0, BLOCKER_TOKENS))
    blocker.start()
    deadline = time.monotonic() + 30
    while "blocker" not in first_token_at and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "blocker" in first_token_at, "the first request never started"
    # Sent in an order that priority must undo: 5 (HTTP), then 3 (gRPC), then 1 (HTTP).
    waiting = [threading.Thread(target=over_http, args=("http-5", 5)),
               threading.Thread(target=over_grpc, args=("grpc-3", 3, 2)),
               threading.Thread(target=over_http, args=("http-1", 1))]
    for thread in waiting:
        thread.start()
        time.sleep(0.1)  # each arrives after the one before
    for thread in [blocker, *waiting]:
        thread.join(timeout=60)
    assert max(submitted_at.values()) < first_token_at["http-1"], first_token_at
    assert min(first_token_at[name] for name in ("http-5", "grpc-3", "http-1")) > max(
        submitted_at[name] for name in ("http-5", "grpc-3", "http-1")), "the blocker ended before all had arrived"
    assert sorted(first_token_at, key=first_token_at.get) == ["blocker", "http-1", "grpc-3", "http-5"]
