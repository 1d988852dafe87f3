"""The ``RolloutReplica`` verl's ``LLMServerManager`` builds for ``rollout.name=oldgpu-hf``.

One replica is one server on one device (the rollout's world size must be 1: HF
``generate`` has no tensor parallelism), so a job with N trainer ranks gets N replicas,
one per card, each colocated with its rank. ``launch_servers`` mirrors vLLM's for that
case: it asks the replica's worker for its node and its card, starts the server there
under the name the adapter looks up, and hands it the worker: by default the server
generates in that worker (``colocated.py``) and takes no card of its own; with
``weights: copy`` it is given the worker's card (Ray's NOSET variables, so Ray leaves
the choice to the server) and loads its own copy.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from verl.plugin.platform import get_platform
from verl.utils.device import get_resource_name, get_visible_devices_keyword
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from oldgpu.rollout import ROLLOUT_NAME
from oldgpu.rollout.adapter import server_actor_name
from oldgpu.rollout.server import HFRolloutServer, weights_mode
from oldgpu.rollout.settings import WEIGHTS_TRAINER


def _node_and_card(worker_self: Any) -> tuple[str, str | None]:
    # Runs inside a trainer worker (``__ray_call__``): its node, and its card if it has one.
    ctx = ray.get_runtime_context()
    ids = ctx.get_accelerator_ids().get(get_resource_name()) or []
    return ctx.get_node_id(), (str(ids[0]) if ids else None)


class HFReplica(RolloutReplica):
    def __init__(
        self,
        replica_rank: int,
        config: Any,
        model_config: Any,
        gpus_per_node: int = 8,
        is_reward_model: bool = False,
        is_teacher_model: bool = False,
        name_suffix: str = "",
    ) -> None:
        if is_reward_model or is_teacher_model:
            raise NotImplementedError(f"{ROLLOUT_NAME} serves the policy only")
        super().__init__(
            replica_rank,
            config,
            model_config,
            gpus_per_node,
            is_reward_model,
            is_teacher_model,
            name_suffix,
        )
        if self.world_size != 1:
            raise ValueError(
                f"{ROLLOUT_NAME} is a single-device server: set actor_rollout_ref.rollout."
                f"tensor_model_parallel_size=1; got a rollout world of {self.world_size}"
            )
        self.server_class = ray.remote(HFRolloutServer)

    async def launch_servers(self) -> None:
        node_id: str | None = None
        card: str | None = None
        if self.workers:
            node_id, card = await self.workers[0].__ray_call__.remote(_node_and_card)
        in_trainer = bool(self.workers) and weights_mode(self.config) == WEIGHTS_TRAINER
        platform = get_platform()
        env = dict(platform.rollout_env_vars())
        if in_trainer:
            card = None  # no model here: the server's process never opens the device
            env[get_visible_devices_keyword()] = ""
        else:
            env.update({var: "1" for var in platform.ray_noset_envvars()})
        options: dict[str, Any] = {
            "name": server_actor_name(self.replica_rank),
            "runtime_env": {"env_vars": env},
            "max_concurrency": self.max_concurrency,
            # Host memory and a thread, not a Ray CPU: the colocated trainer holds those.
            "num_cpus": 0,
        }
        if node_id is not None:
            options["scheduling_strategy"] = (
                ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False
                )
            )
        server = self.server_class.options(**options).remote(
            config=self.config,
            model_config=self.model_config,
            rollout_mode=self.rollout_mode or RolloutMode.HYBRID,
            replica_rank=self.replica_rank,
            node_rank=0,
            visible_devices=card,
            trainer=self.workers[0] if self.workers else None,
        )
        self.servers = [server]
        await asyncio.gather(*[s.launch_server.remote() for s in self.servers])
        self._server_handle = server
        self._server_address = await server.get_server_address.remote()
