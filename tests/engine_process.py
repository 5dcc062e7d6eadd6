"""Start a built-in engine server as a subprocess on a free loopback port, for the tests.

    with serve_builtin(model_path, "--enable-metrics", max_running_requests=2) as server:
        httpx.get(f"{server.url}/health")

The server is ready (`/health` is 200) when the block starts and is stopped (SIGTERM, then SIGKILL after
`stop_timeout_s`) when it ends, also on an exception or Ctrl-C. Its output goes to `server.log_path`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

from asyncrl_core.errors import EngineUnavailableError
from asyncrl_core.server_process import ServerProcess, ServerStartError


@dataclass(frozen=True, slots=True)
class BuiltinServerProcess:
    """A running server: its base URL (`http://127.0.0.1:PORT`), process and log file."""

    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def serve_builtin(
    model_path: str | os.PathLike[str],
    *extra_args: str,
    max_running_requests: int | None = None,
    context_length: int | None = None,
    weight_version: str | None = None,
    num_threads: int | None = 1,
    start_timeout_s: float = 300.0,
    stop_timeout_s: float = 15.0,
) -> Generator[BuiltinServerProcess]:
    """Run `python -m asyncrl_engine` on 127.0.0.1 with a free port until the block exits.

    `extra_args` are passed through (e.g. `"--enable-metrics"`, `"--api-key", "k"`). Raises
    `EngineUnavailableError` with the end of the server's log if it exits or is not healthy within
    `start_timeout_s`.
    """
    with tempfile.TemporaryDirectory(prefix="asyncrl-builtin-") as folder:
        port_file = Path(folder) / "port"
        log_path = Path(folder) / "server.log"
        command = [sys.executable, "-m", "asyncrl_engine", "--model-path", str(model_path)]
        command += ["--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)]
        if max_running_requests is not None:
            command += ["--max-running-requests", str(max_running_requests)]
        if context_length is not None:
            command += ["--context-length", str(context_length)]
        if weight_version is not None:
            command += ["--weight-version", weight_version]
        if num_threads is not None:
            command += ["--num-threads", str(num_threads)]
        command += list(extra_args)
        server = ServerProcess(command, log_path, env={"HF_HUB_OFFLINE": "1"}, name="the built-in engine")
        try:
            try:
                deadline = time.monotonic() + start_timeout_s
                port = server.wait_port_file(port_file, start_timeout_s)
                url = f"http://127.0.0.1:{port}"
                server.wait_ready(f"{url}/health", max(1.0, deadline - time.monotonic()))
            except ServerStartError as error:
                raise EngineUnavailableError(str(error)) from None
            yield BuiltinServerProcess(url, port, server.process, log_path)
        finally:
            server.stop(stop_timeout_s)
            # Keep the log readable after the folder is gone (a failing test prints it).
            with contextlib.suppress(OSError):
                kept = Path(tempfile.gettempdir()) / f"asyncrl-builtin-{server.pid}.log"
                kept.write_bytes(log_path.read_bytes())
