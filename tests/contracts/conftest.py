"""Built-in engines for the contract tests: started once a session with the launcher, stopped at the end.

- `engine_url`: metrics on, `--max-running-requests 2`, launch version `"default"` (SGLang's default label).
- `plain_engine_url`: metrics off, launch version `"7"`, and `/get_weight_version` answering 200 like older
  SGLang servers do.

Both serve the tiny random Llama of the root conftest. Tests that change an engine's weights push every
parameter, so each starts from weights it knows.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator
from pathlib import Path

import httpx
import pytest

from asyncrl_sglang.client import SGLangClient
from asyncrl_sglang.launcher import LaunchedEngines, builtin_command, free_port, start_engines


def _start(
    model_path: Path, log_dir: Path, *, enable_metrics: bool, **extra: str | int | bool
) -> LaunchedEngines:
    command = builtin_command(
        model_path=str(model_path),
        host="127.0.0.1",
        port=free_port(),
        max_running_requests=2,
        enable_metrics=enable_metrics,
        extra_args={"num_threads": 1, **extra},
    )
    return start_engines([command], log_dir=log_dir, health_timeout_s=240.0)


@pytest.fixture(scope="session")
def engine_url(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Generator[str]:
    launched = _start(
        tiny_llama_path, tmp_path_factory.mktemp("engine-logs"), enable_metrics=True, weight_version="default"
    )
    with launched:
        yield launched.urls[0]


@pytest.fixture(scope="session")
def plain_engine_url(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Generator[str]:
    launched = _start(
        tiny_llama_path,
        tmp_path_factory.mktemp("plain-engine-logs"),
        enable_metrics=False,
        weight_version="7",
        weight_version_route="old",
    )
    with launched:
        yield launched.urls[0]


@pytest.fixture
async def client(engine_url: str) -> AsyncGenerator[SGLangClient]:
    async with SGLangClient(engine_url) as sglang_client:
        yield sglang_client


@pytest.fixture
async def http(engine_url: str) -> AsyncGenerator[httpx.AsyncClient]:
    """Raw HTTP to the `engine_url` engine, for checking response shapes exactly."""
    async with httpx.AsyncClient(base_url=engine_url, timeout=120.0, trust_env=False) as raw:
        yield raw
