"""The user cache of start-up artefacts: an entry per set of inputs, built once, checked on every use."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

from asyncrl_core import cache


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))
    cache.set_rebuild(False)


class Builder:
    """Writes two files from its inputs; counts its builds."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, folder: Path, text: str = "weights") -> None:
        with self.lock:
            self.calls += 1
        (folder / "model.bin").write_text(text * 100)
        (folder / "sub").mkdir()
        (folder / "sub" / "config.json").write_text('{"a": 1}')


def test_an_entry_is_built_once_and_reused() -> None:
    build = Builder()
    first = cache.cached("models", {"name": "x", "seed": 0}, build)
    assert not first.reused
    assert first.path.parent == (cache.cache_dir() / "models").resolve()
    assert (first.path / "sub" / "config.json").read_text() == '{"a": 1}'
    again = cache.cached("models", {"seed": 0, "name": "x"}, build)  # the same inputs in another order
    assert again.reused
    assert again.path == first.path
    assert build.calls == 1
    record = json.loads((first.path / cache.ENTRY_FILE).read_text())
    assert record["inputs"] == {"name": "x", "seed": 0}
    assert set(record["files"]) == {"model.bin", "sub/config.json"}
    assert cache.entry_key(first.path) == first.key


def test_other_inputs_are_another_entry() -> None:
    build = Builder()
    entries = [
        cache.cached("models", inputs, build)
        for inputs in ({"name": "x"}, {"name": "y"}, {"name": "x", "seed": 1}, {"name": ["x"]})
    ]
    assert len({entry.path for entry in entries}) == 4
    assert build.calls == 4
    assert cache.cached("other-kind", {"name": "x"}, build).path != entries[0].path


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda folder: (folder / "model.bin").write_text("weightz" * 100), "model.bin has another BLAKE3"),
        (lambda folder: (folder / "model.bin").write_text("short"), "model.bin has another size"),
        (lambda folder: (folder / "sub" / "config.json").unlink(), "sub/config.json is missing"),
        (lambda folder: (folder / "stray.txt").write_text("?"), "stray.txt was not part of it"),
        (lambda folder: (folder / cache.ENTRY_FILE).write_text("{"), "unreadable"),
        (lambda folder: (folder / cache.ENTRY_FILE).unlink(), f"no {cache.ENTRY_FILE}"),
    ],
)
def test_a_damaged_entry_is_named_and_built_again(
    damage: object, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    build = Builder()
    entry = cache.cached("models", {"name": "x"}, build)
    assert callable(damage)
    damage(entry.path)
    cache._verified.clear()  # a new process: nothing checked yet  # pyright: ignore[reportPrivateUsage]
    assert cache.entry_key(entry.path) is None
    with caplog.at_level(logging.WARNING, logger="asyncrl_core.cache"):
        rebuilt = cache.cached("models", {"name": "x"}, build)
    assert not rebuilt.reused
    assert rebuilt.path == entry.path
    assert build.calls == 2
    assert (rebuilt.path / "model.bin").read_text() == "weights" * 100
    assert not (rebuilt.path / "stray.txt").exists()
    warning = "\n".join(record.getMessage() for record in caplog.records)
    assert f"cache entry {entry.path} is damaged" in warning
    assert named in warning
    assert cache.entry_key(rebuilt.path) == entry.key


def test_a_failed_build_leaves_nothing_and_a_rebuild_replaces() -> None:
    def failing(folder: Path) -> None:
        (folder / "half.bin").write_text("half")
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        cache.cached("models", {"name": "x"}, failing)
    assert list((cache.cache_dir() / "models").iterdir()) == [
        cache.cache_dir().resolve() / "models" / f".{cache.key_of({'name': 'x'})}.lock"
    ]

    build = Builder()
    first = cache.cached("models", {"name": "x"}, build)
    cache.set_rebuild(True)
    rebuilt = cache.cached("models", {"name": "x"}, lambda folder: build(folder, "fresh"))
    assert not rebuilt.reused
    assert (rebuilt.path / "model.bin").read_text() == "fresh" * 100
    # Once a process: the rebuilt entry serves every later request.
    assert cache.cached("models", {"name": "x"}, build).reused
    assert build.calls == 2
    assert rebuilt.path == first.path


def test_processes_asking_at_once_build_it_once() -> None:
    build = Builder()
    entries: list[cache.CacheEntry] = []
    threads = [
        threading.Thread(target=lambda: entries.append(cache.cached("models", {"name": "x"}, build)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(entries) == 4
    assert build.calls == 1
    assert sorted(entry.reused for entry in entries) == [False, True, True, True]


def test_library_versions_name_what_is_installed() -> None:
    versions = cache.library_versions("pytest", "no-such-distribution-here")
    assert versions["pytest"] == pytest.__version__
    assert versions["no-such-distribution-here"] == "absent"
