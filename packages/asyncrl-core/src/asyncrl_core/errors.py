"""asyncrl's exception hierarchy: every error a user can cause is an `AsyncRLError` with a clear message."""


class AsyncRLError(Exception):
    """Base class of every error asyncrl raises on purpose."""


class ConfigError(AsyncRLError):
    """The configuration is invalid; the message names each offending key and the fix."""


class PluginError(AsyncRLError):
    """A plugin (task, actor or rollout backend) could not be found or loaded."""


class GenerationError(AsyncRLError):
    """The rollout engine refused a request (bad input, prompt too long); retrying will not help."""


class EngineUnavailableError(AsyncRLError):
    """The rollout engine could not be reached within the retries and timeouts allowed."""
