"""The frontend's Generate on gRPC's asyncio server (AioService), against a fake scheduler that runs every
request it is given one token a step: hundreds of concurrent streams all get their own tokens; a client that
cancels, or whose deadline passes, has its request aborted on the scheduler and released on the link; n
choices stream side by side."""
from __future__ import annotations

import asyncio
import queue
import threading
import time

import grpc
import pytest

from frontend.server import GenerationServicer, SchedulerLink
from pagedserve.client import build_request
from pagedserve.service import AioService
from pagedserve.v1 import common_pb2, generate_pb2_grpc, scheduler_pb2

STEP_S = 0.002


class FakeScheduler:
    """Each request runs from its first prompt token up, one token a step, until its max_tokens; aborts
    are recorded in `aborted`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[str, list[int]] = {}  # request id: [next token, tokens left]
        self.aborted: queue.SimpleQueue = queue.SimpleQueue()

    def Connect(self, messages, wait_for_ready=False):
        return FakeStream(self, messages)


class FakeStream:
    def __init__(self, scheduler: FakeScheduler, messages) -> None:
        self.scheduler = scheduler
        self.closed = threading.Event()
        threading.Thread(target=self._take, args=(messages,), daemon=True).start()

    def _take(self, messages) -> None:
        for message in messages:
            with self.scheduler.lock:
                if message.HasField("add"):
                    add = message.add
                    self.scheduler.running[add.request_id] = [add.prompt_token_ids[0], add.sampling.max_tokens]
                elif self.scheduler.running.pop(message.abort.request_id, None) is not None:
                    self.scheduler.aborted.put(message.abort.request_id)

    def __iter__(self):
        while not self.closed.wait(STEP_S):
            update = scheduler_pb2.SchedulerUpdate()
            with self.scheduler.lock:
                for request_id, state in list(self.scheduler.running.items()):
                    output = update.outputs.add(request_id=request_id, new_token_ids=[state[0]])
                    state[0] += 1
                    state[1] -= 1
                    if state[1] == 0:
                        output.finish_reason = common_pb2.FINISH_REASON_LENGTH
                        del self.scheduler.running[request_id]
            if update.outputs:
                yield update

    def cancel(self) -> None:
        self.closed.set()


@pytest.fixture(scope="module")
def frontend():
    from transformers import AutoTokenizer

    from executor_svc.model_loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("default"))
    scheduler = FakeScheduler()
    link = SchedulerLink(scheduler)
    info = scheduler_pb2.SchedulerInfo(model="fake", max_model_len=4096, vocab_size=tokenizer.vocab_size)
    service = AioService("frontend", "127.0.0.1", 0, public=True)
    generate_pb2_grpc.add_GenerationServicer_to_server(
        GenerationServicer(link, tokenizer, info, max_prompt_chars=10_000, max_streams=512), service.server)
    service.start()
    yield service, scheduler, link
    link.close()
    service.stop(grace=0)


def released(link: SchedulerLink, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if link.idle():
            return True
        time.sleep(0.01)
    return False


def test_256_concurrent_streams_all_complete_with_their_own_tokens(frontend):
    service, scheduler, link = frontend

    async def one(stub, i: int) -> tuple[list[int], str]:
        request = build_request(prompt_token_ids=[100 + 7 * i, 5], max_tokens=3 + i % 20, ignore_eos=True)
        tokens, finish = [], None
        async for response in stub.Generate(request, timeout=60):
            tokens.extend(response.token_ids)
            finish = response.finish_reason or finish
        return tokens, finish

    async def all_of_them():
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            return await asyncio.gather(*(one(stub, i) for i in range(256)))

    results = asyncio.run(all_of_them())
    for i, (tokens, finish) in enumerate(results):
        assert tokens == list(range(100 + 7 * i, 100 + 7 * i + 3 + i % 20)), f"stream {i}"
        assert finish == common_pb2.FINISH_REASON_LENGTH
    assert released(link)


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_client_that_goes_away_has_its_request_aborted_on_the_scheduler(frontend, how):
    service, scheduler, link = frontend
    with grpc.insecure_channel(service.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        request = build_request(prompt_token_ids=[42], max_tokens=4000, ignore_eos=True)
        stream = stub.Generate(request, timeout=None if how == "cancel" else 0.5)
        if how == "cancel":
            for _ in range(3):
                next(stream)
            stream.cancel()
        else:
            with pytest.raises(grpc.RpcError) as ended:
                for _ in stream:
                    pass
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    aborted = scheduler.aborted.get(timeout=5)
    assert aborted not in scheduler.running
    assert released(link), "the call was not released on the link"


def test_n_choices_stream_side_by_side(frontend):
    service, _, link = frontend
    with grpc.insecure_channel(service.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        request = build_request(prompt_token_ids=[300], max_tokens=6, ignore_eos=True, n=3, request_id="three")
        choices: dict[int, list[int]] = {}
        for response in stub.Generate(request, timeout=30):
            assert response.request_id == "three"
            choices.setdefault(response.index, []).extend(response.token_ids)
    assert choices == {i: list(range(300, 306)) for i in range(3)}
    assert released(link)
