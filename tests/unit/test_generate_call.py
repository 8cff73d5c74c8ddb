"""GenerateCall, the frontend's one request from both APIs: what it passes on from the scheduler's outputs."""
from __future__ import annotations

from frontend.generation import GenerateCall
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import RequestOutput, SampledToken
from tests.support.http_app import CharTokenizer


class QuietLink:
    def submit(self, *args, **kwargs) -> None:
        pass

    def abort(self, request_id) -> None:
        pass


def test_prompt_logprobs_go_out_once_though_a_restarted_scheduler_computes_them_again():
    """A scheduler restarted mid-request is sent the request again, prompt logprobs asked for: the client has
    them already (docs/reliability.md: nothing streamed is sent again)."""
    call = GenerateCall(QuietLink(), CharTokenizer(), [97, 98, 99], SamplingParams(max_tokens=4, prompt_logprobs=0),
                        None, inbox=None)
    call.start()
    scored = [SampledToken(98, -1.0), SampledToken(99, -2.0)]
    first = call.process(RequestOutput(call.ids[0], [100], prompt_logprobs=scored))
    again = call.process(RequestOutput(call.ids[0], [101], prompt_logprobs=scored))
    assert first.prompt_logprobs == scored and again.prompt_logprobs is None
    assert first.token_ids + again.token_ids == [100, 101]
