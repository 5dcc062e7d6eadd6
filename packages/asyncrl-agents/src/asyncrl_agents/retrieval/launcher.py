"""Start and stop a retrieval server as a subprocess (what the runner and the tests use)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from types import TracebackType

from asyncrl_core.errors import AsyncRLError
from asyncrl_core.server_process import ServerProcess

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
        self._server: ServerProcess | None = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise AsyncRLError("the retrieval server is not running; call start() first")
        return self._url

    @property
    def pid(self) -> int:
        """The server's process id (the leader of its process group)."""
        if self._server is None:
            raise AsyncRLError("the retrieval server is not running; call start() first")
        return self._server.pid

    def start(self) -> str:
        """Start the server and wait until `/health` answers; returns `url`."""
        if self._server is not None:
            raise AsyncRLError("the retrieval server is already running")
        with tempfile.TemporaryDirectory(prefix="asyncrl-retrieval-") as folder:
            port_file = Path(folder) / "port"
            command = [
                sys.executable, "-m", "asyncrl_agents.retrieval", "--corpus", str(self.corpus),
                "--index", self.index, "--topk", str(self.topk), "--host", self.host,
                "--port", str(self.port), "--port-file", str(port_file), "--exit-with-parent",
            ]  # fmt: skip
            self._server = ServerProcess(
                command, Path(folder) / "log", name=f"retrieval server ({self.corpus})"
            )
            try:
                port = self._server.wait_port_file(port_file, self.startup_timeout_s)
                host = f"[{self.host}]" if ":" in self.host else self.host
                self._url = f"http://{host}:{port}"
                self._server.wait_ready(f"{self._url}/health", min(self.startup_timeout_s, 30.0))
            except BaseException:
                self.stop()
                raise
        return self._url

    def stop(self) -> None:
        """Terminate the server's process group and wait for it (idempotent)."""
        server, self._server, self._url = self._server, None, None
        if server is not None:
            server.stop(STOP_TIMEOUT_S)

    def __enter__(self) -> RetrievalServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
