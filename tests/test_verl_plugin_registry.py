"""``VERL_USE_EXTERNAL_MODULES=oldgpu.verl_plugin.hook``: the rollout joins verl's registries.

Against stand-ins of verl 0.9.0's two registries (``_ROLLOUT_REGISTRY``, a dict in
``verl/workers/rollout/base.py``; ``RolloutReplicaRegistry`` in ``replica.py``, the
same shapes as the sdist's), so it runs without verl; the real sdist is exercised by
tests/test_rollout_verl09.py where a verl 0.9.0 venv exists.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import pytest

from oldgpu.rollout import ROLLOUT_NAME
from oldgpu.verl_plugin import registry


class FakeReplicaRegistry:
    _registry: ClassVar[dict[str, Callable[[], type]]] = {}

    @classmethod
    def register(cls, name: str, loader: Callable[[], type]) -> None:
        cls._registry[name] = loader


def _install(monkeypatch, *, rollout_registry=True, replica_registry=True) -> types.ModuleType:
    base = types.ModuleType(registry.BASE_MODULE)
    if rollout_registry:
        base._ROLLOUT_REGISTRY = {("vllm", "async"): "verl.workers.rollout.vllm_rollout.X"}
    replica = types.ModuleType(registry.REPLICA_MODULE)
    if replica_registry:
        FakeReplicaRegistry._registry = {}
        replica.RolloutReplicaRegistry = FakeReplicaRegistry
    for name in ("verl", "verl.workers", "verl.workers.rollout"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, registry.BASE_MODULE, base)
    monkeypatch.setitem(sys.modules, registry.REPLICA_MODULE, replica)
    return base


def test_registers_the_adapter_and_the_replica(monkeypatch):
    base = _install(monkeypatch)
    assert registry.register() == {
        "rollout": ROLLOUT_NAME,
        "mode": "async",
        "adapter": "oldgpu.rollout.adapter.HFServerAdapter",
    }
    assert base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] == registry.ADAPTER
    assert ("vllm", "async") in base._ROLLOUT_REGISTRY  # verl's own entries stay
    assert FakeReplicaRegistry._registry[ROLLOUT_NAME] is registry._load_replica


def test_registering_twice_is_harmless(monkeypatch):
    base = _install(monkeypatch)
    registry.register()
    registry.register()
    assert list(base._ROLLOUT_REGISTRY).count((ROLLOUT_NAME, "async")) == 1


def test_the_adapter_path_names_a_class_of_ours():
    module, cls = registry.ADAPTER.rsplit(".", 1)
    source = importlib.util.find_spec(module)
    assert source is not None and f"class {cls}(" in Path(source.origin).read_text()


def test_a_verl_without_the_rollout_registry_is_refused(monkeypatch):
    _install(monkeypatch, rollout_registry=False)
    with pytest.raises(registry.RegistryMissing, match="_ROLLOUT_REGISTRY"):
        registry.register()


def test_a_verl_without_the_replica_registry_is_refused(monkeypatch):
    base = _install(monkeypatch, replica_registry=False)
    with pytest.raises(registry.RegistryMissing, match="RolloutReplicaRegistry"):
        registry.register()
    assert (ROLLOUT_NAME, "async") not in base._ROLLOUT_REGISTRY  # nothing half-registered


def test_a_verl_without_server_rollouts_is_refused(monkeypatch):
    # verl 0.5.0: verl/workers/rollout/ has no replica.py.
    monkeypatch.setitem(sys.modules, "verl", types.ModuleType("verl"))
    monkeypatch.setitem(sys.modules, registry.BASE_MODULE, None)  # import fails
    with pytest.raises(registry.RegistryMissing, match=r"verl >= 0\.7"):
        registry.register()
