"""The ``BaseRollout`` verl builds in the trainer's workers for ``rollout.name=oldgpu-hf``.

verl 0.9.0 builds it by name (``get_rollout_class``) in each trainer worker of a
colocated job (``engine_workers.py``) and in each ``CheckpointEngineWorker`` of the
colocated/standalone modes, as ``cls(config=, model_config=, device_mesh=,
[replica_rank=])``. Like vLLM's ``ServerAdapter`` it owns nothing but a handle on its
replica's server, found by the actor name the replica gave it, and it:

- ``resume(tags)``/``release()``: wakes or sleeps the server (only with
  ``free_cache_engine``, as vLLM's);
- ``update_weights(weights)``: with the engine setting ``weights: trainer`` (the
  default, ``colocated.py``) the server generates from this process's own policy, so
  nothing is copied: the step is stamped and the generator verl hands over is left
  unread (it is lazy: no tensor is gathered or merged). With ``weights: copy`` (the
  measured baseline) it takes the ``(HF name, tensor)`` generator the checkpoint engine
  hands it (``naive``: straight from the FSDP engine's ``get_per_tensor_param``),
  copies the tensors to host memory and sends them in buckets of
  ``checkpoint_engine.update_weights_bucket_megabytes`` to the server.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from oldgpu.rollout import ROLLOUT_NAME, colocated
from oldgpu.rollout.settings import WEIGHTS_TRAINER

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))


def server_actor_name(replica_rank: int, node_rank: int = 0) -> str:
    """The Ray name of a replica's server (the replica names it, the adapter finds it)."""
    return f"{ROLLOUT_NAME}_server_{replica_rank}_{node_rank}"


def buckets(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) pairs on the host, grouped into lists of about ``bucket_bytes``
    (a tensor larger than that goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        if hasattr(tensor, "full_tensor"):  # a DTensor the engine did not gather
            tensor = tensor.full_tensor()
        host = tensor.detach().to("cpu").contiguous()
        nbytes = host.numel() * host.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, host))
        size += nbytes
    if bucket:
        yield bucket


class HFServerAdapter(BaseRollout):
    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        if world != 1:
            raise ValueError(
                f"{ROLLOUT_NAME} is a single-device server: set actor_rollout_ref.rollout."
                "tensor_model_parallel_size=1 (and data/pipeline parallel 1); got a "
                f"rollout world of {world}"
            )
        rank = int(os.environ.get("RANK", "0"))
        # One server per trainer rank: replica r is rank r's (replica world size 1).
        self.replica_rank = rank if replica_rank == -1 else replica_rank
        self.is_leader_rank = True
        self.sleep_level = 2  # engine_workers sets 1 for LoRA adapters
        self.server_handle: ray.actor.ActorHandle | None = None
        from oldgpu.rollout.hf_engine import PROCESSED
        from oldgpu.rollout.server import eos_token_ids, pad_token_id, weights_mode

        self.weights_mode = weights_mode(self.config)
        # Read by the rollout patch set (verl_0_9_0/rollout.py): verl skips its weight
        # export (a state dict of every parameter, two cache flushes) for this rollout.
        self.shares_trainer_weights = self.weights_mode == WEIGHTS_TRAINER
        eos = eos_token_ids(self.model_config)
        self.policy = colocated.PolicyGenerator(
            pad_token_id=pad_token_id(self.model_config, eos),
            eos_token_ids=eos,
            logprobs_mode=self.config.logprobs_mode or PROCESSED,
        )
        colocated.register(self.replica_rank, self)

    def _server(self) -> ray.actor.ActorHandle:
        # Lazily: the trainer's workers are built before the replica starts its server.
        if self.server_handle is None:
            self.server_handle = ray.get_actor(server_actor_name(self.replica_rank))
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        if self.config.free_cache_engine:
            await self._server().wake_up.remote(tags=tags)

    async def release(self) -> None:
        if self.config.free_cache_engine:
            await self._server().sleep.remote()

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        global_steps: int | None = None,
        wire_format: str = "named_tensors",
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        if self.weights_mode == WEIGHTS_TRAINER:
            # The server generates from this process's parameters: nothing to copy. verl's
            # generator is lazy (an unread one gathers and merges nothing).
            await self._server().set_global_steps.remote(global_steps)
            return
        if wire_format != "named_tensors":
            raise ValueError(f"{ROLLOUT_NAME} takes full named tensors, not {wire_format!r}")
        if peft_config is not None:
            raise NotImplementedError(
                f"{ROLLOUT_NAME} with weights=copy loads full weights: with LoRA set "
                "actor_rollout_ref.model.lora.merge=True (or keep weights=trainer)"
            )
        start = time.time()
        server = self._server()
        bucket_bytes = self.config.checkpoint_engine.update_weights_bucket_megabytes << 20
        sent = 0
        # The weights may come as an async generator (non-naive checkpoint engines).
        if hasattr(weights, "__aiter__"):
            weights = [item async for item in weights]
        for bucket in buckets(weights, bucket_bytes):
            sent += await server.load_weights.remote(bucket)
        await server.end_weight_update.remote(global_steps)
        logger.info(
            "%s replica %d: %d tensors to the server in %.2fs",
            ROLLOUT_NAME,
            self.replica_rank,
            sent,
            time.time() - start,
        )

    def generate_sequences(self, prompts: Any) -> Any:
        raise NotImplementedError(
            f"{ROLLOUT_NAME} is a server rollout: verl's agent loop calls its server"
        )
