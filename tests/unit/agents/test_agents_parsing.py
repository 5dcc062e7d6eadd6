"""Tool-call parsing on nasty model outputs: unclosed tags, several tags, tags inside answers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl_agents.parsing import TagParser
from asyncrl_core.types import FinalAnswer, InvalidTurn, ToolCall

PARSER = TagParser({"search": "search"}, answer_tag="answer")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>hmm</think>\n<search> capital of France </search>", ToolCall("search", "capital of France")),
        ("<answer> Paris </answer>", FinalAnswer("Paris")),
        ("<answer>\n  Paris\n</answer><|im_end|>", FinalAnswer("Paris")),
        # Several tags: the first to close wins (generation stops there).
        ("<search>a</search><search>b</search>", ToolCall("search", "a")),
        ("<search>a</search> then <answer>b</answer>", ToolCall("search", "a")),
        ("<answer>b</answer> then <search>a</search>", FinalAnswer("b")),
        # A search tag opened inside an unclosed answer: the search closed first.
        ("<answer>maybe <search>x</search>", ToolCall("search", "x")),
        # Tags inside an answer are part of its text.
        ("<answer>a <b>bold</b> claim</answer>", FinalAnswer("a <b>bold</b> claim")),
        ("<answer>x < y and y > z</answer>", FinalAnswer("x < y and y > z")),
        # Restarted tag: the innermost complete pair.
        ("<answer>draft <answer>final</answer>", FinalAnswer("final")),
        ("<search>one <search>two</search>", ToolCall("search", "two")),
        # Text after the stop (a stop string ending inside a token) is ignored.
        ("<search>q</search>\n\n", ToolCall("search", "q")),
        ("<search >q</search >", ToolCall("search", "q")),
    ],
)
def test_actions(text: str, expected: object) -> None:
    assert PARSER.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("I will search <search> unfinished", "<search> is never closed"),
        ("<answer> Paris", "<answer> is never closed"),
        ("no tags at all", "no action"),
        ("", "no action"),
        ("<search></search>", "empty <search>"),
        ("<answer>   </answer>", "empty <answer>"),
        ("just text </search>", "</search> without <search>"),
        ("<Search>x</Search>", "no action"),
        ("<search>x</answer>", "</answer> without <answer>"),
    ],
)
def test_invalid_turns(text: str, reason: str) -> None:
    parsed = PARSER.parse(text)
    assert isinstance(parsed, InvalidTurn)
    assert reason in parsed.reason


def test_stop_strings_are_the_closing_tags() -> None:
    assert PARSER.stop == ("</search>", "</answer>")


def test_tag_names_are_checked() -> None:
    with pytest.raises(ValueError, match="plain name"):
        TagParser({"se arch": "search"})
    with pytest.raises(ValueError, match="both"):
        TagParser({"answer": "search"})


PIECES = st.sampled_from([*"ab <>/\n", "<search>", "</search>", "<answer>", "</answer>"])


@given(st.lists(PIECES, max_size=30).map("".join))
def test_any_text_parses_to_an_action_whose_content_was_in_the_text(text: str) -> None:
    parsed = PARSER.parse(text)
    if isinstance(parsed, ToolCall):
        assert "<search>" in text
        assert parsed.arguments in text
        assert parsed.arguments
        assert parsed.arguments == parsed.arguments.strip()
    elif isinstance(parsed, FinalAnswer):
        assert "</answer>" in text
        assert parsed.text in text
        assert parsed.text
    else:
        assert isinstance(parsed, InvalidTurn)
        assert parsed.reason
