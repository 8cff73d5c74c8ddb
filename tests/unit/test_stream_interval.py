"""The scheduler's stream interval: a request's first tokens and its finish go at once, the rest in runs of at
least the interval, every token once and in order."""
from pagedserve.step import RequestOutput, SampledToken
from scheduler_svc.stream_interval import StreamInterval


def output(request_id: str, token_ids: list[int], num_output_tokens: int, finish_reason: str | None = None,
           logprobs: bool = False) -> RequestOutput:
    return RequestOutput(request_id, token_ids, [SampledToken(t, -0.5) for t in token_ids] if logprobs else None,
                         finish_reason, num_prompt_tokens=3, num_output_tokens=num_output_tokens)


def test_an_interval_of_one_passes_every_output_through():
    outputs = [output("a", [1], 1), output("b", [2], 5)]
    assert StreamInterval(1).release(outputs) == outputs


def test_tokens_go_in_runs_of_the_interval_after_the_first_and_the_finish_at_once():
    interval = StreamInterval(3)
    sent = []
    for step in range(1, 9):  # request "a" gains a token a step and ends at the 8th
        finish = "length" if step == 8 else None
        sent.append(interval.release([output("a", [100 + step], step, finish, logprobs=True)]))
    assert [[o.new_token_ids for o in step] for step in sent] == [
        [[101]], [], [], [[102, 103, 104]], [], [], [[105, 106, 107]], [[108]]]
    last = sent[-1][0]
    assert last.finish_reason == "length" and last.num_output_tokens == 8
    assert [t.token_id for t in sent[3][0].new_logprobs] == [102, 103, 104]
    assert interval.held == {}


def test_requests_are_held_apart_and_a_step_of_several_tokens_counts_them_all():
    interval = StreamInterval(4)
    assert [o.request_id for o in interval.release([output("a", [1], 1), output("b", [2, 3], 2)])] == ["a", "b"]
    assert interval.release([output("a", [4, 5, 6, 7], 5), output("b", [8], 3)])[0].new_token_ids == [4, 5, 6, 7]
    assert set(interval.held) == {"b"}
    # An abort (or an error) ends the request with what it held.
    ended = interval.release([output("b", [], 3, "abort")])
    assert [(o.new_token_ids, o.finish_reason) for o in ended] == [([8], "abort")]
    assert interval.held == {}


def test_a_resubmitted_request_is_held_from_its_first_new_token():
    """A request re-submitted to a restarted scheduler with 10 tokens streamed already: its next tokens are
    not its first, so they wait for the interval."""
    interval = StreamInterval(2)
    assert interval.release([output("a", [11], 11)]) == []
    assert interval.release([output("a", [12], 12)])[0].new_token_ids == [11, 12]
