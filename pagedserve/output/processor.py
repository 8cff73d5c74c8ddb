"""One request's output, step by step: new token ids in; text delta, finish reason and usage out.

The frontend (per client stream) and the offline ``LLM`` (per request of a batch) both feed every step's
new token ids here, so the two APIs give the same text and the same finish reason for the same tokens.
A stop string is found in text, which only this side has: the scheduler ends a request on EOS, stop
token ids and length, and is told to abort one when a stop string matches here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.output.detokenizer import IncrementalDetokenizer
from pagedserve.output.stop_strings import StopStringMatcher
from pagedserve.sampling_params import SamplingParams


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class OutputDelta:
    text: str  # new text, stop strings trimmed; may be empty while characters are held back
    finish_reason: str | None = None  # set on the last delta: "stop", "length", "abort" or "error"
    usage: Usage | None = None  # set on the last delta
    # A stop string ended the request here, which the scheduler does not know: abort it there, or
    # it keeps generating tokens nobody will see.
    abort: bool = False
    # Of the new token ids fed, how many are output: fewer when a stop string ended the request part-way
    # through them (None: all).
    num_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutputState:
    """Feed each step's ``new_token_ids`` (and the scheduler's finish reason) to ``update``.

    Completion tokens are counted as fed, so after a stop-string match they are the tokens up to and
    including the one that completed it. Without a tokenizer (a checkpoint given as token ids only)
    the text stays empty and stop strings are refused. As vLLM: the token that stopped the request (EOS or a
    stop token id) counts but adds no text unless include_stop_str_in_output; stop strings are looked for
    from the token after min_tokens on.
    """

    def __init__(self, tokenizer: Any | None, prompt_token_ids: list[int], params: SamplingParams):
        if tokenizer is None and params.stop:
            raise ValueError("stop strings need the model's tokenizer, and this model has none")
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
            if tokenizer is not None else None
        )
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        self.include_stop_token_text = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_output_tokens = 0

    def update(self, new_token_ids: list[int], finish_reason: str | None = None) -> OutputDelta:
        """new_token_ids may hold the tokens of several steps (a reader that fell behind gets them joined):
        with stop strings they are then fed one at a time, so that the request ends at the token that
        completes one, as it would have step by step."""
        if self.stops is None or len(new_token_ids) <= 1:
            return self._update(new_token_ids, finish_reason)
        text = ""
        for i, token_id in enumerate(new_token_ids):
            delta = self._update([token_id], finish_reason if i == len(new_token_ids) - 1 else None)
            text += delta.text
            if delta.finished:
                delta.text, delta.num_tokens = text, i + 1
                return delta
        return OutputDelta(text)

    def _update(self, new_token_ids: list[int], finish_reason: str | None) -> OutputDelta:
        self.num_output_tokens += len(new_token_ids)
        text = ""
        if self.detokenizer is not None:
            shown = new_token_ids
            if finish_reason == "stop" and not self.include_stop_token_text:  # the scheduler's: EOS or a stop id
                shown = new_token_ids[:-1]
            text = self.detokenizer.add_tokens(shown)
            if finish_reason is not None:
                text += self.detokenizer.finish()
        abort = False
        if self.stops is not None and self.num_output_tokens > self.min_tokens:
            text, matched = self.stops.feed(text)
            if matched:
                # Also when the scheduler ended the request in this same step: the text was cut at
                # the stop string, so that is why it ended.
                finish_reason, abort = "stop", True
            elif finish_reason is not None:
                text += self.stops.flush()
        if finish_reason is None:
            return OutputDelta(text)
        return OutputDelta(text, finish_reason, Usage(self.num_prompt_tokens, self.num_output_tokens), abort)
