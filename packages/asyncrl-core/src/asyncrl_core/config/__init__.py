"""The configuration of an asyncrl run: pydantic models, YAML loading with interpolation and overrides,
derived defaults and the validation that runs before any worker starts.

Importing this package imports pydantic, OmegaConf and PyYAML only (no torch, Ray, Megatron or SGLang).
"""

from asyncrl_core.config.loader import load_config, parse_overrides, render_yaml
from asyncrl_core.config.models import (
    ActorCommon,
    ActorConfig,
    AgentLoopConfig,
    AlgorithmConfig,
    AsyncRLConfig,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    LoggingConfig,
    MegatronActorConfig,
    PluginActorConfig,
    RolloutBufferConfig,
    RolloutConfig,
    RunnerConfig,
    SamplingConfig,
    SGLangConfig,
    TorchActorConfig,
    WarmStartConfig,
)
from asyncrl_core.config.task_args import TaskArguments
from asyncrl_core.config.validate import derived_max_inflight_groups

__all__ = [
    "ActorCommon",
    "ActorConfig",
    "AgentLoopConfig",
    "AlgorithmConfig",
    "AsyncRLConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "DataConfig",
    "LoggingConfig",
    "MegatronActorConfig",
    "PluginActorConfig",
    "RolloutBufferConfig",
    "RolloutConfig",
    "RunnerConfig",
    "SGLangConfig",
    "SamplingConfig",
    "TaskArguments",
    "TorchActorConfig",
    "WarmStartConfig",
    "derived_max_inflight_groups",
    "load_config",
    "parse_overrides",
    "render_yaml",
]
