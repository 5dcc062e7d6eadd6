"""The cost of hashing one large checkpoint file beside the cost of writing it.

Writes a safetensors file of `--gib` GiB of float32 weights the way the torch actor does (`save_file`, then
`fsync`), then hashes it, side by side in one process:
- `sha256`: what manifests held before BLAKE3 (OpenSSL through `hashlib.file_digest`), the file read back
  from the page cache;
- `sha256 in memory`: the same hash of bytes already in memory, to split hashing from reading;
- `blake3 1 thread`: BLAKE3 on one core;
- `blake3 (manifest)`: what the manifest computes (`asyncrl_core.runner.checkpoint._digest`): BLAKE3,
  memory-mapped, on every core;
- `xxh3_128`: a non-cryptographic hash, when `xxhash` is installed
  (`uv run --with xxhash python benchmarks/micro/checkpoint_hash.py`).

Prints, per size, the best wall and CPU time of `--repeat` runs and each hash's time as a share of the write.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import blake3
import torch
from safetensors.torch import save_file

from asyncrl_core.runner.checkpoint import HASH, LEGACY_HASH, _digest  # pyright: ignore[reportPrivateUsage]

CHUNK = 1 << 24


def timed(function: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Best wall and CPU seconds of `repeat` calls."""
    walls: list[float] = []
    cpus: list[float] = []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        function()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


def write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def hashes(path: Path) -> dict[str, Callable[[], object]]:
    data = path.read_bytes()
    found: dict[str, Callable[[], object]] = {
        "sha256": lambda: _digest(path, LEGACY_HASH),
        "sha256 in memory": lambda: hashlib.sha256(data).hexdigest(),
        "blake3 1 thread": lambda: blake3.blake3().update_mmap(path).hexdigest(),
        "blake3 (manifest)": lambda: _digest(path, HASH),
    }
    try:
        import xxhash  # pyright: ignore[reportMissingImports]
    except ImportError:
        print("(xxhash not installed: xxh3_128 skipped)")
    else:

        def xxh3() -> str:
            digest = xxhash.xxh3_128()  # pyright: ignore
            with open(path, "rb") as file:
                while chunk := file.read(CHUNK):
                    digest.update(chunk)  # pyright: ignore
            return digest.hexdigest()  # pyright: ignore

        found["xxh3_128"] = xxh3
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="checkpoint-hash-") as folder:
        for gib in args.gib:
            elements = int(gib * (1 << 30)) // 4
            tensors = {f"layer.{i}.weight": torch.randn(elements // 8) for i in range(8)}
            path = Path(folder) / "model.safetensors"
            write_wall, write_cpu = timed(functools.partial(write, path, tensors), args.repeat)
            tensors.clear()
            size = path.stat().st_size / (1 << 30)
            print(f"\n{size:.2f} GiB file: write + fsync {write_wall:.2f} s wall, {write_cpu:.2f} s CPU")
            print(f"{'hash':<18} {'wall s':>7} {'CPU s':>7} {'GiB/s':>6} {'of write':>9}")
            for name, function in hashes(path).items():
                wall, cpu = timed(function, args.repeat)
                print(f"{name:<18} {wall:>7.2f} {cpu:>7.2f} {size / wall:>6.2f} {wall / write_wall:>8.0%}")
            path.unlink()


if __name__ == "__main__":
    main()
