"""Beam search as vLLM runs it: over the engine, one token at a time, each live beam a one-token request whose
logprobs give its candidates (prefix caching keeps the shared prefix from being recomputed).

Each step every live beam is extended by each of its candidates (the model's 2 x width most likely next tokens,
and the one it sampled); a candidate ending in EOS (unless ignore_eos) is complete, and the best `width` of the
rest live on. After max_tokens steps, or when no beam lives, the complete and live beams are ranked by their
cumulative logprob over their length (prompt included, a final EOS not) to the power length_penalty.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import SampledToken

# Each beam's candidates are the top 2 x width logprobs of one token, which the API bounds at 20.
MAX_BEAM_WIDTH = 10


@dataclass
class BeamSearchParams:
    """vLLM's, for LLM.beam_search."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    """One beam, as vLLM's LLM.beam_search gives it: tokens are the prompt's and the beam's, text the beam's
    (without a final EOS)."""
    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: str  # "stop": EOS ended it; "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class Beam:
    tokens: list[int]  # generated so far
    cumulative_logprob: float = 0.0
    finished: bool = False  # ended by EOS


@dataclass
class BeamSearch:
    prompt_len: int
    width: int
    max_tokens: int
    eos_token_id: int | None
    length_penalty: float = 1.0
    ignore_eos: bool = False
    live: list[Beam] = field(default_factory=lambda: [Beam([])])
    complete: list[Beam] = field(default_factory=list)
    steps: int = 0

    @property
    def num_candidates(self) -> int:
        """The top logprobs each expansion asks for."""
        return 2 * self.width

    def step_params(self, temperature: float) -> SamplingParams:
        """What each live beam's one-token request runs with."""
        return SamplingParams(temperature=temperature, max_tokens=1, ignore_eos=True, logprobs=self.num_candidates)

    def advance_sampled(self, tokens: list[SampledToken]) -> None:
        """advance() with each live beam's sampled token, whose top logprobs are its candidates."""
        self.advance([[(t.token_id, t.logprob), *zip(t.top_token_ids, t.top_logprobs)] for t in tokens])

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.max_tokens

    def advance(self, candidates: list[list[tuple[int, float]]]) -> None:
        """candidates[i]: (token id, logprob) of the next tokens of self.live[i]."""
        extended = []
        for beam, options in zip(self.live, candidates, strict=True):
            for token_id, logprob in dict(options).items():
                child = Beam(beam.tokens + [token_id], beam.cumulative_logprob + logprob)
                if token_id == self.eos_token_id and not self.ignore_eos:
                    child.finished = True
                    self.complete.append(child)
                else:
                    extended.append(child)
        self.live = sorted(extended, key=self.score, reverse=True)[:self.width]
        self.steps += 1

    def best(self) -> list[Beam]:
        return sorted(self.complete + self.live, key=self.score, reverse=True)[:self.width]

    def score(self, beam: Beam) -> float:
        length = self.prompt_len + len(beam.tokens) - (1 if beam.finished else 0)
        return beam.cumulative_logprob / (length ** self.length_penalty)
