"""Which names verl's registries get: the Pascal rollout under ``oldgpu-hf``.

verl (>= 0.7) looks a rollout up twice by its name: ``get_rollout_class(name, mode)``
reads the plain dict ``_ROLLOUT_REGISTRY`` in ``verl/workers/rollout/base.py`` (the
``BaseRollout`` in the trainer's workers), ``RolloutReplicaRegistry.get(name)`` in
``verl/workers/rollout/replica.py`` (the replica that starts the server). Both are
filled here, in every process that imports verl, by ``VERL_USE_EXTERNAL_MODULES=
oldgpu.verl_plugin.hook``; nothing in verl's tree changes. Registering twice is
harmless.

A verl without these registries (0.5.0 has neither) is refused with the reason, rather
than left to fail later at the lookup with "Rollout oldgpu-hf ... not found".
"""

from __future__ import annotations

import importlib
from typing import Any

from oldgpu.rollout import ROLLOUT_NAME

MODE = "async"
ADAPTER = "oldgpu.rollout.adapter.HFServerAdapter"
BASE_MODULE = "verl.workers.rollout.base"
REPLICA_MODULE = "verl.workers.rollout.replica"


class RegistryMissing(RuntimeError):
    """This verl has no rollout registry to join (verl < 0.7, or a changed layout)."""


def _load_replica() -> type:
    # Imported on lookup only: the replica module pulls in Ray actors and torch.
    from oldgpu.rollout.replica import HFReplica

    return HFReplica


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise RegistryMissing(
            f"cannot register the {ROLLOUT_NAME} rollout: {name} does not import ({exc}); "
            "it needs verl >= 0.7 (server-mode rollouts)"
        ) from exc


def register() -> dict[str, Any]:
    """Add ``oldgpu-hf`` to both registries; returns what was registered."""
    base = _module(BASE_MODULE)
    registry = getattr(base, "_ROLLOUT_REGISTRY", None)
    if not isinstance(registry, dict):
        raise RegistryMissing(
            f"cannot register the {ROLLOUT_NAME} rollout: {BASE_MODULE} has no "
            "_ROLLOUT_REGISTRY dict (verl < 0.7 or a changed layout)"
        )
    replica = _module(REPLICA_MODULE)
    replicas = getattr(replica, "RolloutReplicaRegistry", None)
    if replicas is None or not callable(getattr(replicas, "register", None)):
        raise RegistryMissing(
            f"cannot register the {ROLLOUT_NAME} rollout: {REPLICA_MODULE} has no "
            "RolloutReplicaRegistry.register"
        )
    registry[(ROLLOUT_NAME, MODE)] = ADAPTER
    replicas.register(ROLLOUT_NAME, _load_replica)
    return {"rollout": ROLLOUT_NAME, "mode": MODE, "adapter": ADAPTER}
