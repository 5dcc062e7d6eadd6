"""Start a built-in engine server as a subprocess on a free loopback port, for tests and benchmarks.

    with serve_builtin(model_path, "--enable-metrics", max_running_requests=2) as server:
        httpx.get(f"{server.url}/health")

The server is ready (`/health` is 200) when the block starts and is stopped (SIGTERM, then SIGKILL after
`stop_timeout_s`) when it ends, also on an exception or Ctrl-C. Its output goes to `server.log_path`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

from asyncrl_core.errors import EngineUnavailableError


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
    """Run `python -m asyncrl_sglang.builtin` on 127.0.0.1 with a free port until the block exits.

    `extra_args` are passed through (e.g. `"--enable-metrics"`, `"--api-key", "k"`). Raises
    `EngineUnavailableError` with the server's log if it exits or is not healthy within `start_timeout_s`.
    """
    with tempfile.TemporaryDirectory(prefix="asyncrl-builtin-") as folder:
        port_file = Path(folder) / "port"
        log_path = Path(folder) / "server.log"
        command = [sys.executable, "-m", "asyncrl_sglang.builtin", "--model-path", str(model_path)]
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
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            port = _wait_ready(process, port_file, log_path, start_timeout_s)
            yield BuiltinServerProcess(f"http://127.0.0.1:{port}", port, process, log_path)
        finally:
            _stop(process, stop_timeout_s)
            # Keep the log readable after the folder is gone (a failing test prints it).
            with contextlib.suppress(OSError):
                kept = Path(tempfile.gettempdir()) / f"asyncrl-builtin-{process.pid}.log"
                kept.write_bytes(log_path.read_bytes())


def _wait_ready(process: subprocess.Popen[bytes], port_file: Path, log_path: Path, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    port: int | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = log_path.read_text(errors="replace")
            raise EngineUnavailableError(f"the built-in engine exited with code {process.returncode}:\n{log}")
        if port is None and port_file.exists():
            text = port_file.read_text().strip()
            port = int(text) if text else None
        if port is not None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        return port
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
        time.sleep(0.2)
    _stop(process, 5.0)
    log = log_path.read_text(errors="replace")
    raise EngineUnavailableError(f"the built-in engine was not healthy within {timeout_s:.0f} s:\n{log}")


def _stop(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout_s)
