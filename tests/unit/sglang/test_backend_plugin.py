"""The runner reaches its rollout backend through the plugin registry alone: `sglang` is asyncrl-sglang's
entry point, and a backend named by `module:attr` is the one the runner's weight sync goes through."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl_core import plugins
from asyncrl_core.config import load_config
from asyncrl_core.errors import PluginError
from asyncrl_core.protocols import WeightGroup
from asyncrl_core.runner.placement import LOOPBACK
from asyncrl_core.runner.rollout_backend import rollout_backend
from asyncrl_core.runner.workers import weight_transport
from asyncrl_sglang.backend import SGLangBackend
from asyncrl_sglang.weight_sync import DistributedTransport, TensorTransport, WeightTransport

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


class RecordingBackend(SGLangBackend):
    """The sglang backend, recording the weight groups the runner gives it."""

    groups: list[WeightGroup] = []  # noqa: RUF012 (shared on purpose: the runner builds its own instance)

    def weight_transport(self, group: WeightGroup) -> WeightTransport:
        RecordingBackend.groups.append(group)
        return super().weight_transport(group)


def test_sglang_is_an_entry_point_of_asyncrl_sglang() -> None:
    (info,) = [info for info in plugins.available("asyncrl.rollout_backends") if info.name == "sglang"]
    assert info.source.startswith("asyncrl-sglang ")
    assert info.error is None
    assert "sglang" not in plugins.BUILTINS["asyncrl.rollout_backends"]
    config = load_config(EXAMPLES / "searchr1-mini.yaml", [])
    backend = rollout_backend(config)
    assert isinstance(backend, SGLangBackend)
    assert isinstance(weight_transport(config), TensorTransport)


def test_the_weight_sync_goes_through_the_backend_the_configuration_names() -> None:
    name = f"{__name__}:RecordingBackend"
    config = load_config(
        EXAMPLES / "searchr1-mini.yaml",
        [f"rollout.rollout_backend={name}", "rollout.sglang.weight_transport=distributed"],
    )
    RecordingBackend.groups.clear()
    transport = weight_transport(config)
    assert isinstance(transport, DistributedTransport)
    (group,) = RecordingBackend.groups
    assert (group.master_address, group.backend, group.device) == (LOOPBACK, "gloo", "cpu")
    assert transport.master_port == group.master_port


def test_a_target_that_builds_no_backend_is_refused() -> None:
    config = load_config(
        EXAMPLES / "searchr1-mini.yaml", ["rollout.rollout_backend=asyncrl_core.metrics:TIME_STEP"]
    )
    with pytest.raises(PluginError, match="is not a factory of backends"):
        rollout_backend(config)
