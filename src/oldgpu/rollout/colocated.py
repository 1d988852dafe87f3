"""Generation in the trainer's process, from the parameters the trainer trains.

In verl's hybrid mode the trainer worker and the rollout share one card. A server
process of its own holds a second CUDA context and a second copy of the weights, and
every step copies the weights into it: measured on the lent H100 for the 0.5B shape
(docs/newer-verl.md), 8.8 s of weight sync a step and 967 MiB more on the card than
verl 0.5.0, whose HF rollout generates in the trainer's process. So here the server
forwards each batch to its replica's trainer worker (Ray's ``__ray_call__``, as verl's
vLLM server reaches its workers) and the worker generates from the policy module it
trains, as verl 0.5.0's HF rollout does: the root FSDP unit's parameters summoned,
every wrapped layer unsharding itself in its own forward. Then

- the weights exist once; the "sync" is the step's stamp (nothing is copied);
- LoRA needs no merge: peft applies the adapters in the forward;
- the card holds one process, the trainer's; the server holds no model and no context.

The adapter (built by verl in each trainer worker) registers itself here by replica
rank; the functions below run in that worker when the server calls them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from oldgpu.rollout.sampling import Generated, Request

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

# Adapters built in this process (a trainer worker), by replica rank.
_ADAPTERS: dict[int, Any] = {}


class PolicyNotFound(RuntimeError):
    """The trainer worker holds no policy the rollout can generate from."""


def register(replica_rank: int, adapter: Any) -> None:
    _ADAPTERS[replica_rank] = adapter


def _adapter(replica_rank: int) -> Any:
    try:
        return _ADAPTERS[replica_rank]
    except KeyError:
        raise PolicyNotFound(
            f"no oldgpu-hf adapter for replica {replica_rank} in trainer process {os.getpid()} "
            f"(have {sorted(_ADAPTERS)})"
        ) from None


def _role_worker(worker_self: Any, adapter: Any) -> Any:
    """The role worker (ActorRolloutRefWorker) whose rollout is ``adapter``: the worker
    itself, or one of a fused worker's ``worker_dict``."""
    found = [worker_self, *getattr(worker_self, "worker_dict", {}).values()]
    for w in found:
        if getattr(w, "rollout", None) is adapter:
            return w
    raise PolicyNotFound(
        f"none of {[type(w).__name__ for w in found]} holds the oldgpu-hf adapter as its rollout"
    )


def _engine(worker_self: Any, adapter: Any) -> Any:
    actor = getattr(_role_worker(worker_self, adapter), "actor", None)
    engine = getattr(actor, "engine", None)
    if engine is None or getattr(engine, "module", None) is None:
        raise PolicyNotFound(
            "the trainer worker has no actor engine with a module: the in-process rollout "
            "needs the hybrid actor_rollout(_ref) worker"
        )
    return engine


def _root_params(module: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
    """The root FSDP1 unit's own parameters (embeddings, final norm, lm_head) for a call
    that bypasses its forward, as HF ``generate`` on the wrapped model does; FSDP2 and a
    plain module need nothing (their hooks sit on the modules' forwards)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(module, FSDP):
        return FSDP.summon_full_params(module, writeback=False, recurse=False)
    return contextlib.nullcontext()


def _autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    # The profile's compute dtype, as the engine's own forward uses it (none for fp32).
    try:
        from verl.utils import oldgpu_compat  # type: ignore[attr-defined]

        dtype = oldgpu_compat.compute_dtype()
    except ImportError:
        dtype = torch.float32
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class PolicyGenerator:
    """Held by the adapter in the trainer's process: generates from the actor engine's
    module, loading it onto the card for the rollout when the engine offloads it."""

    def __init__(self, *, pad_token_id: int, eos_token_ids: Sequence[int], logprobs_mode: str):
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.logprobs_mode = logprobs_mode
        self.generator: Any = None
        self.engine: Any = None
        self.loaded = False  # the engine's module brought to the card by us

    def _device(self) -> torch.device:
        from verl.utils.device import get_device_id, get_device_name

        name = get_device_name()
        return torch.device(name if name == "cpu" else f"{name}:{get_device_id()}")

    def _bind(self, worker_self: Any, adapter: Any) -> None:
        from oldgpu.rollout.hf_engine import HFGenerator

        engine = _engine(worker_self, adapter)
        if self.generator is None or engine is not self.engine:
            self.engine = engine
            self.generator = HFGenerator(
                engine.module,
                pad_token_id=self.pad_token_id,
                eos_token_ids=self.eos_token_ids,
                device=self._device(),
                logprobs_mode=self.logprobs_mode,
            )

    def generate(self, worker_self: Any, adapter: Any, requests: Sequence[Request]) -> list[Any]:
        self._bind(worker_self, adapter)
        engine, gen = self.engine, self.generator
        if getattr(engine, "is_param_offload_enabled", False) and not self.loaded:
            # verl offloads the actor after its weight sync; the rollout needs it here.
            engine.to(gen.device.type, model=True, optimizer=False, grad=False)
            self.loaded = True
        module = engine.module
        training = module.training
        module.eval()  # HF turns the KV cache off under gradient checkpointing in training
        try:
            with _root_params(module), _autocast(gen.device):
                return gen.generate(requests)
        finally:
            module.train(training)

    def release(self) -> None:
        """The rollout is over: give the card back as the engine had it."""
        if self.loaded and self.engine is not None:
            self.engine.to("cpu", model=True, optimizer=False, grad=False)
            self.loaded = False
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


# -- what the server calls in the trainer worker (``worker.__ray_call__.remote(fn, ...)``) --


def run_batch(worker_self: Any, replica_rank: int, requests: list[Request]) -> list[Generated]:
    adapter = _adapter(replica_rank)
    return adapter.policy.generate(worker_self, adapter, requests)


def release(worker_self: Any, replica_rank: int) -> int:
    """After the rollout; returns the trainer's pid (the server logs whom it released)."""
    _adapter(replica_rank).policy.release()
    return os.getpid()
