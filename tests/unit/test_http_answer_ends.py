"""How an HTTP answer ends when it cannot be whole. A whole (unstreamed) answer whose client has gone: its
requests are aborted and the handler stops with the 499 that no one reads, rather than building an answer from
the part it has (which failed with an IndexError when no token had come yet). A fault of the server's own in a
stream: an error event, then [DONE], not an empty body."""
from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from frontend.http_server import CLIENT_CLOSED, APIError, OpenAIServer
from frontend.validation import GenerateInput
from pagedserve.sampling_params import SamplingParams
from tests.support.http_app import CharTokenizer


class SilentLink:
    """Takes requests and never answers them."""

    draining = False

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.aborted: list[str] = []

    def submit(self, request_id, *args, **kwargs) -> None:
        self.submitted.append(request_id)

    def abort(self, request_id) -> None:
        self.aborted.append(request_id)

    def release(self, request_id) -> None:
        pass


class GoneClient:
    async def is_disconnected(self) -> bool:
        return True


@pytest.mark.parametrize("calls", [1, 2])
def test_a_gone_client_gets_no_answer_built_and_its_requests_aborted(calls):
    link = SilentLink()
    server = OpenAIServer(link, CharTokenizer(), ("m",), max_model_len=64, vocab_size=256, max_prompt_chars=100)

    async def answer():
        pending = [server._call([97, 98], SamplingParams(max_tokens=4), GenerateInput(request_id=f"r{i}"))
                   for i in range(calls)]
        return await server._collect(GoneClient(), pending)

    with pytest.raises(APIError) as refused:
        asyncio.run(answer())
    assert refused.value.status == CLIENT_CLOSED
    assert link.submitted and set(link.aborted) == set(link.submitted)


class FailingLink(SilentLink):
    def submit(self, request_id, *args, **kwargs) -> None:
        raise ValueError("a fault of the server's own")


def test_a_fault_in_a_stream_ends_it_with_an_error_event_not_an_empty_body():
    app = TestClient(OpenAIServer(FailingLink(), CharTokenizer(), ("m",), max_model_len=64, vocab_size=256,
                                  max_prompt_chars=100).app)
    response = app.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "stream": True})
    events = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert '"internal_server_error"' in events[0] and "ValueError" in events[0]
    assert events[-1] == "data: [DONE]"

