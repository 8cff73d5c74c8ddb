"""Turning a stream of output token ids into a stream of text deltas, one step at a time.

Decoding a token on its own is wrong in general: a multi-byte UTF-8 character may be split over
several byte-level tokens, and SentencePiece decoders drop the leading space of whichever token comes
first. So, as vLLM does, each step decodes a short window of ids (a few already-emitted tokens for
context, then the unemitted ones) and emits what the window gained over its context part:

    ids:   ... | prefix_offset ... read_offset | read_offset ... end |
                 context, already emitted         new, not yet emitted

The window moves forward whenever text is emitted, so a step costs O(window), not O(sequence).

With a fast (Rust) tokenizer the same algorithm runs inside the tokenizers library (its DecodeStream), at
about a tenth of the cost of the two Python-level decodes per step: at hundreds of streams the frontend spends
most of its time here. The Python window stays in step with it, for finish() and for tokenizers it cannot
serve (slow ones, and those that clean up spaces around punctuation after decoding, which it does not do).
"""
from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens decoded as context before the first output token (vLLM uses 5 too).
_PROMPT_CONTEXT_TOKENS = 5
# What a decoder yields for an incomplete or invalid UTF-8 sequence.
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Feed output token ids with ``add_tokens``; the deltas, then ``finish()``, add up to the text.

    With an empty prompt the concatenation equals ``tokenizer.decode(output_ids,
    skip_special_tokens=...)``. With a prompt it is the text the output adds to the prompt's: the same
    for byte-level BPE, and for SentencePiece it keeps the output's leading space, which decoding the
    output ids on their own would strip.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only the prompt's tail matters as context, so the rest is not kept.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if self._decode(self._ids).endswith(_REPLACEMENT_CHAR):
            # A token-id prompt cut mid-character would merge with the output's first bytes; decode
            # the output on its own instead, as the caller will.
            self._ids = []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: DecodeStream | None = None
        if isinstance(self._backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            if self._ids and not self._step(self._ids)[1]:
                self._stream = None

    def add_tokens(self, token_ids: list[int]) -> str:
        """Appends output tokens and returns the text they complete (possibly empty)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        if self._stream is not None:
            delta, ok = self._step(token_ids)
            if ok:
                if delta:
                    self._advance()
                return delta
        return self._emit(final=False)

    def _step(self, token_ids: list[int]) -> tuple[str, bool]:
        """The stream's text for these tokens, and False (the stream dropped for good) if it refused them."""
        try:
            return self._stream.step(self._backend, token_ids) or "", True
        except Exception:  # its prefix check failed: the Python window, kept in step, carries on
            self._stream = None
            return "", False

    def finish(self) -> str:
        """Returns whatever is still held back: an incomplete character at the end of the output."""
        if self._read_offset == len(self._ids):
            return ""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        # Nothing new (a skipped special token), or the tail is a character whose remaining bytes are
        # still to come: wait, widening the window, rather than emit U+FFFD and then the character.
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT_CHAR) and not final):
            return ""
        self._advance()
        return new_text[len(prefix_text):]

    def _advance(self) -> None:
        """Text was emitted up to the end: the window's context becomes what was new. The ids before it are
        dropped, so that a long output costs neither memory nor copying per step."""
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
