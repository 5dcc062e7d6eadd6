"""The launcher: command lines for SGLang and the built-in engine, ports, and the lifecycle of the processes
it starts (health wait, early death, process-group stop, stop on exit)."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from asyncrl_core.config.models import RolloutConfig
from asyncrl_core.errors import AsyncRLError, EngineControlError, EngineUnavailableError
from asyncrl_sglang.launcher import (
    EngineCommand,
    LaunchedEngines,
    builtin_command,
    free_port,
    launch_engines,
    pick_ports,
    sglang_command,
    start_engines,
)


def flags(argv: tuple[str, ...]) -> dict[str, str | None]:
    """`--a 1 --b --c x` -> {"--a": "1", "--b": None, "--c": "x"}."""
    parsed: dict[str, str | None] = {}
    index = 0
    while index < len(argv):
        if argv[index].startswith("--"):
            value = (
                argv[index + 1] if index + 1 < len(argv) and not argv[index + 1].startswith("--") else None
            )
            parsed[argv[index]] = value
            index += 2 if value is not None else 1
        else:
            index += 1
    return parsed


def test_sglang_command_has_the_flags_an_rl_run_needs() -> None:
    command = sglang_command(
        model_path="/models/qwen",
        host="127.0.0.1",
        port=31000,
        tensor_parallel_size=2,
        max_running_requests=64,
        devices=(4, 5),
        context_length=8192,
        api_key="secret",
        random_seed=7,
        extra_args={
            "mem_fraction_static": 0.8,
            "disable_cuda_graph": True,
            "enable_metrics": True,
            "x": False,
        },
        python="/usr/bin/python3",
    )
    assert command.argv[:3] == ("/usr/bin/python3", "-m", "sglang.launch_server")
    assert flags(command.argv) == {
        "--model-path": "/models/qwen",
        "--host": "127.0.0.1",
        "--port": "31000",
        "--tp-size": "2",
        "--max-running-requests": "64",
        "--weight-version": "0",
        "--enable-metrics": None,
        "--context-length": "8192",
        "--api-key": "secret",
        "--random-seed": "7",
        "--mem-fraction-static": "0.8",
        "--disable-cuda-graph": None,
    }
    assert command.env == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert command.url == "http://127.0.0.1:31000"


def test_sglang_command_refuses_a_device_count_that_does_not_match_tp() -> None:
    with pytest.raises(EngineControlError, match="tensor_parallel_size 2"):
        sglang_command(
            model_path="m",
            host="127.0.0.1",
            port=1,
            tensor_parallel_size=2,
            max_running_requests=1,
            devices=(0,),
        )


def test_builtin_command_runs_on_cuda_only_when_given_a_device() -> None:
    cpu = builtin_command(model_path="m", host="127.0.0.1", port=5, max_running_requests=3)
    assert cpu.argv[1:3] == ("-m", "asyncrl_engine")
    assert "--random-seed" not in cpu.argv  # the engine's default
    seeded = builtin_command(model_path="m", host="127.0.0.1", port=5, max_running_requests=3, random_seed=9)
    assert flags(seeded.argv)["--random-seed"] == "9"
    assert flags(cpu.argv)["--device"] == "cpu"
    assert flags(cpu.argv)["--max-running-requests"] == "3"
    assert "--enable-metrics" in cpu.argv
    assert cpu.env == {}
    gpu = builtin_command(model_path="m", host="0.0.0.0", port=5, max_running_requests=3, devices=(2,))
    assert flags(gpu.argv)["--device"] == "cuda"
    assert gpu.env == {"CUDA_VISIBLE_DEVICES": "2"}
    assert gpu.url == "http://127.0.0.1:5"  # a server on every interface is reached on loopback here
    # ... and at its node's address from other nodes.
    advertised = dataclasses.replace(gpu, advertise_host="10.0.0.2", grpc_port=6)
    assert (advertised.url, advertised.grpc_target) == ("http://10.0.0.2:5", "10.0.0.2:6")
    bound = builtin_command(model_path="m", host="10.0.0.3", port=5, max_running_requests=3)
    assert dataclasses.replace(bound, advertise_host="10.0.0.2").url == "http://10.0.0.3:5"
    with pytest.raises(EngineControlError, match="one device"):
        builtin_command(model_path="m", host="h", port=5, max_running_requests=3, devices=(0, 1))


def test_ports_skip_busy_ones_and_never_repeat() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        ports = pick_ports("127.0.0.1", 3, taken)
        assert taken not in ports
        assert ports == sorted(set(ports))
        assert all(port > taken for port in ports)
    chosen = pick_ports("127.0.0.1", 4, None)
    assert len(set(chosen)) == 4


# ------------------------------------------------------------------------------------------------------
# Processes: a small stand-in server script (a real HTTP server on loopback, not an engine).

SERVER = textwrap.dedent(
    """
    import http.server, os, subprocess, sys, time
    delay, child_pid_file = float(sys.argv[2]), sys.argv[3]
    if child_pid_file != "-":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(child_pid_file, "w").write(str(child.pid))
    started = time.monotonic()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ready = time.monotonic() - started >= delay
            self.send_response(200 if ready and self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    print("serving", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
    """
)


def server_command(
    tmp_path: Path, *, delay_s: float = 0.5, child_pid_file: Path | None = None
) -> EngineCommand:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = free_port()
    argv = (sys.executable, str(script), str(port), str(delay_s), str(child_pid_file or "-"))
    return EngineCommand(argv=argv, host="127.0.0.1", port=port)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited: only its parent has not reaped it yet.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_engines_are_waited_for_then_stopped_with_their_children(tmp_path: Path) -> None:
    child_pid_file = tmp_path / "child.pid"
    command = server_command(tmp_path, delay_s=0.5, child_pid_file=child_pid_file)
    with start_engines([command], log_dir=tmp_path / "logs", health_timeout_s=60) as launched:
        assert launched.urls == (command.url,)
        process = launched.processes[0]
        assert process.returncode() is None
        child_pid = int(child_pid_file.read_text())
        assert alive(child_pid)
        assert "serving" in process.log_tail()
    assert process.returncode() is not None
    deadline = time.monotonic() + 10
    while alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child_pid), "the engine's child process outlived the engine"


def test_an_engine_that_dies_early_fails_the_launch_with_its_log(tmp_path: Path) -> None:
    command = EngineCommand(
        argv=(sys.executable, "-c", "import sys; print('cannot load model: no config.json'); sys.exit(3)"),
        host="127.0.0.1",
        port=free_port(),
    )
    with pytest.raises(EngineUnavailableError, match=r"status 3[\s\S]*cannot load model"):
        start_engines([command], log_dir=tmp_path, health_timeout_s=60)


def test_an_engine_that_never_gets_healthy_times_out_and_is_stopped(tmp_path: Path) -> None:
    command = server_command(tmp_path, delay_s=3600)
    with pytest.raises(EngineUnavailableError, match="not healthy within 1 s"):
        start_engines([command], log_dir=tmp_path, health_timeout_s=1)
    from asyncrl_sglang.launcher import port_is_free

    assert port_is_free("127.0.0.1", command.port)  # the server was stopped


def test_engines_stop_when_the_parent_is_terminated(tmp_path: Path) -> None:
    """A parent stopped by SIGTERM (no handler of its own) still stops the engines it launched."""
    command = server_command(tmp_path, delay_s=0.0)
    parent = tmp_path / "parent.py"
    parent.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from pathlib import Path
            from asyncrl_sglang.launcher import EngineCommand, start_engines
            command = EngineCommand(argv={command.argv!r}, host="127.0.0.1", port={command.port})
            with start_engines([command], log_dir=Path({str(tmp_path)!r}), health_timeout_s=60) as launched:
                print(launched.processes[0].pid, flush=True)
                time.sleep(600)
            """
        )
    )
    runner = subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.PIPE, text=True)
    try:
        assert runner.stdout is not None
        engine_pid = int(runner.stdout.readline())
        assert alive(engine_pid)
        runner.send_signal(signal.SIGTERM)
        runner.wait(timeout=60)
        assert runner.returncode == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while alive(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(engine_pid)
    finally:
        runner.kill()
        runner.wait(timeout=10)
        if runner.stdout is not None:
            runner.stdout.close()


def test_external_launch_waits_for_the_given_urls(tmp_path: Path) -> None:
    command = server_command(tmp_path, delay_s=0.0)
    with start_engines([command], log_dir=tmp_path, health_timeout_s=60):
        config = RolloutConfig.model_validate(
            {"max_running_requests": 4, "sglang": {"launch": "external", "urls": [command.url + "/"]}}
        )
        with launch_engines(config, run_dir=tmp_path) as external:
            assert external.urls == (command.url,)
            assert external.processes == ()
    empty = RolloutConfig.model_validate({"max_running_requests": 4, "sglang": {"launch": "external"}})
    with pytest.raises(EngineControlError, match=r"rollout\.sglang\.urls"):
        launch_engines(empty, run_dir=tmp_path)


@pytest.mark.parametrize("launch", ["builtin", "sglang"])
def test_a_model_path_that_names_no_model_fails_before_any_engine_starts(tmp_path: Path, launch: str) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    for model_path, problem in [
        (str(tmp_path / "empty"), "is not a HuggingFace model folder"),
        (str(tmp_path / "model.gguf"), "is a GGUF file"),
        ("tiny-llama:huge", "unknown model tiny-llama:huge"),
    ]:
        config = RolloutConfig.model_validate(
            {"model_path": model_path, "max_running_requests": 2, "sglang": {"launch": launch}}
        )
        with pytest.raises(AsyncRLError, match=rf"^rollout\.model_path.*{problem}"):
            launch_engines(config, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.integration
async def test_builtin_launch_from_the_rollout_config(tiny_llama_path: Path, tmp_path: Path) -> None:
    from asyncrl_core.types import SamplingParams

    config = RolloutConfig.model_validate(
        {
            "model_path": str(tiny_llama_path),
            "max_running_requests": 2,
            "num_instances": 2,
            "context_length": 256,
            "sglang": {"launch": "builtin", "base_port": free_port()},
        }
    )
    with launch_engines(config, run_dir=tmp_path, health_timeout_s=240, random_seed=11) as launched:
        assert len(launched.urls) == 2
        # `runner.seed` reaches every engine's sampling, each instance with a seed of its own.
        assert [flags(p.command.argv)["--random-seed"] for p in launched.processes] == ["11", "12"]
        assert all((tmp_path / "engines" / f"engine-{index}.log").exists() for index in range(2))
        async with launched.pool() as pool:
            generations = [
                await pool.generate(
                    [1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True), routing_key="t"
                )
                for _ in range(2)
            ]
            assert all(len(generation.output_ids) == 4 for generation in generations)
            infos = [await client.server_info() for client in pool.clients]
            assert {info["context_length"] for info in infos} == {256}
            assert await pool.weight_versions() == [0, 0]
        processes = launched.processes
    assert all(process.returncode() is not None for process in processes)


def test_two_launches_racing_for_one_port_each_get_their_own_engine(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    # Both launches pick the same free port at once; one engine binds it, the other cannot. Each launch must
    # end up with the engine it started (the loser starts again on another port), never with the other's.
    from asyncrl_sglang.port_owner import holds_port

    config = RolloutConfig.model_validate(
        {
            "model_path": str(tiny_llama_path),
            "max_running_requests": 2,
            "sglang": {"launch": "builtin", "base_port": free_port()},
        }
    )
    launched: dict[str, LaunchedEngines] = {}
    failures: list[BaseException] = []
    done = threading.Event()

    def launch(name: str) -> None:
        # The launch's context stops its engines when it exits: it stays open until the checks end.
        try:
            with launch_engines(config, run_dir=tmp_path / name, health_timeout_s=240) as engines:
                launched[name] = engines
                done.wait(300)
        except BaseException as error:
            failures.append(error)
            raise

    threads = [threading.Thread(target=launch, args=(name,), daemon=True) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 300
        while len(launched) + len(failures) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not failures, failures
        ports = [urllib.parse.urlsplit(engines.urls[0]).port for engines in launched.values()]
        assert ports[0] != ports[1]
        for engines, port in zip(launched.values(), ports, strict=True):
            (process,) = engines.processes
            assert port is not None
            assert holds_port(process.pid, port)  # the URL reaches the engine this launch started
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=60)


def test_builtin_engines_take_the_configs_extra_args_and_refuse_unknown_ones(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    command = builtin_command(
        model_path="m",
        host="127.0.0.1",
        port=5,
        max_running_requests=3,
        extra_args={"disable_radix_cache": True, "max_n": 4},
    )
    assert "--disable-radix-cache" in command.argv
    assert flags(command.argv)["--max-n"] == "4"
    # From the configuration: a flag the built-in engine lacks (an SGLang one) is refused before any start.
    config = RolloutConfig.model_validate(
        {
            "model_path": str(tiny_llama_path),
            "max_running_requests": 2,
            "sglang": {"launch": "builtin", "extra_args": {"mem_fraction_static": 0.8}},
        }
    )
    with pytest.raises(EngineControlError, match=r"^rollout\.sglang\.extra_args.*mem-fraction-static"):
        launch_engines(config, run_dir=tmp_path / "run")
    assert not (tmp_path / "run" / "engines").exists()


def test_only_builtin_engines_start_paused_and_only_when_the_launcher_says(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    paused = builtin_command(model_path="m", host="h", port=5, max_running_requests=3, start_paused=True)
    assert "--start-paused" in paused.argv
    serving = builtin_command(model_path="m", host="h", port=5, max_running_requests=3)
    assert "--start-paused" not in serving.argv
    # Set in the configuration it would hold every request of the run: refused, naming the key.
    with pytest.raises(EngineControlError, match=r"^rollout\.sglang\.extra_args: start_paused"):
        builtin_command(
            model_path="m", host="h", port=5, max_running_requests=3, extra_args={"start_paused": True}
        )
    # SGLang has no flag for it, and a pause sent once it answers comes too late: refused before any start.
    config = RolloutConfig.model_validate(
        {"model_path": str(tiny_llama_path), "max_running_requests": 2, "sglang": {"launch": "sglang"}}
    )
    with pytest.raises(EngineControlError, match="an SGLang server cannot start paused"):
        launch_engines(config, run_dir=tmp_path / "run", start_paused=True)
    assert not (tmp_path / "run").exists()
