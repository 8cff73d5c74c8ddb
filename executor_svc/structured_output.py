"""Structured output in the executor: a grammar matcher per request that follows its output tokens and
gives the sampler the tokens it may pick next, as xgrammar's token bitmask.

The matcher lives here because the executor samples: it sees every output token of its request (the
newest one arrives as the next step's input, before that step samples). A request the scheduler preempts
comes back with fresh sampling parameters, so its matcher is built again and fed the tokens it had, which
the grammar allowed the first time: the state after a recompute is the state before it.

Grammars compile on a thread of their own, never inside a step: a request's grammar starts compiling when
the executor first sees the request, and a request whose grammar is not ready when it reaches its
sampling position is deferred (not sampled this step) rather than holding up everyone else's step.
Compiled grammars are kept by their source, so a repeated schema compiles once.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# response_format json_object: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Compiled grammars kept, by kind and source: a schema's token masks take from kilobytes to a few megabytes.
MAX_CACHED_GRAMMARS = 256


class GrammarError(ValueError):
    """The request's schema cannot be compiled into a grammar."""


class RequestGrammar:
    """A request's grammar matcher, once its grammar has compiled: output tokens that come before that are
    kept, and fed to the matcher when it is built."""

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled
        self.matcher = None  # xgrammar.GrammarMatcher
        self.pending: list[int] = []

    def follow(self, request_id: str, token_ids: list[int]) -> None:
        if self.matcher is None:
            self.pending += token_ids
            return
        for token in token_ids:
            if self.matcher.is_terminated():  # (its stop token came: nothing follows the grammar)
                break
            if not self.matcher.accept_token(token):
                logger.warning("request %s: token %d is outside its grammar", request_id, token)

    def ready(self, request_id: str, wait: bool = False) -> bool:
        """Whether the matcher can mask this step (wait: block until the grammar has compiled); raises
        GrammarError when it did not compile."""
        if self.matcher is None:
            if not (wait or self.compiled.done()):
                return False
            import xgrammar

            self.matcher = xgrammar.GrammarMatcher(self.compiled.result())
            pending, self.pending = self.pending, []
            self.follow(request_id, pending)
        return True


class StructuredOutput:
    """Compiles grammars on a background thread, each source once, and builds the requests' matchers. The
    tokenizer and the compiler load with the first structured request, on that thread too, so a server that
    never sees one never pays for them."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir, self.vocab_size, self.eos_token_ids = model_dir, vocab_size, eos_token_ids
        self._compiler = None
        # One thread: xgrammar spreads a compilation over threads of its own.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        # By (kind, source), least recently used first.
        self._grammars: OrderedDict[tuple[str, str], Future] = OrderedDict()

    def _grammar_compiler(self):
        if self._compiler is None:
            import xgrammar
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids))
            # Compiled grammars are cached here (self._grammars), with a bound; not a second time in xgrammar.
            self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        return self._compiler

    def _compile(self, kind: str, source: str):
        compiler = self._grammar_compiler()
        try:
            if kind == "regex":
                return compiler.compile_regex(source)
            if kind == "ebnf":
                return compiler.compile_grammar(source)
            # No free whitespace between tokens: a sampled model could otherwise pad the JSON with blank
            # lines until max_tokens cuts it short of valid.
            return compiler.compile_json_schema(JSON_OBJECT_SCHEMA if kind == "json_object" else source,
                                                any_whitespace=False)
        except RuntimeError as error:
            raise GrammarError(f"{kind} cannot be compiled: {error}".strip()) from None

    def grammar(self, params: SamplingParams) -> RequestGrammar:
        """A new request's grammar state; its grammar compiles in the background unless it already has."""
        source = params.grammar_source()
        compiled = self._grammars.get(source)
        if compiled is None:
            compiled = self._grammars[source] = self._pool.submit(self._compile, *source)
            if len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(source)
        return RequestGrammar(compiled)

    def bitmask(self, batch_size: int, rows: list[int], grammars: list[RequestGrammar]) -> torch.Tensor:
        """[batch_size, ceil(V / 32)] int32: row rows[i] holds what grammars[i] allows; other rows untouched."""
        import xgrammar

        mask = xgrammar.allocate_token_bitmask(batch_size, self.vocab_size)
        for row, grammar in zip(rows, grammars):
            grammar.matcher.fill_next_token_bitmask(mask, row)
        return mask
