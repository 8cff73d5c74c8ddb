"""A reasoning model's thinking, split from its answer as vLLM's --reasoning-parser splits it: the text between
<think> and </think> (or the parser's own tags) is the message's `reasoning`, the rest its `content`, whole or as
the text streams.

- qwen3: the answer thinks only where it opens with <think> (Qwen3 with enable_thinking, QwQ); an answer that does
  not is all content.
- deepseek_r1: the template opens <think> in the prompt, so the answer starts in its thinking (a <think> it writes
  anyway is dropped) and thinks until </think>; cut short before it, it is all reasoning.
- mistral: as qwen3 with [THINK] and [/THINK] (Magistral), which are special tokens in its vocabulary: the
  answer's text keeps special tokens for this parser to see them.

One state machine serves both the whole text and its stream, so that the pieces add up to the whole split."""
from __future__ import annotations

from frontend.tools import partial_suffix

# parser -> (opening tag, closing tag, what an answer that does not open with the tag is)
TAGS = {"qwen3": ("<think>", "</think>", "content"), "deepseek_r1": ("<think>", "</think>", "reasoning"),
        "mistral": ("[THINK]", "[/THINK]", "content")}
REASONING_PARSERS = tuple(TAGS)
# Parsers whose tags are special tokens, which the answer's text would otherwise leave out.
KEEPS_SPECIAL_TOKENS = frozenset({"mistral"})


class ReasoningSplit:
    """Feeds one answer's text as it comes; each feed returns the (reasoning, content) it can now tell apart,
    holding back a tail that may be the start of a tag."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, got {parser!r}")
        # Before the answer shows whether it opens with its tag: where it does not, it is content (qwen3) or
        # reasoning all the same (deepseek_r1).
        self.start, self.end, self.without_start = TAGS[parser]
        self.mode = "opening"
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        while True:
            if self.mode == "opening":
                stripped = self.held.lstrip()
                if stripped.startswith(self.start):
                    self.held, self.mode = stripped[len(self.start):], "reasoning"
                elif self.start.startswith(stripped):  # (empty, or the tag's beginning): not known yet
                    return reasoning, content
                else:
                    self.mode = self.without_start
            elif self.mode == "reasoning":
                end = self.held.find(self.end)
                if end >= 0:
                    reasoning += self.held[:end]
                    self.held, self.mode = self.held[end + len(self.end):], "content"
                    continue
                keep = partial_suffix(self.held, self.end)
                reasoning += self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                return reasoning, content
            else:
                content += self.held
                self.held = ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the answer's end."""
        held, self.held = self.held, ""
        if self.mode == "reasoning" or (self.mode == "opening" and self.without_start == "reasoning"):
            return held, ""
        return "", held


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    split = ReasoningSplit(parser)
    reasoning, content = split.feed(text)
    more_reasoning, more_content = split.finish()
    return (reasoning + more_reasoning) or None, content + more_content


class ReasoningStream:
    """The split of each choice of a streamed answer."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.splits: dict[int, ReasoningSplit] = {}

    def feed(self, index: int, text: str, finished: bool) -> tuple[str, str]:
        split = self.splits.setdefault(index, ReasoningSplit(self.parser))
        reasoning, content = split.feed(text)
        if finished:
            more_reasoning, more_content = split.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
            del self.splits[index]
        return reasoning, content
