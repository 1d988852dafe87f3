"""The planner's inputs as the interface the user typed them in names them.

The same planner answers ``oldgpu plan`` (flags) and a job (``oldgpu job command``, the
unit's start: job settings). An error says what to change in the user's own terms:
``--gpus 4`` to the first, ``gpus: 4`` to the second. ``Inputs.interface`` says which.
"""

from __future__ import annotations

from typing import Any

PLAN = "plan"
JOB = "job"
INTERFACES = (PLAN, JOB)

# An input -> (its ``oldgpu plan`` flag, its job setting; None: a job cannot set it).
NAMES: dict[str, tuple[str, str | None]] = {
    "gpus": ("--gpus", "gpus"),
    "prompt_length": ("--prompt-length", "prompt_length"),
    "response_length": ("--response-length", "response_length"),
    "target_train_batch": ("--target-train-batch", "train_batch_size"),
    "algorithm": ("--algorithm", "algorithm"),
    "rollout_n": ("--rollout-n", "rollout_n"),
    "lora_rank": ("--lora-rank", "lora_rank"),
    "lora_alpha": ("--lora-alpha", "lora_alpha"),
    "lora_target_modules": ("--lora-target-modules", "lora_target_modules"),
    "base_dtype": ("--base-dtype", "base_dtype"),
    "max_offload": ("--max-offload", None),
    "headroom_mib": ("--headroom-mib", None),
    "ppo_mini_batches": ("--ppo-mini-batches", None),
    "memory_mib": ("--gpu-mib", None),
}
# Turning a role off: the flag, and the job setting that does it.
NO_CRITIC = ("--no-critic", "algorithm: grpo (or another critic-free algorithm)")
NO_REF = ("--no-ref", "kl_loss_coef: 0")


def name(interface: str, key: str) -> str:
    """``key``'s name in ``interface`` (the job's falls back to the flag when a job has none)."""
    flag, field = NAMES.get(key, ("--" + key.replace("_", "-"), key))
    if interface == JOB and field is not None:
        return field
    return flag


def setting(interface: str, key: str, value: Any) -> str:
    """``--gpus 4`` (``oldgpu plan``) or ``gpus: 4`` (a job)."""
    flag, field = NAMES.get(key, ("--" + key.replace("_", "-"), key))
    if interface == JOB and field is not None:
        return f"{field}: {value}"
    return f"{flag} {value}"


def switch(interface: str, pair: tuple[str, str]) -> str:
    """A role switched off: ``--no-critic`` or the job setting that does it."""
    return pair[1] if interface == JOB else pair[0]
