"""Start the rollout engines, wait until they serve, and stop every process started, whatever happens.

`rollout.sglang.launch`:
- `builtin`: `python -m asyncrl_engine` per instance (asyncrl's torch engine), with
  `--grpc-port` when `rollout.sglang.transport` is `grpc` (the launch then also waits for the gRPC
  `HealthCheck`, and `clients()` generate over gRPC);
- `sglang`: `python -m sglang.launch_server` per instance, with the flags an RL run needs (`--weight-version
  0` so versions are asyncrl ints from the start, `--enable-metrics` for the saturation gauges) and
  `CUDA_VISIBLE_DEVICES` set to the instance's share of the rollout devices;
- `external`: nothing is started; the servers at `rollout.sglang.urls` must become healthy.

Every process runs in its own process group (its own session), with its output in
`<run_dir>/engines/engine-<i>.log`. Stopping sends SIGTERM to the whole group (SGLang's scheduler and
detokenizer processes included), then SIGKILL after a grace period. Processes are stopped when the
`LaunchedEngines` context exits, at interpreter exit (`atexit`), on SIGTERM/SIGHUP (turned into `SystemExit`
while engines run, when no other handler is installed) and, on Linux, when the launching process dies
(`PR_SET_PDEATHSIG`, whichever thread launched them), so a crash of the parent leaves no engine behind. An
engine that dies before it is healthy fails the launch with the tail of its log.

Ports are picked free, then bound by the engine later; another run's engine may take one in between. An
engine counts as healthy only once its own process listens on its port (`port_owner`), and a launch whose
engine lost its port to another process starts again on other ports (`PORT_ATTEMPTS`), so two launches that
race for a port each end up with their own engine.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib.util
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import httpx

from asyncrl_core.errors import EngineControlError, EngineUnavailableError
from asyncrl_core.models import resolve_model_path
from asyncrl_core.server_process import ServerProcess
from asyncrl_core.server_process import free_port as free_port  # re-exported
from asyncrl_sglang.client import ClientTimeouts, SGLangClient
from asyncrl_sglang.grpc_client import GrpcSGLangClient, grpc_health_check
from asyncrl_sglang.pool import EnginePool
from asyncrl_sglang.port_owner import holds_port

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from asyncrl_core.config.models import RolloutConfig

ServerArgument = str | int | float | bool

LOOPBACK = "127.0.0.1"
FLAG_CHECK_TIMEOUT_S = 60.0
"""Bound on the check of the built-in engine's flags (one Python start-up that imports no torch)."""


@dataclass(frozen=True, slots=True)
class EngineCommand:
    """How to start one engine: its command line, extra environment, and where it will listen."""

    argv: tuple[str, ...]
    host: str
    """The address the engine binds to."""
    port: int
    env: Mapping[str, str] = field(default_factory=dict[str, str])
    grpc_port: int | None = None
    """The port of the engine's gRPC scheduler service (None: the engine serves HTTP only)."""
    advertise_host: str = LOOPBACK
    """Where the engine is reached when `host` binds every interface (`0.0.0.0`, `::`): its node's address
    in a cluster, loopback on one machine."""

    @property
    def reach_host(self) -> str:
        """The host others reach the engine at: `host`, or `advertise_host` for a wildcard bind."""
        return self.advertise_host if self.host in ("0.0.0.0", "::") else self.host

    @property
    def url(self) -> str:
        host = self.reach_host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def grpc_target(self) -> str | None:
        """`host:port` of the gRPC service, at the same host as `url`."""
        if self.grpc_port is None:
            return None
        host = self.reach_host
        return f"[{host}]:{self.grpc_port}" if ":" in host else f"{host}:{self.grpc_port}"


def _flag_arguments(extra_args: Mapping[str, ServerArgument]) -> list[str]:
    """`{"mem_fraction_static": 0.8, "disable_cuda_graph": True}` -> `--mem-fraction-static 0.8
    --disable-cuda-graph` (False omits a flag)."""
    argv: list[str] = []
    for key, value in extra_args.items():
        flag = "--" + key.replace("_", "-").lstrip("-")
        if value is True:
            argv.append(flag)
        elif value is not False:
            argv += [flag, str(value)]
    return argv


