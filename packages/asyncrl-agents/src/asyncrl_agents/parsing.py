"""Parsing of a model turn written with XML-like tags (`<search> q </search>`, `<answer> a </answer>`).

The rule is "the first tag to close wins": the action is the tag whose closing tag appears earliest in the
turn, paired with the nearest opening tag before it. Generation of a turn stops at the first closing tag (the
task's stop strings), so this is the tag the engine stopped on; when an engine does not stop (or a stop string
ends inside a longer token), text after the first action is ignored, exactly as the tokens after it are kept
but not acted on. Everything else is an `InvalidTurn` with a reason a log reader understands.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from asyncrl_core.types import FinalAnswer, InvalidTurn, ToolCall, TurnAction


class TagParser:
    """Turns one model turn into a `ToolCall`, a `FinalAnswer` or an `InvalidTurn`.

    `tool_tags` maps a tag name to the tool it calls (`{"search": "search"}`); `answer_tag` names the final
    answer's tag. Content is stripped of surrounding whitespace; an empty call or answer is invalid.
    """

    def __init__(self, tool_tags: Mapping[str, str], answer_tag: str = "answer") -> None:
        tags = [*tool_tags, answer_tag]
        for tag in tags:
            if not re.fullmatch(r"[A-Za-z_][\w-]*", tag):
                raise ValueError(f"tag {tag!r} is not a plain name (letters, digits, `_`, `-`)")
        if answer_tag in tool_tags:
            raise ValueError(f"tag {answer_tag!r} is both a tool tag and the answer tag")
        self.tool_tags = dict(tool_tags)
        self.answer_tag = answer_tag
        alternatives = "|".join(re.escape(tag) for tag in tags)
        self._closing = re.compile(rf"</({alternatives})\s*>")
        self._opening = re.compile(rf"<({alternatives})\s*>")

    @property
    def stop(self) -> tuple[str, ...]:
        """The closing tags, as the stop strings that end a turn."""
        return tuple(f"</{tag}>" for tag in (*self.tool_tags, self.answer_tag))

    def parse(self, text: str) -> TurnAction:
        closing = self._closing.search(text)
        if closing is None:
            opened = self._opening.search(text)
            if opened is not None:
                return InvalidTurn(f"<{opened.group(1)}> is never closed")
            names = ", ".join(f"<{tag}>" for tag in (*self.tool_tags, self.answer_tag))
            return InvalidTurn(f"no action: expected one of {names}")
        tag = closing.group(1)
        # The nearest opening of the same tag before the closing one: in `<answer>a <answer>b</answer>` the
        # answer is `b`, the innermost complete pair.
        openings = [m for m in self._opening.finditer(text, 0, closing.start()) if m.group(1) == tag]
        if not openings:
            return InvalidTurn(f"</{tag}> without <{tag}>")
        content = text[openings[-1].end() : closing.start()].strip()
        if not content:
            return InvalidTurn(f"empty <{tag}>")
        if tag == self.answer_tag:
            return FinalAnswer(content)
        return ToolCall(self.tool_tags[tag], content)
