"""Which process listens on a TCP port, so that the launcher accepts an engine only once the process it
started holds the engine's port.

The launcher picks a free port and the engine binds it later (SGLang takes `--port` and binds after loading
its weights); in between another run's engine can take the port, and its `/health` then answers for ours.
`holds_port` tells the two apart from the kernel's socket table (psutil reads `/proc` on Linux), whatever the
engine: SGLang or the built-in one.
"""

from __future__ import annotations

import psutil


def holds_port(pid: int, port: int) -> bool:
    """Whether process `pid`, or a process it started, listens on TCP `port` (any address)."""
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    for process in family:
        try:
            connections = process.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for connection in connections:
            if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == port:
                return True
    return False
