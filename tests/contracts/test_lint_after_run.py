"""The README's two commands work in its order: `make run`, then `make test`.

`make run` leaves folders at the repository's root (`runs/<name>/`, and `dist/` after `make wheels`) that
nothing commits; none of them may change what the lint says about the committed code. (A root folder named
`runs` once made ruff's import sorting take the benchmarks' own `runs` module for a first-party package.)
The check copies the committed Python files and the lint's configuration into a temporary folder, adds what
a run leaves, and runs the lint there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUFF = Path(sys.executable).with_name("ruff")

RUN_OUTPUTS = {
    "runs/searchr1-mini-20261207-120000/config.yaml": "runner:\n  async_mode: true\n",
    "runs/searchr1-mini-20261207-120000/metrics.jsonl": "{}\n",
    "runs/searchr1-mini-20261207-120000/checkpoints/step_1/manifest.json": "{}\n",
    "runs/searchr1-mini-20261207-120000/warm_start/config.json": "{}\n",
    "dist/README": "wheels\n",
}
"""Files as `make run` and `make wheels` leave them at the root (their names matter, not their contents)."""


def _committed_python_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "*.py", "*.pyi", "pyproject.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return listed.stdout.split()


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the repository's git checkout")
@pytest.mark.skipif(not RUFF.exists(), reason="ruff is a dev tool of the workspace")
def test_the_lint_passes_beside_what_a_run_leaves(tmp_path: Path) -> None:
    for name in _committed_python_files():
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, target)

    for name, text in RUN_OUTPUTS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    # The benchmarks' module `runs` and a run folder share a name: the case that once broke the lint.
    assert (tmp_path / "benchmarks" / "system" / "runs.py").is_file()
    for command in (["check", "--no-cache", "."], ["format", "--no-cache", "--check", "."]):
        done = subprocess.run(
            [str(RUFF), *command], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"ruff {' '.join(command)} beside a run's outputs:\n{done.stdout}"
