"""Checkpoint files without a run: the atomic writer, the manifest and its check, the choice of the checkpoint
to resume (damaged ones passed over with a warning), the commit and rotation of checkpoint folders, the buffer
state's files, and what a resume must match."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from asyncrl_core.config import load_config
from asyncrl_core.runner.atomic import atomic_write_bytes
from asyncrl_core.runner.checkpoint import (
    CHECKPOINT_FORMAT,
    begin,
    check_resumable,
    checkpoints,
    commit,
    identity_problems,
    read_buffer_state,
    resolve_resume,
    run_identity,
    verify_checkpoint,
    write_buffer_state,
    write_manifest,
)
from asyncrl_core.runner.workers import BufferWorker, RunnerError
from asyncrl_core.types import NO_VERSION, Group, Trajectory


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    atomic_write_bytes(path, b"old")
    atomic_write_bytes(path, b"new content")
    assert path.read_bytes() == b"new content"
    with pytest.raises(TypeError):
        atomic_write_bytes(path, "not bytes")  # type: ignore[arg-type]  # fails while writing
    assert path.read_bytes() == b"new content"
    assert [p.name for p in tmp_path.iterdir() if p.name != ".state.json.tmp"] == ["state.json"]


def _checkpoint(run_dir: Path, step: int, keep_last: int = 5) -> Path:
    final, temporary = begin(run_dir, step)
    (temporary / "actor").mkdir()
    (temporary / "actor" / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    return commit(temporary, final, {"format": CHECKPOINT_FORMAT, "step": step}, keep_last)


def test_the_manifest_finds_truncated_altered_and_missing_files(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "run", 1)
    assert verify_checkpoint(folder) == []
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["files"]) == {"actor/model.safetensors", "runner_state.json"}
    model = folder / "actor" / "model.safetensors"
    data = model.read_bytes()
    model.write_bytes(data[:100])
    assert verify_checkpoint(folder) == [f"{model}: 100 bytes, the manifest says {len(data)}"]
    model.write_bytes(b"\xff" + data[1:])
    assert verify_checkpoint(folder) == [f"{model}: its BLAKE3 differs from the manifest's"]
    model.unlink()
    assert verify_checkpoint(folder) == [f"{model}: missing"]
    (folder / "manifest.json").write_text("{")
    (problem,) = verify_checkpoint(folder)
    assert problem.startswith(f"{folder / 'manifest.json'}: cannot read the manifest")
    assert verify_checkpoint(tmp_path / "absent") == [f"{tmp_path / 'absent'} is not a folder"]
    # Rewriting the manifest makes the folder consistent again (what a new checkpoint does).
    model.write_bytes(data)
    write_manifest(folder)
    assert verify_checkpoint(folder) == []


def test_a_manifest_written_with_sha256_is_still_checked(tmp_path: Path) -> None:
    # Checkpoints taken before BLAKE3 list each file's SHA-256: they verify and resume as they did.
    folder = _checkpoint(tmp_path / "run", 1)
    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for name, entry in manifest["files"].items():
        assert set(entry) == {"size", "blake3"}
        entry.pop("blake3")
        entry["sha256"] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))
    assert verify_checkpoint(folder) == []
    model = folder / "actor" / "model.safetensors"
    model.write_bytes(b"\xff" + model.read_bytes()[1:])
    assert verify_checkpoint(folder) == [f"{model}: its SHA-256 differs from the manifest's"]


def test_latest_passes_over_a_damaged_checkpoint_with_a_warning_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(RunnerError, match="holds no checkpoint"):
        resolve_resume(run_dir, "latest")
    first, second = _checkpoint(run_dir, 1), _checkpoint(run_dir, 2)
    assert resolve_resume(run_dir, "latest") == second
    model = second / "actor" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:10])
    with caplog.at_level(logging.WARNING):
        assert resolve_resume(run_dir, "latest") == first
    assert f"checkpoint {second} is damaged, passed over: {model}: 10 bytes" in caplog.text
    assert str(model) in (run_dir / "warnings.log").read_text()
    with pytest.raises(RunnerError, match=f"{second} is damaged: {model}"):
        resolve_resume(run_dir, str(second))  # a folder named explicitly is not replaced by another
    (first / "manifest.json").unlink()
    with pytest.raises(RunnerError, match=r"no checkpoint under .* is intact"):
        resolve_resume(run_dir, "latest")


def test_commit_renames_into_place_rotates_and_replaces_a_damaged_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for step in (1, 2, 3):
        _checkpoint(run_dir, step, keep_last=2)
    assert [p.name for p in checkpoints(run_dir)] == ["step_2", "step_3"]
    # A write killed half-way leaves only its temporary folder; the next checkpoint removes it.
    _, temporary = begin(run_dir, 4)
    (temporary / "half").write_bytes(b"x")
    assert [p.name for p in checkpoints(run_dir)] == ["step_2", "step_3"]
    damaged = run_dir / "checkpoints" / "step_3" / "runner_state.json"
    damaged.write_text("{")
    replaced = _checkpoint(run_dir, 3, keep_last=2)
    assert verify_checkpoint(replaced) == []
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_2", "step_3"]


def _group(group_id: int, prompt_index: int) -> Group:
    trajectory = Trajectory(
        token_ids=[1, 2, 3, 4],
        prompt_len=2,
        loss_mask=[1, 0],
        rollout_logprobs=[-0.25, 0.0],
        versions=[0, -1],
    )
    trajectory.reward = 0.5
    trajectory.metrics = {"tool_calls": 1.0}
    return Group(group_id, prompt_index, [trajectory], finish_version=NO_VERSION)


def test_buffer_state_files_round_trip(tmp_path: Path) -> None:
    config = load_config(None, [f"runner.run_dir={tmp_path / 'run'}", "data.shuffle=false"])
    worker = BufferWorker(config, dataset_size=4)
    (first, prompt), (second, _) = worker.admit(2, timeout_s=0.0)
    assert worker.complete(_group(first, prompt))
    state = worker.state()
    write_buffer_state(tmp_path, state)
    read = read_buffer_state(tmp_path, json.loads(json.dumps(_loader_json(state))))
    assert read.snapshot.core_state == state.snapshot.core_state
    assert read.snapshot.groups == state.snapshot.groups
    assert read.loader == state.loader
    assert read.ledger == state.ledger
    resumed = BufferWorker(config, dataset_size=4)
    assert resumed.restore(read) == [1]  # the group in flight (`second`) is issued again first
    assert resumed.buffer.buffered_groups()[0].trajectories[0].metrics == {"tool_calls": 1.0}
    assert second == first + 1


def _loader_json(state: object) -> dict[str, object]:
    from dataclasses import asdict

    return asdict(state.loader)  # type: ignore[attr-defined]


def test_a_checkpoint_of_another_dataset_seed_or_task_is_refused(tmp_path: Path) -> None:
    config = load_config(None, [f"runner.run_dir={tmp_path / 'run'}", "runner.seed=3"])
    identity = run_identity(config, 8, "ab12")
    final, temporary = begin(tmp_path / "run", 1)
    folder = commit(temporary, final, {"format": CHECKPOINT_FORMAT, "step": 1, "identity": identity}, 2)
    assert check_resumable(folder, identity)["step"] == 1
    other = run_identity(load_config(None, ["runner.seed=4", "agentloop.task_name=arith"]), 9, "cd34")
    with pytest.raises(RunnerError, match="belongs to another run") as refused:
        check_resumable(folder, other)
    message = str(refused.value)
    for difference in (
        "task_name: the checkpoint's is 'searchr1-mini', this run's 'arith'",
        "dataset_size: the checkpoint's is 8, this run's 9",
        "dataset_fingerprint: the checkpoint's is 'ab12', this run's 'cd34'",
        "runner.seed: the checkpoint's is 3, this run's 4",
        "data.seed: the checkpoint's is 3, this run's 4",
    ):
        assert difference in message
    assert identity_problems(identity, dict(identity)) == []
