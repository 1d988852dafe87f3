"""A job's training recipe: the advantage estimator, samples per prompt, KL loss, LoRA.

What these job settings are allowed to be, and the verl 0.5.0 keys they make.
``oldgpu.jobs`` holds the fields themselves (its ``FIELDS``) and calls in here.

Why each decision (verl 0.5.0):

- ``algorithm`` is ``algorithm.adv_estimator``. verl decides from it alone whether a
  critic is built (ray_trainer.py: only ``gae`` has one). The critic-free estimators
  compare responses to the same prompt, so most need ``rollout.n >= 2``; they take
  their KL to the reference as a loss (``actor.use_kl_loss``), as verl's own GRPO
  examples do. Offered: the ones that work with verl's default policy loss and
  the HF rollout; ``opo``, ``grpo_passk`` and ``gpg`` (its own policy loss) stay
  reachable through ``overrides``. The table (``ALGORITHMS``), the shared defaults and
  the checks live in ``oldgpu.plan.recipes``, so ``oldgpu plan`` refuses what a job
  refuses; this module re-exports them.
- ``gae`` keeps verl's PPO default, no KL loss; an override
  ``actor_rollout_ref.actor.use_kl_loss=True`` turns it on with ``kl_loss_coef``.
- LoRA (``lora_rank > 0``): verl wraps the actor with peft and uses the actor
  without its adapters as the reference (no ref copy). Under the HF rollout it needs
  the engine's ``hf-rollout-lora-wrap`` patch (FSDP units that keep frozen and
  trainable parameters apart); with vLLM, verl's LoRA docs require
  ``rollout.load_format=safetensors`` and recommend ``layered_summon``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# The algorithms a job (and the planner) accepts, and their rules: plan/recipes.py owns
# them, so `oldgpu plan` and a job refuse the same settings.
from oldgpu.plan.recipes import ALGORITHMS as ALGORITHMS
from oldgpu.plan.recipes import BASE_DTYPES as BASE_DTYPES
from oldgpu.plan.recipes import DEFAULT_ALGORITHM as DEFAULT_ALGORITHM
from oldgpu.plan.recipes import DEFAULT_BASE_DTYPE as DEFAULT_BASE_DTYPE
from oldgpu.plan.recipes import DEFAULT_PROMPT_LENGTH as DEFAULT_PROMPT_LENGTH
from oldgpu.plan.recipes import DEFAULT_RESPONSE_LENGTH as DEFAULT_RESPONSE_LENGTH
from oldgpu.plan.recipes import DEFAULT_ROLLOUT_N as DEFAULT_ROLLOUT_N
from oldgpu.plan.recipes import Algorithm as Algorithm
from oldgpu.plan.recipes import setting_problems
from oldgpu.plan.recipes import uses_critic as estimator_uses_critic
from oldgpu.plan.spelling import JOB

ALL_LINEAR = "all-linear"  # peft: every linear layer but the output head
FLOAT_DIGITS = 6  # an env file holds floats as %g (what Nix's JSON writes, too)


def format_float(value: float) -> str:
    return format(value, "g")


def parse_float(name: str, value: Any) -> tuple[float | None, str | None]:
    """(value, None) or (None, problem): a finite number with at most 6 significant digits."""
    if isinstance(value, bool):
        return None, f"{name}: {value!r} is not a number"
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None, f"{name}: {value!r} is not a number"
    if not math.isfinite(number):
        return None, f"{name}: {value!r} is not a finite number"
    if float(format_float(number)) != number:
        return None, f"{name}: {value!r} has more than {FLOAT_DIGITS} significant digits"
    return number, None


def uses_critic(algorithm: str) -> bool:
    return estimator_uses_critic(algorithm)


def problems(values: Mapping[str, Any]) -> list[str]:
    """What is wrong with a job's recipe settings (already of the right types); the
    planner's ``oldgpu plan`` asks the same function, in its flags' names."""
    return setting_problems(values, JOB)


def target_modules(modules: tuple[str, ...]) -> str:
    """peft's target_modules as a Hydra value: the string all-linear, or a list of names."""
    if not modules or modules == (ALL_LINEAR,):
        return ALL_LINEAR
    return "[" + ",".join(modules) + "]"


def overrides(job: Any, prof: Mapping[str, Any]) -> list[str]:
    """verl 0.5.0 keys for the job's recipe (all present in ppo_trainer's config)."""
    algo = ALGORITHMS[job.algorithm]
    out = [
        f"algorithm.adv_estimator={job.algorithm}",
        f"actor_rollout_ref.rollout.n={job.rollout_n}",
        f"actor_rollout_ref.actor.kl_loss_coef={format_float(job.kl_loss_coef)}",
    ]
    if not algo.critic:
        # The KL to the reference as a loss; 0 drops it and the reference log-probs.
        out += [
            f"actor_rollout_ref.actor.use_kl_loss={job.kl_loss_coef > 0}",
            "algorithm.use_kl_in_reward=False",
        ]
    if job.lora_rank:
        out += [
            f"actor_rollout_ref.model.lora_rank={job.lora_rank}",
            f"actor_rollout_ref.model.lora_alpha={job.lora_alpha or 2 * job.lora_rank}",
            f"actor_rollout_ref.model.target_modules={target_modules(job.lora_target_modules)}",
        ]
        if prof["rollout"] == "vllm":
            out += [
                "actor_rollout_ref.rollout.load_format=safetensors",
                "actor_rollout_ref.rollout.layered_summon=True",
            ]
    return out


def needs_ref(job: Any) -> bool:
    """Whether verl computes reference log-probs (as the planner counts them today)."""
    return uses_critic(job.algorithm) or job.kl_loss_coef > 0
