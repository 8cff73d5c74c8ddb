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

A byte-level BPE tokenizer (GPT-2's decoder: Llama 3, Qwen, SmolLM) needs no window at all: its text is the
UTF-8 decode of the concatenation of each token's bytes, whatever came before. So each token's bytes are
looked up in a table made once per tokenizer (and checked against its own decode of the whole vocabulary), and
only the bytes of a character still incomplete are held back: a token costs a lookup, a sixth of DecodeStream's.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel, DecodeStream

logger = logging.getLogger(__name__)

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
        self._backend = _fast_backend(tokenizer)
        self._stream: DecodeStream | None = None
        # The byte-level path: the table, and the bytes of an incomplete character held back.
        self._token_bytes: TokenBytes | None = None
        self._held = b""
        if self._backend is not None:
            # Byte-level text does not depend on what came before it: the prompt's context plays no part.
            self._token_bytes = token_bytes(self._backend, skip_special_tokens)
            if self._token_bytes is None:
                self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
                if self._ids and not self._step(self._ids)[1]:
                    self._stream = None

    def add_tokens(self, token_ids: list[int]) -> str:
        """Appends output tokens and returns the text they complete (possibly empty)."""
        if not token_ids:
            return ""
        if self._token_bytes is not None:
            return self._add_bytes(token_ids)
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

    def _add_bytes(self, token_ids: list[int]) -> str:
        table = self._token_bytes
        if not self._held and len(token_ids) == 1:
            text = table.text(token_ids[0])
            if text is not None:
                return text
        held = self._held + b"".join(table.bytes(token_id) for token_id in token_ids)
        text = held.decode("utf-8", "replace")
        # The tail may be a character whose remaining bytes are still to come: wait for them, as the window
        # does, rather than emit U+FFFD and then the character.
        if text.endswith(_REPLACEMENT_CHAR):
            self._held = held
            return ""
        self._held = b""
        return text

    def finish(self) -> str:
        """Returns whatever is still held back: an incomplete character at the end of the output."""
        if self._token_bytes is not None:
            held, self._held = self._held, b""
            return held.decode("utf-8", "replace")
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


def _fast_backend(tokenizer: Any) -> Tokenizer | None:
    """The tokenizers library's tokenizer behind `tokenizer`, where its decode is that library's alone (not
    followed by a clean-up of spaces around punctuation, which neither DecodeStream nor the table does)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend
    return None


def token_utf8(tokenizer: Any, token_id: int) -> bytes | None:
    """The UTF-8 bytes a byte-level BPE token stands for, a part of a character included (what OpenAI's logprobs
    report as its bytes, which its decoded text, a replacement character, would lose); None for another kind of
    tokenizer."""
    backend = _fast_backend(tokenizer)
    table = token_bytes(backend, False) if backend is not None else None
    return None if table is None else table.bytes(token_id)


def prepare(tokenizer: Any) -> None:
    """Makes the tokenizer's byte-level tables now (a tenth of a second each) rather than in its first call."""
    backend = _fast_backend(tokenizer)
    if backend is not None:
        for skip_special_tokens in (True, False):
            token_bytes(backend, skip_special_tokens)


@dataclass(frozen=True, slots=True)
class TokenBytes:
    """Each token id's bytes in a byte-level BPE tokenizer's output, and its text where those bytes are whole
    characters on their own (None where not: they need their neighbours)."""

    token_bytes: tuple[bytes, ...]
    token_text: tuple[str | None, ...]

    def bytes(self, token_id: int) -> bytes:
        # An id the tokenizer does not know decodes to nothing, as in its own decode.
        return self.token_bytes[token_id] if 0 <= token_id < len(self.token_bytes) else b""

    def text(self, token_id: int) -> str | None:
        return self.token_text[token_id] if 0 <= token_id < len(self.token_text) else ""


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (the characters byte-level BPE vocabularies are spelt in)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(moved)}


@functools.lru_cache(maxsize=8)
def token_bytes(backend: Tokenizer, skip_special_tokens: bool) -> TokenBytes | None:
    """The table of a tokenizer whose decoder is byte-level alone, or None (another decoder, or a table that
    disagrees with the tokenizer's own decode, which then does the work)."""
    if not isinstance(backend.decoder, ByteLevel):
        return None
    alphabet = _byte_level_alphabet()
    special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
    size = backend.get_vocab_size(with_added_tokens=True)
    table = []
    for token_id in range(size):
        token = backend.id_to_token(token_id)
        if token is None or (skip_special_tokens and token_id in special):
            table.append(b"")
        elif all(char in alphabet for char in token):
            table.append(bytes(alphabet[char] for char in token))
        else:  # as the decoder does with a token spelt outside the alphabet (an added token with a space)
            table.append(token.encode())
    # The whole vocabulary, a stretch at a time, decoded both ways: any difference and the table is not used.
    stretch = 256
    for start in range(0, size, stretch):
        ids = list(range(start, min(start + stretch, size)))
        if b"".join(table[start:start + stretch]).decode("utf-8", "replace") != backend.decode(
                ids, skip_special_tokens=skip_special_tokens):
            logger.warning("the tokenizer's byte-level table disagrees with its decode at ids %d-%d; "
                           "detokenizing with its DecodeStream instead", ids[0], ids[-1])
            return None
    texts = []
    for data in table:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        texts.append(None if text is not None and text.endswith(_REPLACEMENT_CHAR) else text)
    return TokenBytes(tuple(table), tuple(texts))
