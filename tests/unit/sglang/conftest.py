"""Fixtures shared by the built-in engine's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncrl_sglang.builtin.engine import Engine


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test starts (it appends them); each is stopped when the test ends."""
    started: list[Engine] = []
    yield started
    for engine in started:
        engine.stop()
