"""A reasoning model's thinking split from its answer (frontend/reasoning.py), whole and streamed."""
from __future__ import annotations

import dataclasses

import pytest

from frontend.reasoning import REASONING_PARSERS, ReasoningStream, split_reasoning
from frontend.tools import TOOL_CALL_PARSERS
from pagedserve.config import ServingConfig

CASES = [
    # (parser, answer, reasoning, content)
    ("qwen3", "<think>\nIt is Paris.\n</think>\n\nParis.", "\nIt is Paris.\n", "\n\nParis."),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "Paris.", None, "Paris."),  # no thinking: all content
    ("qwen3", "Paris, not <think>x</think>", None, "Paris, not <think>x</think>"),  # only an opening tag counts
    ("qwen3", "<think>cut short", "cut short", ""),
    ("qwen3", "<thi", None, "<thi"),
    ("deepseek_r1", "The user asks... </think>Paris.", "The user asks... ", "Paris."),
    ("deepseek_r1", "<think>hm</think>Paris.", "hm", "Paris."),
    ("deepseek_r1", "still thinking when cut", "still thinking when cut", ""),
    ("deepseek_r1", "", None, ""),
    ("mistral", "[THINK]Paris, surely.[/THINK]Paris.", "Paris, surely.", "Paris."),
    ("mistral", "Paris.", None, "Paris."),
    ("mistral", "Paris <think>no</think>", None, "Paris <think>no</think>"),  # another family's tags are text
    ("mistral", "[THINK]cut [/THI", "cut [/THI", ""),
]


@pytest.mark.parametrize(("parser", "answer", "reasoning", "content"), CASES)
def test_the_whole_answer_splits_at_the_tags(parser, answer, reasoning, content):
    assert split_reasoning(parser, answer) == (reasoning, content)


@pytest.mark.parametrize(("parser", "answer", "reasoning", "content"), CASES)
def test_streamed_pieces_add_up_to_the_whole_split_wherever_the_text_breaks(parser, answer, reasoning, content):
    for cut in range(len(answer) + 1):
        for pieces in ([answer[:cut], answer[cut:]], [answer[:cut], *answer[cut:]]):
            stream = ReasoningStream(parser)
            split = [stream.feed(0, piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
            assert "".join(r for r, _ in split) == (reasoning or "")
            assert "".join(c for _, c in split) == content


def test_the_parsers_the_config_offers_are_the_ones_there_are():
    fields = {f.name: f for f in dataclasses.fields(ServingConfig)}
    assert fields["reasoning_parser"].metadata["choices"] == REASONING_PARSERS
    assert fields["tool_call_parser"].metadata["choices"] == tuple(TOOL_CALL_PARSERS)


@pytest.mark.parametrize(("parser", "keeps"), [("mistral", True), ("qwen3", False)])
def test_a_parser_whose_tags_are_special_tokens_keeps_them_in_the_text_it_reads(parser, keeps):
    from frontend.http_server import OpenAIServer
    from frontend.validation import GenerateInput
    from tests.support.http_app import CharTokenizer, NoLink

    server = OpenAIServer(NoLink(), CharTokenizer(), ("m",), max_model_len=64, vocab_size=256, max_prompt_chars=100,
                          reasoning_parser=parser)
    free, constrained = GenerateInput(request_id="a"), GenerateInput(request_id="b", json_object=True)
    assert server._reasoning_parser(free) == parser and free.skip_special_tokens is not keeps
    assert server._reasoning_parser(constrained) is None and constrained.skip_special_tokens  # no room to think
