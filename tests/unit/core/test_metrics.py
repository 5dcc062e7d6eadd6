"""`asyncrl_core.metrics`: every documented metric name is a constant, and the module stays light."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl_core import metrics

REPO_ROOT = Path(__file__).resolve().parents[3]
ARCHITECTURE = REPO_ROOT.parent / "shared" / "ARCHITECTURE.md"

# The names of ARCHITECTURE.md sections 3 and 8, used where that file is not beside the repository.
DOCUMENTED_NAMES = {
    "time/step",
    "time/rollout",
    "time/training",
    "time/sync_weights",
    "time/wait_data",
    "rollout/buffer/admission_wait_inflight_limit",
    "rollout/buffer/admission_wait_buffer_full",
    "rollout/data_staleness/mean",
    "rollout/data_staleness/max",
    "rollout/data_staleness/ratio_<k>",
    "rollout/version_span/mean",
    "rollout/queue_steps/mean",
    "rollout/reward/mean",
    "rollout/turns/mean",
    "rollout/tokens_per_s",
    "rollout/dropped_groups",
    "train/loss",
    "train/kl",
    "train/clip_frac",
    "train/grad_norm",
    "eval/reward/mean",
}


def section(text: str, number: int) -> str:
    """The body of `## <number>. ...` up to the next level-2 heading."""
    found = re.search(rf"^## {number}\.[^\n]*\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert found is not None, f"ARCHITECTURE.md has no section {number}"
    return found.group(1)


def names_in(text: str) -> set[str]:
    """Metric names written in backquotes; a name such as `/max` right after a full one shares its parent."""
    names: set[str] = set()
    parent = ""
    for token in re.findall(r"`([^`\s]+)`", text):
        if re.fullmatch(r"(time|rollout|train|eval)/[\w/<>]+", token):
            names.add(token)
            parent = token.rsplit("/", 1)[0]
        elif parent and re.fullmatch(r"/[\w<>]+", token):
            names.add(parent + token)
    return names


def documented_names() -> set[str]:
    if not ARCHITECTURE.exists():
        return DOCUMENTED_NAMES
    text = ARCHITECTURE.read_text(encoding="utf-8")
    return names_in(section(text, 3)) | names_in(section(text, 8))


def constants() -> set[str]:
    return {value for name, value in vars(metrics).items() if name.isupper() and isinstance(value, str)}


def test_the_parser_reads_suffixes_after_a_full_name() -> None:
    text = "as `rollout/data_staleness/mean`, `/max`, `/ratio_<k>` (share), `rollout/version_span/mean`."
    assert names_in(text) == {
        "rollout/data_staleness/mean",
        "rollout/data_staleness/max",
        "rollout/data_staleness/ratio_<k>",
        "rollout/version_span/mean",
    }


def test_every_documented_name_is_a_constant() -> None:
    names = documented_names()
    assert names >= DOCUMENTED_NAMES  # the parser found at least what the architecture names today
    defined = constants()
    for name in names:
        if "<k>" in name:
            assert metrics.data_staleness_ratio(3) == name.replace("<k>", "3")
        else:
            assert name in defined, f"{name} is documented but not a constant of asyncrl_core.metrics"


def test_names_are_unique_and_well_formed() -> None:
    values = [value for name, value in vars(metrics).items() if name.isupper() and isinstance(value, str)]
    assert len(values) == len(set(values))
    for name, value in vars(metrics).items():
        if not name.isupper() or not isinstance(value, str):
            continue
        if name.startswith("TRAJECTORY_"):
            assert re.fullmatch(r"[a-z_]+", value), name
        elif name.endswith("_PREFIX"):  # completed by a builder: `data_staleness_ratio`, `trajectory_mean`
            assert re.fullmatch(r"(time|rollout|train|eval)(/[a-z_]+)+[/_]", value), name
        else:
            assert re.fullmatch(r"(time|rollout|train|eval)(/[a-z_]+)+", value), name


def test_groupings_hold_constants_once() -> None:
    grouped = [*metrics.EVERY_STEP, *metrics.SYNC_MODE_ONLY, *metrics.ASYNC_MODE_ONLY, *metrics.EVAL_STEP]
    assert len(grouped) == len(set(grouped))
    assert set(grouped) <= constants()
    documented = {name for name in documented_names() if "<k>" not in name}
    assert documented <= set(grouped)


def test_trajectory_mean() -> None:
    assert metrics.trajectory_mean(metrics.TRAJECTORY_TOOL_S) == "rollout/trajectory/tool_s/mean"


def test_data_staleness_ratio() -> None:
    assert metrics.data_staleness_ratio(0) == "rollout/data_staleness/ratio_0"
    assert metrics.data_staleness_ratio(12).startswith(metrics.DATA_STALENESS_RATIO_PREFIX)
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        metrics.data_staleness_ratio(-1)


def test_module_imports_only_the_standard_library() -> None:
    code = (
        "import json, sys; before = set(sys.modules); import asyncrl_core.metrics; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = {name.split(".")[0] for name in json.loads(done.stdout)}
    assert "asyncrl_core" in loaded
    third_party = loaded - set(sys.stdlib_module_names) - {"asyncrl_core"}
    assert not third_party, third_party
