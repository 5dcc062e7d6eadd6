"""asyncrl_agents: see the package README for what it owns."""

__version__ = "0.1.0"