def sglang_command(
    *,
    model_path: str,
    host: str,
    port: int,
    tensor_parallel_size: int,
    max_running_requests: int,
    devices: Sequence[int] = (),
    context_length: int | None = None,
    api_key: str | None = None,
    random_seed: int | None = None,
    extra_args: Mapping[str, ServerArgument] | None = None,
    python: str = sys.executable,
) -> EngineCommand:
    """The command line of one real SGLang server for RL rollouts.

    `devices` are the GPU ids of this instance (`tensor_parallel_size` of them; none: SGLang's default);
    `random_seed` seeds its sampling (`--random-seed`; none: SGLang's default); `extra_args` add or
    override flags (`mem_fraction_static: 0.8`).
    """
    if devices and len(devices) != tensor_parallel_size:
        raise EngineControlError(
            f"an SGLang instance with tensor_parallel_size {tensor_parallel_size} needs as many devices, "
            f"got {list(devices)}"
        )
    arguments: dict[str, ServerArgument] = {
        "model_path": model_path,
        "host": host,
        "port": port,
        "tp_size": tensor_parallel_size,
        "max_running_requests": max_running_requests,
        "weight_version": "0",
        "enable_metrics": True,
    }
    if context_length is not None:
        arguments["context_length"] = context_length
    if api_key:
        arguments["api_key"] = api_key
    if random_seed is not None:
        arguments["random_seed"] = random_seed
    arguments.update(extra_args or {})
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(device) for device in devices)} if devices else {}
    return EngineCommand(
        argv=(python, "-m", "sglang.launch_server", *_flag_arguments(arguments)),
        host=host,
        port=port,
        env=env,
    )


def builtin_command(
    *,
    model_path: str,
    host: str,
    port: int,
    max_running_requests: int,
    devices: Sequence[int] = (),
    context_length: int | None = None,
    api_key: str | None = None,
    enable_metrics: bool = True,
    grpc_port: int | None = None,
    random_seed: int | None = None,
    start_paused: bool = False,
    extra_args: Mapping[str, ServerArgument] | None = None,
    python: str = sys.executable,
) -> EngineCommand:
    """The command line of one built-in engine (same flag names as SGLang's where they exist).

    `devices`: the GPU for the engine (`CUDA_VISIBLE_DEVICES`, and the engine runs on `cuda`); none runs
    it on the CPU. `grpc_port`: also serve SGLang's gRPC scheduler service there. `random_seed`: seed of
    its sampling (`--random-seed`; none: the engine's default, 0). `start_paused`: it holds every generation
    request until `/continue_generation` (`--start-paused`). `extra_args` add or override flags (the
    SGLang flags the engine implements, `disable_radix_cache: true` say); one it does not take is refused
    here, naming it, rather than when the engine starts.
    """
    if len(devices) > 1:
        raise EngineControlError(
            f"the built-in engine runs on one device (tensor_parallel_size 1), got devices {list(devices)}"
        )
    arguments: dict[str, ServerArgument] = {
        "model_path": model_path,
        "host": host,
        "port": port,
        "max_running_requests": max_running_requests,
        "weight_version": "0",
        "enable_metrics": enable_metrics,
        "device": "cuda" if devices else "cpu",
    }
    if context_length is not None:
        arguments["context_length"] = context_length
    if api_key:
        arguments["api_key"] = api_key
    if grpc_port is not None:
        arguments["grpc_port"] = grpc_port
    if random_seed is not None:
        arguments["random_seed"] = random_seed
    if "--start-paused" in _flag_arguments(extra_args or {}):
        raise EngineControlError(
            "rollout.sglang.extra_args: start_paused is the launcher's to set (an engine the runner restarts "
            "starts paused until it has the actor's weights); remove it"
        )
    arguments["start_paused"] = start_paused
    arguments.update(extra_args or {})
    flags = _flag_arguments(arguments)
    if python == sys.executable and importlib.util.find_spec(ENGINE_MODULE) is None:
        raise EngineControlError(_engine_missing(python))
    if extra_args:
        _check_builtin_flags(python, flags, extra_args)
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(device) for device in devices)} if devices else {}
    return EngineCommand(
        argv=(python, "-m", ENGINE_MODULE, *flags),
        host=host,
        port=port,
        env=env,
        grpc_port=grpc_port,
    )


