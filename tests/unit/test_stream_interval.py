"""The scheduler's stream interval: a request's first tokens and its finish go at once, the rest in runs of at
least the interval, every token once and in order."""
import pytest

from pagedserve.step import RequestOutput, SampledToken
from scheduler_svc.stream_interval import StreamInterval


def output(request_id: str, token_ids: list[int], num_output_tokens: int, finish_reason: str | None = None,
           logprobs: bool = False) -> RequestOutput:
    return RequestOutput(request_id, token_ids, [SampledToken(t, -0.5) for t in token_ids] if logprobs else None,
                         finish_reason, num_prompt_tokens=3, num_output_tokens=num_output_tokens)


def test_an_interval_of_one_passes_every_output_through():
    outputs = [output("a", [1], 1), output("b", [2], 5)]
    assert StreamInterval(1).release(outputs) == outputs


def stream(interval: StreamInterval, request_id: str, num_tokens: int) -> list[list[int]]:
    """The token runs sent for a request that gains a token a step and ends with its last (one per step,
    empty when held)."""
    sent = []
    for n in range(1, num_tokens + 1):
        finish = "length" if n == num_tokens else None
        outputs = interval.release([output(request_id, [100 + n], n, finish, logprobs=True)])
        assert all(o.new_logprobs is not None and [t.token_id for t in o.new_logprobs] == o.new_token_ids
                   for o in outputs)
        sent.append([t for o in outputs for t in o.new_token_ids])
    return sent


@pytest.mark.parametrize("request_id", ["a", "b", "c", "d", "e"])
def test_tokens_go_in_runs_of_the_interval_after_the_first_and_the_finish_at_once(request_id):
    interval = StreamInterval(3)
    sent = stream(interval, request_id, 14)
    assert [t for run in sent for t in run] == list(range(101, 115))  # every token once, in order
    assert sent[0] == [101] and sent[-1]  # the first at once; the last step sends what was held
    runs = [run for run in sent[1:-1] if run]
    # After the first token, one run of up to the interval (its phase), then runs of exactly the interval.
    assert 1 <= len(runs[0]) <= 3 and all(len(run) == 3 for run in runs[1:])
    assert interval.held == {}


def test_requests_that_start_together_flush_in_different_steps():
    interval = StreamInterval(4)
    ids = [f"request-{i}" for i in range(64)]
    messages_per_step = []
    for n in range(1, 41):
        messages_per_step.append(len(interval.release([output(i, [n], n) for i in ids])))
    assert messages_per_step[0] == 64
    # Not all 64 every fourth step and none between: each step sends a share of them.
    assert all(4 <= count <= 32 for count in messages_per_step[1:]), messages_per_step


# Requests "d" and "f" have phase 0 for intervals 2, 3 and 4 (crc32 of the id): they flush when their token
# count is a multiple of the interval, or when they have gathered the interval.
def test_requests_are_held_apart_and_a_step_of_several_tokens_counts_them_all():
    interval = StreamInterval(4)
    assert [o.request_id for o in interval.release([output("d", [1], 1), output("f", [2, 3], 2)])] == ["d", "f"]
    assert interval.release([output("d", [4, 5, 6, 7], 5), output("f", [8], 3)])[0].new_token_ids == [4, 5, 6, 7]
    assert set(interval.held) == {"f"}
    # An abort (or an error) ends the request with what it held.
    ended = interval.release([output("f", [], 3, "abort")])
    assert [(o.new_token_ids, o.finish_reason) for o in ended] == [([8], "abort")]
    assert interval.held == {}


def test_a_resubmitted_request_is_held_from_its_first_new_token():
    """A request re-submitted to a restarted scheduler with 10 tokens streamed already: its next tokens are
    not its first, so they wait for the interval."""
    interval = StreamInterval(2)
    assert interval.release([output("d", [11], 11)]) == []
    assert interval.release([output("d", [12], 12)])[0].new_token_ids == [11, 12]
