"""Fixtures of the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray instance (2 CPUs, no dashboard) for the module that uses it, stopped at its end. A
    module asks for it with `pytest.mark.usefixtures("local_ray")` in its `pytestmark`."""
    ray = pytest.importorskip("ray")

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()
