"""What the planner is asked (``Inputs``) and what it chooses (``Choice``, ``Offload``)."""

from __future__ import annotations

from dataclasses import dataclass

from oldgpu.plan import recipes
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
    # The recipe (plan/recipes.py): verl's adv_estimator when given (None: `critic`
    # decides, as before), LoRA on the actor when lora_rank > 0.
    algorithm: str | None = None
    lora_rank: int = 0
    lora_alpha: int = 0  # 0: twice the rank
    lora_target_modules: tuple[str, ...] = ()  # empty: all-linear
    # How the LoRA actor stores its frozen base: fp32, bf16 or fp16 (computed in the
    # compute dtype either way); auto: the search picks fp32 if it fits, else bf16.
    base_dtype: str = "fp32"
    base_auto: bool = False  # the search chose base_dtype (it was auto)
    # The verl release (oldgpu.verl_release.plan_fields): its tree has the logits patch
    # set (response-logits, entropy-by-rows: the patcher's registry says; 0.5.0's and
    # 0.9.0's), and it generates through a rollout server in the trainer's process
    # (0.9.0's oldgpu-hf: counted as the HF rollout, no second weight copy or context; the
    # plan sets the server's batch and token budget).
    logits_patch: bool = True
    rollout_server: bool = False
    # Who asks (plan/spelling.py): ``plan`` (oldgpu plan's flags) or ``job`` (a job's
    # settings); a refusal names what to change in the asker's own terms.
    interface: str = "plan"

    @property
    def seq(self) -> int:
        return self.prompt_length + self.response_length

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def adapter_params(self) -> int:
        return recipes.adapter_params(self.shape, self.lora_rank, self.lora_target_modules)

    @property
    def actor_params(self) -> int:
        """The actor's weights: the model's, plus LoRA's adapters."""
        return self.shape.params() + self.adapter_params

    @property
    def trained_params(self) -> int:
        """What gets gradients and Adam state: the adapters only with LoRA."""
        return self.adapter_params if self.lora else self.shape.params()

    @property
    def base16(self) -> bool:
        """The frozen base is stored at 16 bits (LoRA only: recipes.validate)."""
        return self.lora and self.base_dtype in ("bf16", "fp16")

    @property
    def lora_alpha_value(self) -> int:
        return self.lora_alpha or 2 * self.lora_rank

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
