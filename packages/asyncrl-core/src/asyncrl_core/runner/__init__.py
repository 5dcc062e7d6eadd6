"""The runner: Ray workers assembled into a training run, synchronous or asynchronous.

`run(config)` is what `asyncrl-run` calls; `workers` holds the plain worker classes, `groups` their Ray
actors, `sync` and `async_` the two drivers. Importing this package imports neither Ray nor torch.
"""

from asyncrl_core.runner.main import run

__all__ = ["run"]
