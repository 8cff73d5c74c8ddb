"""A tokenizer seen so that IncrementalDetokenizer takes one path or another: its tests run every path, and
bench/detokenize.py times them side by side."""
from __future__ import annotations


class WindowOnly:
    """The tokenizer without its Rust backend in sight: the detokenizer's Python window does all the work."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "backend_tokenizer":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __len__(self):
        return len(self.inner)


class StreamOnly(WindowOnly):
    """The tokenizer with a decoder that decodes the same but is not byte-level alone: no byte table, so the
    tokenizers library's DecodeStream does the work."""

    def __init__(self, inner):
        from tokenizers import Tokenizer, decoders

        super().__init__(inner)
        self.backend_tokenizer = Tokenizer.from_str(inner.backend_tokenizer.to_str())
        self.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteLevel()])
