"""asyncrl_core: configuration, the buffer, runner, workers, algorithms, the torch actor and the CLI.

Importing this package is cheap: torch, Ray, Megatron and SGLang are imported only by the modules and
workers that use them, when they start.
"""

__version__ = "0.1.0"
