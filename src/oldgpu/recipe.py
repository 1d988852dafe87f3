"""A job's training recipe: the advantage estimator, samples per prompt, KL loss, LoRA.

What these job settings are allowed to be, and the verl 0.5.0 keys they make.
``oldgpu.jobs`` holds the fields themselves (its ``FIELDS``) and calls in here.

Why each decision (verl 0.5.0):

- ``algorithm`` is ``algorithm.adv_estimator``. verl decides from it alone whether a
  critic is built (ray_trainer.py: only ``gae`` has one). The critic-free estimators
  compare responses to the same prompt, so most need ``rollout.n >= 2``; they take
  their KL to the reference as a loss (``actor.use_kl_loss``), as verl's own GRPO
  examples do. Offered here: the ones that work with verl's default policy loss and
  the HF rollout; ``opo``, ``grpo_passk`` and ``gpg`` (its own policy loss) stay
  reachable through ``overrides``.
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
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from oldgpu.plan.recipes import uses_critic as estimator_uses_critic


@dataclass(frozen=True)
class Algorithm:
    name: str
    min_rollout_n: int
    about: str

    @property
    def critic(self) -> bool:
        """Whether verl builds a critic: the planner's table owns that fact."""
        return estimator_uses_critic(self.name)


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("gae", 1, "PPO with a critic (GAE advantages)"),
        Algorithm("grpo", 2, "group-relative: each response against its prompt's group"),
        Algorithm("rloo", 2, "REINFORCE, leave-one-out baseline of the prompt's group"),
        Algorithm("reinforce_plus_plus_baseline", 2, "REINFORCE++, group-mean baseline"),
        Algorithm("reinforce_plus_plus", 1, "REINFORCE++, batch-whitened returns"),
        Algorithm("remax", 1, "ReMax: a greedy response per prompt as the baseline"),
    )
}
DEFAULT_ALGORITHM = "gae"
ALL_LINEAR = "all-linear"  # peft: every linear layer but the output head
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
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
    """What is wrong with a job's recipe settings (already of the right types)."""
    out: list[str] = []
    algorithm = values["algorithm"]
    if algorithm not in ALGORITHMS:
        return [f"algorithm: {algorithm!r} is not one of {', '.join(ALGORITHMS)}"]
    algo = ALGORITHMS[algorithm]
    n = values["rollout_n"]
    if n < 1:
        out.append(f"rollout_n: {n} must be at least 1")
    elif n < algo.min_rollout_n:
        out.append(
            f"rollout_n: {n} is too few for algorithm {algorithm} ({algo.about}): "
            f"it needs at least {algo.min_rollout_n} responses per prompt"
        )
    if values["kl_loss_coef"] < 0:
        out.append(f"kl_loss_coef: {values['kl_loss_coef']} must be 0 (no KL loss) or more")
    if values.get("critic_model_path") and not algo.critic:
        out.append(f"critic_model_path: algorithm {algorithm} trains no critic")
    rank, alpha, modules = values["lora_rank"], values["lora_alpha"], values["lora_target_modules"]
    if rank < 0:
        out.append(f"lora_rank: {rank} must be 0 (no LoRA) or more")
    if alpha < 0:
        out.append(f"lora_alpha: {alpha} must be 0 (twice lora_rank) or more")
    if rank == 0:
        if alpha:
            out.append("lora_alpha: set without lora_rank (LoRA is off while lora_rank is 0)")
        if modules:
            out.append(
                "lora_target_modules: set without lora_rank (LoRA is off while lora_rank is 0)"
            )
    for module in modules:
        if module != ALL_LINEAR and not MODULE_RE.match(module):
            out.append(f"lora_target_modules: {module!r} is not a module name (e.g. q_proj)")
    if ALL_LINEAR in modules and len(modules) > 1:
        out.append(f"lora_target_modules: {ALL_LINEAR} stands alone (it means every linear layer)")
    return out


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