ENGINE_MODULE = "asyncrl_engine"
"""The built-in engine's module (the distribution asyncrl-engine), run as `python -m asyncrl_engine`: the
launcher starts it as a process and never imports it."""


def _check_builtin_flags(python: str, flags: list[str], extra_args: Mapping[str, ServerArgument]) -> None:
    """Parse `flags` as the built-in engine will, in the interpreter that will run it (its flag parser,
    `python -m asyncrl_engine.flags`, imports no torch and starts nothing), so an extra argument it does not
    take is an error naming `rollout.sglang.extra_args` before any engine starts."""
    try:
        check = subprocess.run(
            [python, "-m", f"{ENGINE_MODULE}.flags", *flags],
            capture_output=True,
            text=True,
            timeout=FLAG_CHECK_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise EngineControlError(
            f"the built-in engine's flags could not be checked with {python}: {error}"
        ) from error
    if check.returncode == 0:
        return
    reason = check.stderr.strip().splitlines()[-1:] or [f"exit status {check.returncode}"]
    if f"No module named {ENGINE_MODULE}" in reason[0]:
        raise EngineControlError(_engine_missing(python))
    raise EngineControlError(
        f"rollout.sglang.extra_args {dict(extra_args)}: the built-in engine does not take them "
        f"({reason[0]}); it takes the SGLang flags listed by `python -m {ENGINE_MODULE} --help`"
    )


def _engine_missing(python: str) -> str:
    return (
        f"rollout.sglang.launch: builtin runs `{python} -m {ENGINE_MODULE}`, which is not installed there: "
        "install the built-in engine (pip install 'asyncrl[sglang]', or asyncrl-engine), or set "
        "rollout.sglang.launch to sglang or external"
    )


# -------------------------------------------------------------------------------------------------------
# Ports


def port_is_free(host: str, port: int) -> bool:
    """Whether nothing listens on (`host`, `port`) and it can be bound now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # Servers bind with SO_REUSEADDR, so a port whose old connections linger in TIME_WAIT is free to them.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def pick_ports(host: str, count: int, base_port: int | None, *, taken: Sequence[int] = ()) -> list[int]:
    """`count` distinct free ports: from `base_port` upward (the first free ones), or OS-chosen when None."""
    ports: list[int] = []
    candidate = base_port
    while len(ports) < count:
        if candidate is None:
            port = free_port(host)
            if port not in ports and port not in taken:
                ports.append(port)
            continue
        if candidate > 65535:
            raise EngineControlError(f"no {count} free ports on {host} from {base_port} upward")
        if candidate not in taken and port_is_free(host, candidate):
            ports.append(candidate)
        candidate += 1
    return ports


# -------------------------------------------------------------------------------------------------------
# Processes


class EngineProcess(ServerProcess):
    """One engine process (and its process group), with its output in `log_path`."""

    def __init__(self, command: EngineCommand, log_path: Path) -> None:
        super().__init__(command.argv, log_path, env=command.env, name=f"engine {command.url}")
        self.command = command
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"EngineProcess(pid={self.pid}, url={self.command.url!r})"

    @property
    def url(self) -> str:
        return self.command.url

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; returns once the process is reaped."""
        _LIVE.discard(self)
        super().stop(grace_s)


_LIVE: set[EngineProcess] = set()
"""Engine processes started and not stopped yet: stopped at interpreter exit."""
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _stop_live() -> None:
    for process in list(_LIVE):
        with contextlib.suppress(Exception):
            process.stop(grace_s=5.0)


atexit.register(_stop_live)


_signals_lock = threading.Lock()
_num_launches = 0
"""Launches whose engines run (their `_signals_exit` entered and not left), in this process."""
_installed: list[signal.Signals] = []
"""The signals whose handler this module set to `_exit_on_signal` and has not set back to the default."""


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    if _num_launches == 0:
        # Left installed by engines stopped off the main thread, where no handler can be set: the default
        # action, as if it had been set back.
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)
        return
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _signals_exit() -> Generator[None]:
    """While engines run, SIGTERM and SIGHUP raise `SystemExit` (so `finally` blocks stop the engines)
    where they would otherwise kill the interpreter outright. Other handlers are left alone.

    The handlers belong to the process, not to one launch: they are set while some launch's engines run
    and set back once none does. Only the main thread may set handlers, so engines started and stopped
    from another thread (a Ray actor serving several calls at once, a restart beside the event loop) leave
    them as they are; the main thread sets them back at its next launch's end, and meanwhile one left with
    no engine running acts as the default."""
    global _num_launches
    with _signals_lock:
        _num_launches += 1
        _set_handlers()
    try:
        yield
    finally:
        with _signals_lock:
            _num_launches -= 1
            _set_handlers()


