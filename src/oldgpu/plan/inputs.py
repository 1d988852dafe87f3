"""What the planner is asked (``Inputs``) and what it chooses (``Choice``, ``Offload``)."""

from __future__ import annotations

from dataclasses import dataclass

from oldgpu.plan.model import PRECISIONS, ModelShape, Precision

PPO_MINI_BATCHES = 4  # optimizer steps per PPO step, as verl's defaults (1024/256, 256/64)


@dataclass(frozen=True)
class Inputs:
    memory_mib: int  # one GPU's memory (cpu device: the host budget)
    gpus: int
    shape: ModelShape
    prompt_length: int
    response_length: int
    compute_dtype: str = "fp32"
    rollout: str = "hf"
    device: str = "cuda"
    critic: bool = True
    ref: bool = True
    rollout_n: int = 1
    headroom_mib: int | None = None  # None: the default cap rule
    target_train_batch: int | None = None
    max_offload: str = "all"  # none | optimizer | all
    ppo_mini_batches: int = PPO_MINI_BATCHES
    model_name: str = ""
    profile_name: str = ""

    @property
    def seq(self) -> int:
        return self.prompt_length + self.response_length

    @property
    def precision(self) -> Precision:
        return PRECISIONS[self.compute_dtype]


@dataclass(frozen=True)
class Offload:
    actor_param: bool = False
    actor_optimizer: bool = False
    critic_param: bool = False
    critic_optimizer: bool = False

    @property
    def ref_param(self) -> bool:
        # The colocated worker reads the actor's flags; the ref key follows the actor's.
        return self.actor_param


@dataclass(frozen=True)
class Choice:
    train_batch_size: int
    ppo_mini_batch_size: int
    actor_micro: int
    critic_micro: int
    log_prob_micro: int
    gradient_checkpointing: bool
    offload: Offload
    offload_level: str = "none"
