"""asyncrl-task-search-probe: `searchr1-mini` where every turn that does not answer searches (tests only)."""

from __future__ import annotations

from typing import ClassVar

from asyncrl_agents.tasks.searchr1 import SearchR1MiniTask
from asyncrl_core.types import InvalidTurn, ToolCall, TurnAction

MAX_QUERY_CHARS = 200
"""Longest query sent: the start of the turn's text, whitespace collapsed."""


class SearchProbeTask(SearchR1MiniTask):
    """`searchr1-mini` (its data, retriever, observations and reward) where a turn that is neither an answer
    nor a search searches anyway, with its own text as the query: every trajectory of any model calls the
    retriever on its first turn."""

    name: ClassVar[str] = "search-probe"  # type: ignore[misc]

    def parse_turn(self, text: str) -> TurnAction:
        action = super().parse_turn(text)
        if isinstance(action, InvalidTurn):
            return ToolCall("search", " ".join(text.split())[:MAX_QUERY_CHARS])
        return action


__all__ = ["SearchProbeTask"]