def _set_handlers() -> None:
    """`_exit_on_signal` for the signals still at the default while engines run, the default again for
    those once none runs (main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if _num_launches > 0:
        for signum in _SIGNALS:
            if signum not in _installed and signal.getsignal(signum) is signal.SIG_DFL:
                signal.signal(signum, _exit_on_signal)
                _installed.append(signum)
        return
    for signum in _installed:
        if signal.getsignal(signum) is _exit_on_signal:
            signal.signal(signum, signal.SIG_DFL)
    _installed.clear()


def _wait_healthy(
    urls: Sequence[str],
    processes: Sequence[EngineProcess | None],
    timeout_s: float,
    api_key: str | None,
    grpc_targets: Sequence[str | None] = (),
) -> None:
    """Poll `/health` of every engine until all answer 200, and then the gRPC `HealthCheck` of those with a
    gRPC target until it answers healthy; fail early when a started engine exits.

    A started engine counts as healthy only once its own process (or a child) listens on its port: another
    run's engine that took the port between the pick and the bind answers `/health` too, and is not ours.
    When a started engine exits while another process holds its port, `EnginePortTakenError`."""
    deadline = time.monotonic() + timeout_s
    pending = set(range(len(urls)))
    grpc_pending = {index for index, target in enumerate(grpc_targets) if target is not None}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=httpx.Timeout(5.0), headers=headers, trust_env=False) as http:
        while pending or grpc_pending:
            for index in sorted(pending | grpc_pending):
                process = processes[index]
                if process is not None and (code := process.returncode()) is not None:
                    port = process.command.port
                    error = EnginePortTakenError if not port_is_free(process.command.host, port) else None
                    raise (error or EngineUnavailableError)(
                        f"engine {index} ({urls[index]}) exited with status {code} before it was healthy"
                        f"{f', and another process holds its port {port}' if error else ''}; "
                        f"the end of {process.log_path}:\n{process.log_tail()}"
                    )
                if index in pending:
                    try:
                        if http.get(f"{urls[index]}/health").status_code == 200 and (
                            process is None or holds_port(process.pid, process.command.port)
                        ):
                            pending.discard(index)
                    except httpx.HTTPError:
                        pass
                else:
                    target = grpc_targets[index]
                    assert target is not None
                    if grpc_health_check(target, api_key, timeout_s=max(1.0, deadline - time.monotonic())):
                        grpc_pending.discard(index)
            pending_names = [urls[index] for index in sorted(pending)]
            pending_names += [f"{grpc_targets[index]} (gRPC)" for index in sorted(grpc_pending)]
            if not pending_names:
                return
            if time.monotonic() >= deadline:
                names = ", ".join(pending_names)
                raise EngineUnavailableError(
                    f"engines not healthy within {timeout_s:.0f} s (in a run: `runner.startup_timeout_s`): "
                    f"{names}"
                )
            time.sleep(0.25)


class EnginePortTakenError(EngineUnavailableError):
    """A started engine exited before it was healthy while another process holds its port: another run's
    engine took the port between the launcher's pick and the engine's bind."""


class LaunchedEngines:
    """The engines of a run: their URLs, the processes started for them, and clients to reach them.

    A context manager: leaving it stops every process started (no-op for `external` servers).
    """

    def __init__(
        self,
        urls: Sequence[str],
        processes: Sequence[EngineProcess] = (),
        *,
        api_key: str | None = None,
        signals: contextlib.AbstractContextManager[None] | None = None,
        grpc_targets: Sequence[str | None] = (),
    ) -> None:
        """`signals`: the entered `_signals_exit()` context of the launch, left when the engines stop.
        `grpc_targets`: per URL, the gRPC address generation goes to (None: HTTP); empty: all HTTP."""
        if grpc_targets and len(grpc_targets) != len(urls):
            raise EngineControlError(f"{len(grpc_targets)} gRPC targets for {len(urls)} engines")
        self.urls: tuple[str, ...] = tuple(urls)
        self.grpc_targets: tuple[str | None, ...] = tuple(grpc_targets) or (None,) * len(self.urls)
        self.processes: tuple[EngineProcess, ...] = tuple(processes)
        self.api_key = api_key
        self._signals = signals

    def __enter__(self) -> LaunchedEngines:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop every process started (all at once, each with a grace period)."""
        threads = [threading.Thread(target=process.stop) for process in self.processes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self._signals is not None:
            signals, self._signals = self._signals, None
            signals.__exit__(None, None, None)

    def clients(self, timeouts: ClientTimeouts | None = None) -> list[SGLangClient]:
        """A new client per engine (create them inside the event loop that uses them): generating over
        gRPC for an engine with a gRPC target, else over HTTP."""
        return [
            SGLangClient(url, api_key=self.api_key, timeouts=timeouts)
            if target is None
            else GrpcSGLangClient(url, target, api_key=self.api_key, timeouts=timeouts)
            for url, target in zip(self.urls, self.grpc_targets, strict=True)
        ]

    def pool(self, timeouts: ClientTimeouts | None = None, *, recovery_timeout_s: float = 0.0) -> EnginePool:
        """A new pool over every engine (`EnginePool`'s `recovery_timeout_s`)."""
        return EnginePool(self.clients(timeouts), recovery_timeout_s=recovery_timeout_s)


def start_engines(
    commands: Sequence[EngineCommand],
    *,
    log_dir: Path,
    health_timeout_s: float = 600.0,
    api_key: str | None = None,
) -> LaunchedEngines:
    """Start one process per command and wait until all are healthy; on any failure stop them all."""
    processes: list[EngineProcess] = []
    signals = _signals_exit()
    signals.__enter__()
    grpc_targets = [command.grpc_target for command in commands]
    try:
        for index, command in enumerate(commands):
            processes.append(EngineProcess(command, log_dir / f"engine-{index}.log"))
        _wait_healthy(
            [command.url for command in commands], processes, health_timeout_s, api_key, grpc_targets
        )
    except BaseException:
        for process in processes:
            process.stop()
        signals.__exit__(None, None, None)
        raise
    return LaunchedEngines(
        [command.url for command in commands],
        processes,
        api_key=api_key,
        signals=signals,
        grpc_targets=grpc_targets,
    )


def launch_engines(
    rollout: RolloutConfig,
    *,
    run_dir: Path,
    devices: Sequence[int] = (),
    gpu: bool = False,
    health_timeout_s: float = 600.0,
    random_seed: int | None = None,
    advertise_host: str = LOOPBACK,
    start_paused: bool = False,
) -> LaunchedEngines:
    """Start (or, for `external`, reach) the engines `rollout` describes and wait until they are healthy.

    `devices`: the rollout devices of the placement; instance `i` gets `devices[i*tp:(i+1)*tp]` (as
    `CUDA_VISIBLE_DEVICES` when `gpu`). The number of instances is `rollout.num_instances`, else
    `len(devices) // tensor_parallel_size` (at least 1). The engines bind to `rollout.sglang.host`
    (loopback when unset; the runner sets it per node), on ports picked free here; `advertise_host` is the
    host of their URLs when they bind every interface (the node's address in a cluster). `random_seed`:
    instance `i` samples with seed `random_seed + i` (none: each engine's default). `start_paused`: the
    engines started hold every generation request, from before they listen, until `/continue_generation`
    (a weight sync in `retract` or `in_place` mode ends with it); only the built-in engine can (SGLang has
    no such flag, and a pause sent once it answers would let a request through first). Servers reached
    (`external`) are left as they are.
    """
    sglang = rollout.sglang
    if start_paused and sglang.launch == "sglang":
        raise EngineControlError(
            "an SGLang server cannot start paused (it has no flag for it, and a pause sent once it answers "
            "would let requests through first); only launch: builtin engines can"
        )
    if sglang.launch == "external":
        if not sglang.urls:
            raise EngineControlError("rollout.sglang.launch is external but rollout.sglang.urls is empty")
        urls = [url.rstrip("/") for url in sglang.urls]
        grpc_targets = list(sglang.grpc_urls) if sglang.transport == "grpc" else []
        _wait_healthy(urls, [None] * len(urls), health_timeout_s, sglang.api_key, grpc_targets)
        return LaunchedEngines(urls, api_key=sglang.api_key, grpc_targets=grpc_targets)
    tp = rollout.tensor_parallel_size
    num_instances = rollout.num_instances or max(1, len(devices) // tp)
    if gpu and len(devices) < num_instances * tp:
        raise EngineControlError(
            f"{num_instances} rollout instances with tensor_parallel_size {tp} need {num_instances * tp} "
            f"devices; the placement gives the rollout {list(devices)}"
        )
    if rollout.model_path is None:
        raise EngineControlError("rollout.model_path is not set (it defaults to actor.model_path)")
    model_path = str(resolve_model_path(rollout.model_path, key="rollout.model_path"))
    if sglang.transport == "grpc" and sglang.launch == "sglang":
        raise EngineControlError(
            "rollout.sglang.transport grpc: the launcher starts SGLang's HTTP server only; use "
            "launch: external with grpc_urls"
        )
    host = sglang.host or LOOPBACK
    for attempt in range(1, PORT_ATTEMPTS + 1):
        ports = pick_ports(host, num_instances, sglang.base_port)
        grpc_ports: list[int | None] = [None] * num_instances
        if sglang.transport == "grpc":
            grpc_ports = list(pick_ports(host, num_instances, sglang.grpc_base_port, taken=ports))
        commands = [
            _engine_command(
                rollout,
                model_path=model_path,
                host=host,
                port=port,
                grpc_port=grpc_ports[index],
                devices=tuple(devices[index * tp : (index + 1) * tp]) if gpu else (),
                random_seed=None if random_seed is None else random_seed + index,
                start_paused=start_paused,
            )
            for index, port in enumerate(ports)
        ]
        commands = [dataclasses.replace(command, advertise_host=advertise_host) for command in commands]
        try:
            log_dir = run_dir / "engines"
            return start_engines(
                commands, log_dir=log_dir, health_timeout_s=health_timeout_s, api_key=sglang.api_key
            )
        except EnginePortTakenError as error:
            if attempt == PORT_ATTEMPTS:
                raise
            logger.warning("%s\nstarting the engines again on other ports", error)
    raise AssertionError("unreachable")  # the last attempt returns or raises


PORT_ATTEMPTS = 3
"""Starts of a run's engines when a port is taken by another process between its pick and the bind."""


def _engine_command(
    rollout: RolloutConfig,
    *,
    model_path: str,
    host: str,
    port: int,
    grpc_port: int | None,
    devices: tuple[int, ...],
    random_seed: int | None,
    start_paused: bool,
) -> EngineCommand:
    sglang = rollout.sglang
    if sglang.launch == "sglang":
        return sglang_command(
            model_path=model_path,
            host=host,
            port=port,
            tensor_parallel_size=rollout.tensor_parallel_size,
            max_running_requests=rollout.max_running_requests,
            devices=devices,
            context_length=rollout.context_length,
            api_key=sglang.api_key,
            random_seed=random_seed,
            extra_args=sglang.extra_args,
        )
    return builtin_command(
        model_path=model_path,
        host=host,
        port=port,
        max_running_requests=rollout.max_running_requests,
        devices=devices,
        context_length=rollout.context_length,
        api_key=sglang.api_key,
        grpc_port=grpc_port,
        random_seed=random_seed,
        start_paused=start_paused,
        extra_args=sglang.extra_args,
    )


def connect_engines(
    urls: Sequence[str],
    *,
    grpc_targets: Sequence[str | None] = (),
    api_key: str | None,
    request_timeout_s: float,
) -> EnginePool:
    """One pool over running engines (from another process than the one that launched them): generation
    over gRPC where a target is given, else HTTP; each request allowed `request_timeout_s` seconds, pauses
    for weight syncs included, and as long again to wait for an engine that went down to come back (the
    runner restarts dead engines)."""
    engines = LaunchedEngines(urls, api_key=api_key, grpc_targets=grpc_targets)
    return engines.pool(ClientTimeouts(generate_s=request_timeout_s), recovery_timeout_s=request_timeout_s)
