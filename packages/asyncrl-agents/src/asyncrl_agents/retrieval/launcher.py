"""Start and stop a retrieval server as a subprocess (what the runner and the tests use)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

from asyncrl_core.errors import AsyncRLError

STOP_TIMEOUT_S = 10.0


class RetrievalServer:
    """A retrieval server process on loopback, started by `start()` or `with`, stopped by `stop()`.

    The process runs in its own process group, which `stop()` terminates (then kills after
    `STOP_TIMEOUT_S`); it also exits by itself when its parent does, so a crashed runner leaves no server
    behind. `url` is the base URL (`http://127.0.0.1:<port>`); requests go to `url + "/retrieve"`.
    """

    def __init__(
        self,
        corpus: str | Path,
        *,
        index: str = "bm25",
        topk: int = 3,
        host: str = "127.0.0.1",
        port: int = 0,
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.corpus = Path(corpus)
        self.index = index
        self.topk = topk
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise AsyncRLError("the retrieval server is not running; call start() first")
        return self._url

    def start(self) -> str:
        """Start the server and wait until `/health` answers; returns `url`."""
        if self._process is not None:
            raise AsyncRLError("the retrieval server is already running")
        with tempfile.TemporaryDirectory(prefix="asyncrl-retrieval-") as folder:
            port_file = Path(folder) / "port"
            log = Path(folder) / "log"
            command = [
                sys.executable, "-m", "asyncrl_agents.retrieval", "--corpus", str(self.corpus),
                "--index", self.index, "--topk", str(self.topk), "--host", self.host,
                "--port", str(self.port), "--port-file", str(port_file), "--exit-with-parent",
            ]  # fmt: skip
            with log.open("wb") as log_file:
                self._process = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            try:
                port = self._wait_for_port(port_file, log)
                host = f"[{self.host}]" if ":" in self.host else self.host
                self._url = f"http://{host}:{port}"
                self._wait_for_health(log)
            except BaseException:
                self.stop()
                raise
        return self._url

    def _failure(self, what: str, log: Path) -> AsyncRLError:
        output = log.read_text(errors="replace").strip() if log.exists() else ""
        tail = "\n".join(output.splitlines()[-20:]) or "(no output)"
        return AsyncRLError(f"retrieval server ({self.corpus}): {what}; its output:\n{tail}")

    def _wait_for_port(self, port_file: Path, log: Path) -> int:
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while not port_file.exists():
            if self._process.poll() is not None:
                raise self._failure(f"exited with status {self._process.returncode} while starting", log)
            if time.monotonic() > deadline:
                raise self._failure(f"not serving after {self.startup_timeout_s:g} s", log)
            time.sleep(0.05)
        return int(port_file.read_text())

    def _wait_for_health(self, log: Path) -> None:
        deadline = time.monotonic() + min(self.startup_timeout_s, 30.0)
        last_error = ""
        while time.monotonic() < deadline:
            try:
                response = httpx.get(f"{self.url}/health", timeout=2.0)
            except httpx.HTTPError as error:
                last_error = str(error)
            else:
                if response.status_code == 200:
                    return
                last_error = f"status {response.status_code}"
            time.sleep(0.05)
        raise self._failure(f"/health did not answer 200 ({last_error})", log)

    def stop(self) -> None:
        """Terminate the server's process group and wait for it (idempotent)."""
        process, self._process, self._url = self._process, None, None
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=STOP_TIMEOUT_S)

    def __enter__(self) -> RetrievalServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
