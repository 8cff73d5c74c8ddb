"""A request re-submitted with the tokens it already produced (what a frontend does when the scheduler it
talked to restarts) continues exactly where it left off: same remaining tokens, and what it had counts
toward max_tokens and min_tokens."""
from __future__ import annotations

import pytest

from pagedserve.sampling_params import SamplingParams
from scheduler_svc.request import Request
from tests.unit.test_scheduler import EOS, add, make_engine, random_prompts, run_to_completion

MAX_TOKENS = 20


def resubmit(scheduler, request_id: str, prompt: list[int], produced: list[int], **params) -> None:
    scheduler.add_request(Request(request_id, prompt, SamplingParams(**params), (EOS,),
                                  scheduler.config.max_model_len, output_token_ids=produced))


@pytest.mark.parametrize("num_produced", [1, 7, MAX_TOKENS - 1])
def test_resubmitted_requests_continue_with_the_fault_free_tokens(num_produced):
    prompts = random_prompts(12, seed=3)
    scheduler, block_manager, executor = make_engine(num_blocks=512, max_num_batched_tokens=64)
    for i, prompt in enumerate(prompts):
        add(scheduler, f"r{i}", prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = run_to_completion(scheduler, executor, block_manager)

    # A fresh scheduler and block manager: the restarted scheduler knows nothing of the first run.
    scheduler, block_manager, executor = make_engine(num_blocks=512, max_num_batched_tokens=64)
    for i, prompt in enumerate(prompts):
        resubmit(scheduler, f"r{i}", prompt, expected[f"r{i}"][:num_produced], max_tokens=MAX_TOKENS, ignore_eos=True)
    continued = run_to_completion(scheduler, executor, block_manager)
    for i in range(len(prompts)):
        assert continued[f"r{i}"] == expected[f"r{i}"][num_produced:]


def test_tokens_already_produced_count_toward_min_tokens():
    scheduler, block_manager, executor = make_engine(num_blocks=64)
    executor.eos_after["r"] = 0  # EOS at every step: only min_tokens holds it back
    resubmit(scheduler, "r", [1, 2, 3], [5] * 8, max_tokens=MAX_TOKENS, min_tokens=10)
    outputs = run_to_completion(scheduler, executor, block_manager)
    assert outputs["r"] == [EOS, EOS]


def test_a_request_with_no_room_left_is_refused():
    with pytest.raises(ValueError, match="no room left"):
        Request("r", [1, 2, 3], SamplingParams(max_tokens=4), (EOS,), 512, output_token_ids=[5, 6, 7, 8])
