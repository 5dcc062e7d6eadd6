"""The tasks that ship with asyncrl: `searchr1` and `searchr1-mini` (entry points of `asyncrl.tasks`); any
registered task is built by name with `asyncrl_core.tasks.load_task`."""
