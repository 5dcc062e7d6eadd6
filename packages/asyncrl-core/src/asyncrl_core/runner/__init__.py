"""The runner: the drivers of sync and async mode, their workers, and the run folder's outputs."""
