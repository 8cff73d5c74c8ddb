"""Structured output in the executor: a grammar matcher per request that follows its output tokens and
gives the sampler the tokens it may pick next, as xgrammar's token bitmask.

The matcher lives here because the executor samples: it sees every output token of its request (the
newest one arrives as the next step's input, before that step samples). A request the scheduler preempts
comes back with fresh sampling parameters, so its matcher is built again and fed the tokens it had, which
the grammar allowed the first time: the state after a recompute is the state before it.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# response_format json_object: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarError(ValueError):
    """The request's schema cannot be compiled into a grammar."""


class StructuredOutput:
    """Compiles grammars (each schema once) and builds matchers. The tokenizer and the compiler load on the
    first structured request, so a server that never sees one never pays for them."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir, self.vocab_size, self.eos_token_ids = model_dir, vocab_size, eos_token_ids
        self._compiler = None

    def _grammar_compiler(self):
        if self._compiler is None:
            import xgrammar
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids))
            # The compiler caches compiled grammars by their source, so a schema repeated costs nothing.
            self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler

    def matcher(self, params: SamplingParams):
        import xgrammar

        compiler = self._grammar_compiler()
        try:
            # No free whitespace between tokens: a sampled model could otherwise pad the JSON with blank
            # lines until max_tokens cuts it short of valid.
            compiled = compiler.compile_json_schema(JSON_OBJECT_SCHEMA if params.json_object else params.json_schema,
                                                    any_whitespace=False)
        except RuntimeError as error:
            raise GrammarError(f"json_schema cannot be compiled: {error}".strip()) from None
        return xgrammar.GrammarMatcher(compiled)

    def bitmask(self, batch_size: int, rows: list[int], matchers: list) -> torch.Tensor:
        """[batch_size, ceil(V / 32)] int32: row rows[i] holds what matchers[i] allows; other rows untouched."""
        import xgrammar

        mask = xgrammar.allocate_token_bitmask(batch_size, self.vocab_size)
        for row, matcher in zip(rows, matchers):
            matcher.fill_next_token_bitmask(mask, row)
        return mask

