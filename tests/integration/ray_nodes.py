"""A Ray cluster of several nodes on this machine, each at its own loopback address, started as a user starts
one: `ray start --head --node-ip-address A ...` and `ray start --address HEAD --node-ip-address B ...`.

Each `ray start` runs with `--block` in a session of its own, so stopping a node is ending the processes this
helper started (SIGTERM to each node's process group, SIGKILL to whatever is left after a grace period),
never `ray stop`, which ends every Ray process of the machine, other test sessions' included.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from asyncrl_core.server_process import free_port

STOP_GRACE_S = 60.0
"""How long a node gets to drain and stop after SIGTERM before what is left of it is killed."""
JOIN_TIMEOUT_S = 120.0


@dataclass
class RayNodes:
    """The nodes started so far (head first) and the head's address (`host:port`)."""

    address: str
    temp_dir: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list[subprocess.Popen[bytes]])
    logs: list[Path] = field(default_factory=list[Path])

    def log_tails(self) -> str:
        return "\n".join(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}" for log in self.logs)


def _ray_command() -> list[str]:
    return [str(Path(sys.executable).with_name("ray"))]


def _start(nodes: RayNodes, arguments: list[str], name: str) -> None:
    log = nodes.temp_dir / f"{name}.log"
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        # A node drains for Ray Serve on SIGTERM (30 s by default); nothing here serves.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    }
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [*_ray_command(), "start", "--block", "--disable-usage-stats", *arguments],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    nodes.processes.append(process)
    nodes.logs.append(log)


def _wait_for_nodes(nodes: RayNodes, count: int) -> None:
    """Until `ray status`-like polling through the GCS sees `count` alive nodes."""
    import ray

    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while time.monotonic() < deadline:
        for process in nodes.processes:
            if process.poll() is not None:
                raise RuntimeError(f"`ray start` exited with {process.returncode}:\n{nodes.log_tails()}")
        if len([node for node in ray.nodes() if node["Alive"]]) == count:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{count} Ray nodes not alive within {JOIN_TIMEOUT_S:.0f} s:\n{nodes.log_tails()}")


@contextlib.contextmanager
def ray_nodes(
    addresses: list[str], *, num_cpus: int, resources: list[Mapping[str, float]]
) -> Iterator[RayNodes]:
    """Start a head at `addresses[0]` and a node at each further address (`num_cpus` each, no GPU, no
    dashboard, `resources[i]` as node `i`'s custom resources), connect this process to the cluster, and stop
    everything at the end."""
    import ray

    temp_dir = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))  # Ray's socket paths must stay short
    port = free_port(addresses[0])
    nodes = RayNodes(f"{addresses[0]}:{port}", temp_dir)
    try:
        for index, address in enumerate(addresses):
            common = [
                "--node-ip-address",
                address,
                "--num-cpus",
                str(num_cpus),
                "--num-gpus",
                "0",
                "--resources",
                json.dumps(dict(resources[index])),
            ]
            if index == 0:
                head = ["--head", "--port", str(port), "--include-dashboard", "false"]
                _start(nodes, [*head, "--temp-dir", str(temp_dir), *common], "head")
                # The others join once the head's GCS answers.
                ray.init(address=nodes.address, include_dashboard=False, logging_level="WARNING")
            else:
                _start(nodes, ["--address", nodes.address, *common], f"node-{index}")
        _wait_for_nodes(nodes, len(addresses))
        yield nodes
    finally:
        ray.shutdown()
        _stop(nodes)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _stop(nodes: RayNodes) -> None:
    """SIGTERM to every node's process group, newest first; then SIGKILL to what is left, by process id."""
    tree: list[psutil.Process] = []
    for process in nodes.processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += psutil.Process(process.pid).children(recursive=True)
    for process in reversed(nodes.processes):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for process in reversed(nodes.processes):
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    _, alive = psutil.wait_procs(tree, timeout=max(0.1, deadline - time.monotonic()))
    for leftover in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            leftover.kill()
    psutil.wait_procs(alive, timeout=10)
