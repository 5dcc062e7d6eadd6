"""Built-in engines for the contract tests: started together once a session with the launcher, stopped at
the end.

- `engine_url`: metrics on, `--max-running-requests 2`, launch version `"0"` (what the launcher passes),
  and SGLang's gRPC scheduler service at `engine_grpc_target`.
- `plain_engine_url`: metrics off, SGLang's launch label `"default"`, and `/get_weight_version` answering
  200 like older SGLang servers do. No test changes its weights or version.

Both serve the tiny random Llama of the root conftest. Tests that change `engine_url`'s weights push every
tensor they depend on, so each starts from weights it knows. Tests that take `connect` run once per
generation transport (`http`, `grpc`): `connect()` gives a client of `engine_url` generating over it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Generator
from pathlib import Path

import httpx
import pytest

from asyncrl_sglang.client import SGLangClient
from asyncrl_sglang.grpc_client import GrpcSGLangClient
from asyncrl_sglang.launcher import LaunchedEngines, builtin_command, free_port, pick_ports, start_engines

TRANSPORTS = ("http", "grpc")


@pytest.fixture(scope="session")
def launched_engines(
    tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Generator[LaunchedEngines]:
    common = {"model_path": str(tiny_llama_path), "host": "127.0.0.1", "max_running_requests": 2}
    http_port, grpc_port = pick_ports("127.0.0.1", 2, None)
    engine = builtin_command(
        port=http_port, grpc_port=grpc_port, enable_metrics=True, extra_args={"num_threads": 1}, **common
    )
    plain = builtin_command(
        port=free_port(),
        enable_metrics=False,
        extra_args={"num_threads": 1, "weight_version": "default", "weight_version_route": "old"},
        **common,
    )
    log_dir = tmp_path_factory.mktemp("engine-logs")
    with start_engines([engine, plain], log_dir=log_dir, health_timeout_s=240.0) as launched:
        yield launched


@pytest.fixture(scope="session")
def engine_urls(launched_engines: LaunchedEngines) -> tuple[str, str]:
    return launched_engines.urls[0], launched_engines.urls[1]


@pytest.fixture(scope="session")
def engine_log_path(launched_engines: LaunchedEngines) -> Path:
    """The output of the `engine_url` engine (its logging included)."""
    return launched_engines.processes[0].log_path


@pytest.fixture(scope="session")
def engine_grpc_target(launched_engines: LaunchedEngines) -> str:
    target = launched_engines.grpc_targets[0]
    assert target is not None
    return target


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def connect(engine_url: str, engine_grpc_target: str, transport: str) -> Callable[[], SGLangClient]:
    """A factory of clients of `engine_url` generating over `transport` (control always over HTTP)."""

    def make() -> SGLangClient:
        if transport == "grpc":
            return GrpcSGLangClient(engine_url, engine_grpc_target)
        return SGLangClient(engine_url)

    return make


@pytest.fixture(scope="session")
def engine_url(engine_urls: tuple[str, str]) -> str:
    return engine_urls[0]


@pytest.fixture(scope="session")
def plain_engine_url(engine_urls: tuple[str, str]) -> str:
    return engine_urls[1]


@pytest.fixture
async def client(engine_url: str) -> AsyncGenerator[SGLangClient]:
    async with SGLangClient(engine_url) as sglang_client:
        yield sglang_client


@pytest.fixture
async def http(engine_url: str) -> AsyncGenerator[httpx.AsyncClient]:
    """Raw HTTP to the `engine_url` engine, for checking response shapes exactly."""
    async with httpx.AsyncClient(base_url=engine_url, timeout=120.0, trust_env=False) as raw:
        yield raw
