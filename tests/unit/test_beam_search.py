"""pagedserve/beam_search.py on a toy model whose next-token logprobs are a table."""
from __future__ import annotations

import math

import pytest

from pagedserve.beam_search import BeamSearch

EOS = 0
# Next-token logprobs by the tokens so far: after "1" EOS is likely, after "2" the text goes on.
TABLE = {
    (): {1: math.log(0.5), 2: math.log(0.4), 3: math.log(0.1)},
    (1,): {EOS: math.log(0.9), 4: math.log(0.1)},
    (2,): {5: math.log(0.95), EOS: math.log(0.05)},
    (3,): {6: math.log(1.0)},
}


def run(search: BeamSearch) -> list[tuple[list[int], float]]:
    while not search.done:
        search.advance([sorted(TABLE.get(tuple(b.tokens), {7: 0.0}).items(), key=lambda kv: -kv[1])
                        [:search.num_candidates] for b in search.live])
    return [(b.tokens, round(b.cumulative_logprob, 6)) for b in search.best()]


def test_the_best_beams_by_logprob_over_length():
    # (1, EOS) has the best cumulative logprob, ln 0.45, over a length of 5 (prompt 4, EOS not counted): -0.160;
    # (2, 5, 7) has ln 0.38 over 7: -0.138, and ranks first.
    search = BeamSearch(prompt_len=4, width=2, max_tokens=3, eos_token_id=EOS)
    best = run(search)
    assert [tokens for tokens, _ in best] == [[2, 5, 7], [1, EOS]]
    assert [round(search.score(b), 3) for b in search.best()] == [round(math.log(0.38) / 7, 3),
                                                                  round(math.log(0.45) / 5, 3)]


def test_length_penalty_zero_ranks_by_logprob_alone_and_ignore_eos_keeps_beams_alive():
    # Divided by length ** 0, scores are the cumulative logprobs.
    search = BeamSearch(prompt_len=4, width=3, max_tokens=2, eos_token_id=EOS, length_penalty=0.0)
    assert [tokens for tokens, _ in run(search)] == [[1, EOS], [2, 5], [3, 6]]
    assert search.complete and search.complete[0].finished
    search = BeamSearch(prompt_len=4, width=2, max_tokens=2, eos_token_id=EOS, ignore_eos=True)
    run(search)
    assert not search.complete and [b.tokens for b in search.live] == [[1, EOS], [2, 5]]


def test_a_candidate_listed_twice_counts_once_and_the_search_stops_without_live_beams():
    search = BeamSearch(prompt_len=1, width=1, max_tokens=5, eos_token_id=EOS)
    search.advance([[(EOS, -0.1), (EOS, -0.1)]])  # the sampled token is also among the top ones
    assert search.done and len(search.complete) == 1 and search.steps == 1
