"""The frontend's link to the scheduler, against a fake scheduler stub: when its stream breaks it opens a new
one by itself and re-submits exactly the requests still in flight, each with the tokens it has produced;
their inboxes just go on receiving."""
from __future__ import annotations

import queue
import threading

import grpc

from frontend.server import SchedulerLink
from pagedserve.sampling_params import SamplingParams
from pagedserve.v1 import common_pb2, scheduler_pb2


class Lost(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


class FakeStream:
    """The scheduler's end of one Connect stream: what the link sent, and what to answer."""

    def __init__(self, messages) -> None:
        self.received: queue.SimpleQueue = queue.SimpleQueue()
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=lambda: [self.received.put(m) for m in messages], daemon=True).start()

    def __iter__(self):
        while True:
            answer = self.answers.get()
            if answer is None:
                return
            if isinstance(answer, Exception):
                raise answer
            yield answer

    def cancel(self) -> None:
        self.answers.put(None)

    def send(self, request_id: str, token_ids: list[int], finish=common_pb2.FINISH_REASON_UNSPECIFIED) -> None:
        update = scheduler_pb2.SchedulerUpdate()
        update.outputs.add(request_id=request_id, new_token_ids=token_ids, finish_reason=finish)
        self.answers.put(update)

    def next_message(self) -> scheduler_pb2.SchedulerRequest:
        return self.received.get(timeout=5)


class FakeScheduler:
    def __init__(self) -> None:
        self.streams: queue.SimpleQueue = queue.SimpleQueue()

    def Connect(self, messages, wait_for_ready=False):
        assert wait_for_ready, "a restarting scheduler must be waited for"
        stream = FakeStream(messages)
        self.streams.put(stream)
        return stream


def tokens(inbox: queue.SimpleQueue) -> list[int]:
    return list(inbox.get(timeout=5).new_token_ids)


def test_a_broken_stream_is_reopened_with_the_requests_in_flight_and_their_tokens():
    scheduler = FakeScheduler()
    link = SchedulerLink(scheduler)
    first = scheduler.streams.get(timeout=5)
    params = SamplingParams(max_tokens=10)
    inboxes = {name: link.submit(name, [1, 2, 3], params, None) for name in ("going", "finished", "cancelled")}
    assert [first.next_message().add.request_id for _ in range(3)] == ["going", "finished", "cancelled"]

    first.send("going", [5])
    first.send("going", [6])
    first.send("finished", [7], finish=common_pb2.FINISH_REASON_LENGTH)
    assert tokens(inboxes["going"]) == [5] and tokens(inboxes["going"]) == [6]
    assert tokens(inboxes["finished"]) == [7]
    link.abort("cancelled")
    first.answers.put(Lost())

    second = scheduler.streams.get(timeout=5)
    resubmitted = second.next_message().add
    assert (resubmitted.request_id, list(resubmitted.prompt_token_ids), list(resubmitted.output_token_ids)) == (
        "going", [1, 2, 3], [5, 6])
    assert resubmitted.sampling.max_tokens == 10
    # A request submitted after the break goes out on the new stream, after the re-submissions only.
    link.submit("new", [4], params, None)
    assert second.next_message().add.request_id == "new"
    assert second.received.empty()

    second.send("going", [8], finish=common_pb2.FINISH_REASON_LENGTH)
    assert tokens(inboxes["going"]) == [8]
    assert inboxes["going"].empty(), "the inbox saw the outage"
    link.close()
