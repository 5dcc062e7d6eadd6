"""`RolloutWorker`: one engine server process on its devices, started and watched through the rollout
backend; `EngineEndpoint`, where an engine answers."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl_core.runner.rollout_backend import rollout_backend
from asyncrl_core.runner.workers.common import RunnerError, pin_to_cores
from asyncrl_core.server_process import end_orphaned_group

if TYPE_CHECKING:
    from asyncrl_core.config import AsyncRLConfig


@dataclass(frozen=True, slots=True)
class EngineFailure:
    """What `RolloutWorker.watch` saw happen to its engine process."""

    index: int
    """The engine's index among the rollout workers."""
    what: str
    """What happened, for a message: `exited with status -9`, `stopped answering /health for 15 s`."""
    log_tail: str
    """The end of the engine's log."""
    detected_at: float
    """Unix time at which the watch saw it."""


class RolloutWorker:
    """One engine server process (built-in or SGLang) on `devices`, started through the rollout backend.

    `watch` returns when the process exits or stops answering `/health` for `rollout.engine_unresponsive_s`
    (the process is then killed, so the requests it held fail at once); `restart` starts it again on the
    same address. Both run beside the other calls (the Ray actor serves several at once).

    A worker that takes the place of one that died gets the dead one's engine `port` and process id
    (`replaces_pid`): that engine, orphaned, is ended first (its whole process group), so the new engine
    starts on the address the agent loops send to; and the number of engine processes started before its
    own (`num_restarts`), so that its counters' readings are told apart from the dead one's.

    An engine started again (by `restart`, or by a worker with `start_paused`) starts paused: the requests
    that reach it wait there until the weight push that follows continues it, so none is generated with
    the weights it loads at start.
    """

    def __init__(
        self,
        config: AsyncRLConfig,
        *,
        model_path: str,
        index: int,
        devices: Sequence[int],
        run_dir: Path,
        port: int | None = None,
        replaces_pid: int | None = None,
        num_restarts: int = 0,
        start_paused: bool = False,
    ) -> None:
        gpu = config.cluster.device_type == "gpu"
        if not gpu:
            pin_to_cores(devices)
        backend = rollout_backend(config)
        sglang = config.rollout.sglang
        # An external engine: this worker watches the one at its own index of the URLs.
        own = {"urls": sglang.urls[index : index + 1]} if sglang.urls else {}
        if sglang.grpc_urls:
            own["grpc_urls"] = sglang.grpc_urls[index : index + 1]
        rollout = config.rollout.model_copy(
            update={
                "model_path": model_path,
                "num_instances": 1,
                "sglang": sglang.model_copy(update={"base_port": sglang.base_port + index, **own}),
            }
        )
        self.index = index
        self.unresponsive_s = config.rollout.engine_unresponsive_s
        self.api_key = config.rollout.sglang.api_key

        from asyncrl_core.runner.placement import node_address

        advertise_host = node_address()  # the URL's host when the engine binds every interface

        def start(base_port: int, start_paused: bool) -> Any:
            sglang = rollout.sglang.model_copy(update={"base_port": base_port})
            return backend.launch(
                rollout.model_copy(update={"sglang": sglang}),
                run_dir=run_dir / f"rollout-{index}",
                devices=tuple(devices),
                gpu=gpu,
                health_timeout_s=config.runner.startup_timeout_s,
                advertise_host=advertise_host,
                # `runner.seed`: engine `index` samples with `seed + index`, its restarts too.
                random_seed=config.runner.seed + index,
                start_paused=start_paused,
            )

        self._launch = start
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._base_port = rollout.sglang.base_port
        self._backend = backend
        if replaces_pid is not None and not end_orphaned_group(replaces_pid):
            raise RunnerError(
                f"the engine process {replaces_pid} of the rollout worker that died did not end within 10 s"
            )
        self.engines = self._launch(port if port is not None else self._base_port, start_paused)
        self.num_restarts = num_restarts
        """Restarts of the engine process so far (`engine_counters` tells its readings apart by it)."""

    def endpoint(self) -> EngineEndpoint:
        """Where the engine answers: HTTP for control, and gRPC for generation when configured."""
        return EngineEndpoint(str(self.engines.urls[0]), self.engines.grpc_targets[0])

    def pid(self) -> int | None:
        """The engine process's id (None for an `external` engine)."""
        processes = self.engines.processes
        return int(processes[0].pid) if processes else None

    def watch(self, poll_s: float = 1.0) -> EngineFailure | None:
        """Block until the engine fails: its process exits, or `/health` stays unanswered for
        `rollout.engine_unresponsive_s` (then the process group is killed). None once `stop` was called."""
        from asyncrl_core.server_process import http_ok

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        last_answer = time.monotonic()
        while not self._stopped.wait(poll_s):
            with self._lock:
                engines = self.engines
            process = engines.processes[0] if engines.processes else None
            if process is not None and (code := process.returncode()) is not None:
                if self._stopped.is_set():
                    return None
                return EngineFailure(
                    self.index, f"exited with status {code}", process.log_tail(), time.time()
                )
            probe_s = min(5.0, self.unresponsive_s)
            if http_ok(f"{engines.urls[0]}/health", headers=headers, timeout_s=probe_s):
                last_answer = time.monotonic()
            elif time.monotonic() - last_answer >= self.unresponsive_s and not self._stopped.is_set():
                silent_s = time.monotonic() - last_answer
                detected_at = time.time()
                if process is not None:
                    process.stop(grace_s=1.0)  # SIGKILL reaches a stopped process; SIGTERM waits for it
                return EngineFailure(
                    self.index,
                    f"stopped answering /health for {silent_s:.0f} s (rollout.engine_unresponsive_s)",
                    process.log_tail() if process is not None else "",
                    detected_at,
                )
        return None

    def restart(self) -> EngineEndpoint:
        """Stop what is left of the engine and start it again (same command, same address), paused; returns
        its endpoint once it is healthy. It holds every request until the current weights are pushed in a
        `retract` or `in_place` sync, which continues it."""
        with self._lock:
            if not self.engines.processes:
                raise RunnerError(
                    f"engine {self.index} at {self.engines.urls[0]} is external: it cannot be restarted"
                )
            port = urllib.parse.urlsplit(self.engines.urls[0]).port or self._base_port
            self.engines.stop()
            self.num_restarts += 1  # before the start: a reading from now on may reach the new process
            self.engines = self._launch(port, True)  # its own port first: the agent loops send there
        return self.endpoint()

    def engine_counters(self, timeout_s: float) -> EngineCounters:
        """The engine's cumulative counters now (`RolloutBackend.engine_counters`), read within `timeout_s`
        (else the backend's error), tagged with the start of the process they count from. It runs beside a
        restart: a reading of the old process fails, or counts from its new start."""
        url, launch = str(self.engines.urls[0]), self.num_restarts
        values = asyncio.run(self._backend.engine_counters(url, timeout_s=timeout_s))
        return EngineCounters(launch, dict(values))

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            self.engines.stop()


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """One reading of an engine's cumulative counters (`RolloutWorker.engine_counters`)."""

    launch: int
    """Which start of the engine process they count from (0, then one more per restart)."""
    values: Mapping[str, float]
    """Each counter by the name of the step metric its growth makes (`metrics.ENGINE_PREFILL_S`, ...)."""


@dataclass(frozen=True, slots=True)
class EngineEndpoint:
    """One engine's addresses: its HTTP base URL and, with `rollout.sglang.transport: grpc`, its gRPC
    target for generation."""

    url: str
    grpc_target: str | None = None
