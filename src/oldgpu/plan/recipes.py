"""What the planner knows about a training recipe: the advantage estimator, responses per
prompt and LoRA, the facts of verl 0.5.0 that change memory, and the call the jobs code makes.

Why each fact (verl 0.5.0):

* ``ESTIMATORS``: ray_trainer.py sets ``use_critic`` from ``algorithm.adv_estimator``
  alone: ``gae`` builds a critic, the others (the ``AdvantageEstimator`` enum) do not,
  so no critic weights, gradients, Adam state, value forward or critic update.
* ``rollout_n``: the trainer repeats each prompt n times before generating, so
  ``train_batch_size x n`` sequences flow through generate, log-prob and update;
  fsdp_workers.py multiplies ``ppo_mini_batch_size`` (in prompts) by n before dividing
  it over the GPUs (``memory.per_gpu_batch``).
* LoRA (``lora_rank > 0``): peft adds ``r x (in + out)`` parameters to each targeted
  linear layer (``all-linear``: every linear of the decoder layers, not the lm_head);
  only they get gradients and Adam state. The frozen base weights stay, in the
  master dtype, and the base model's activations are still saved: gradients flow
  through the frozen layers to the adapters below. ray_trainer.py sets
  ``ref_in_actor = lora_rank > 0``: the ref log-prob is the actor's with
  ``disable_adapter()`` (and its entropy, the rollout's micro batch), so there is no
  ref copy. verl wraps each trainable LoRA leaf as an FSDP unit of its own, and the
  decoder layers as units (``get_fsdp_wrap_policy(is_lora=True)``; under the HF
  rollout this needs oldgpu patch's ``hf-rollout-lora-wrap``), so on several GPUs a
  unit at a time is gathered, not the whole model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from oldgpu.output import EngineError
from oldgpu.plan.model import ModelShape

# verl 0.5.0's estimators (core_algos.AdvantageEstimator) -> whether it builds a critic.
ESTIMATORS: dict[str, bool] = {
    "gae": True,
    "grpo": False,
    "grpo_passk": False,
    "reinforce_plus_plus": False,
    "reinforce_plus_plus_baseline": False,
    "remax": False,
    "rloo": False,
    "opo": False,
    "gpg": False,
}
# Estimators that compare a prompt's responses with each other; with one response per
# prompt verl falls back to a zero baseline (core_algos: ``len(id2score[idx]) == 1``).
GROUP_ESTIMATORS = frozenset(
    {"grpo", "grpo_passk", "rloo", "opo", "reinforce_plus_plus_baseline", "gpg"}
)
ALL_LINEAR = "all-linear"  # peft: every linear layer but the output head
LM_HEAD = "lm_head"
# A decoder layer's linears (Qwen2 and Llama name them alike).
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def uses_critic(algorithm: str) -> bool:
    """Whether verl 0.5.0 builds a critic for this ``algorithm.adv_estimator``."""
    if algorithm not in ESTIMATORS:
        raise EngineError(
            "plan-algorithm-unknown",
            f"{algorithm!r} is not one of verl 0.5.0's estimators: {', '.join(ESTIMATORS)}",
        )
    return ESTIMATORS[algorithm]


def layer_linears(s: ModelShape) -> dict[str, tuple[int, int]]:
    """The linear layers of one decoder layer: name -> (in, out) features."""
    h, d, i = s.hidden_size, s.dim, s.intermediate_size
    q, kv = s.num_attention_heads * d, s.num_key_value_heads * d
    shapes = ((h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h))
    return dict(zip(LINEAR_NAMES, shapes, strict=True))


def target_names(modules: Sequence[str]) -> tuple[str, ...]:
    """The targeted linears' names; peft matches a dotted name by its last part."""
    if not modules or tuple(modules) == (ALL_LINEAR,):
        return ()  # all-linear
    return tuple(dict.fromkeys(m.rsplit(".", 1)[-1] for m in modules))


def _targets(s: ModelShape, modules: Sequence[str]) -> tuple[list[tuple[int, int]], bool]:
    """(in, out) of each targeted linear of ONE decoder layer, and whether the lm_head is."""
    linears = layer_linears(s)
    names = target_names(modules)
    if not names:
        return list(linears.values()), False
    return [linears[n] for n in names if n in linears], LM_HEAD in names


def adapter_layer_params(s: ModelShape, rank: int, modules: Sequence[str]) -> int:
    """LoRA parameters of one decoder layer: r x (in + out) per targeted linear."""
    per_layer, _ = _targets(s, modules)
    return sum(rank * (i + o) for i, o in per_layer)


def adapter_params(s: ModelShape, rank: int, modules: Sequence[str]) -> int:
    """All LoRA parameters: each decoder layer's, plus the lm_head's when targeted."""
    if rank <= 0:
        return 0
    _, head = _targets(s, modules)
    lm_head = rank * (s.hidden_size + s.vocab_size) if head else 0
    return s.num_hidden_layers * adapter_layer_params(s, rank, modules) + lm_head


def adapter_act_elems(s: ModelShape, rank: int, modules: Sequence[str]) -> int:
    """Per token and layer, what the adapters add to the saved activations: each
    targeted linear's r-sized ``lora_A`` output (its input is the base layer's, shared:
    verl sets no LoRA dropout)."""
    per_layer, _ = _targets(s, modules)
    return rank * len(per_layer) if rank > 0 else 0


def validate(
    algorithm: str | None,
    critic: bool,
    rollout_n: Any,
    lora_rank: Any,
    lora_alpha: Any,
    lora_target_modules: Iterable[str],
) -> None:
    """Named errors for recipe values the planner cannot plan."""
    if algorithm is not None and uses_critic(algorithm) != critic:
        has = "builds" if uses_critic(algorithm) else "builds no"
        raise EngineError(
            "plan-bad-input",
            f"algorithm {algorithm}: verl {has} critic; drop --critic/--no-critic (the "
            "algorithm decides)",
        )
    for name, value, low in (
        ("rollout_n", rollout_n, 1),
        ("lora_rank", lora_rank, 0),
        ("lora_alpha", lora_alpha, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            what = "a positive integer" if low else "0 or a positive integer"
            raise EngineError("plan-bad-input", f"{name} must be {what}, not {value!r}")
    modules = tuple(lora_target_modules)
    if not lora_rank and (lora_alpha or modules):
        raise EngineError(
            "plan-bad-input", "lora_alpha / lora_target_modules set without lora_rank (LoRA off)"
        )
    if ALL_LINEAR in modules and len(modules) > 1:
        raise EngineError("plan-bad-input", f"{ALL_LINEAR} stands alone in lora_target_modules")
    known = (*LINEAR_NAMES, LM_HEAD)
    for module in modules:
        if module == ALL_LINEAR:
            continue
        if not isinstance(module, str) or module.rsplit(".", 1)[-1] not in known:
            raise EngineError(
                "plan-lora-target-unknown",
                f"LoRA target {module!r} is not a linear layer the planner knows "
                f"({', '.join(known)}, or {ALL_LINEAR})",
            )


def target_modules_value(modules: Sequence[str]) -> str:
    """verl's ``target_modules`` as a Hydra value: all-linear, or a list of names."""
    names = tuple(modules)
    if not names or names == (ALL_LINEAR,):
        return ALL_LINEAR
    return "[" + ",".join(names) + "]"


def recipe_fields(
    algorithm: str = "gae",
    rollout_n: int = 1,
    lora_rank: int = 0,
    lora_alpha: int = 0,
    lora_target_modules: Iterable[str] = (),
    kl_loss_coef: float | None = None,
    ref: bool | None = None,
) -> dict[str, Any]:
    """``Inputs`` keyword arguments for a job's recipe, validated (named errors).

    The jobs code calls ``Inputs(..., **recipe_fields(algorithm=job.algorithm,
    rollout_n=job.rollout_n, lora_rank=job.lora_rank, lora_alpha=job.lora_alpha,
    lora_target_modules=job.lora_target_modules, kl_loss_coef=job.kl_loss_coef))``.
    The ref is counted for ``gae`` (an override may turn its KL on) and, without a
    critic, when the KL loss is on (``kl_loss_coef > 0``; None: on). ``ref`` overrides it.
    """
    critic = uses_critic(algorithm)
    if ref is None:
        ref = critic or kl_loss_coef is None or kl_loss_coef > 0
    modules = tuple(lora_target_modules)
    validate(algorithm, critic, rollout_n, lora_rank, lora_alpha, modules)
    return {
        "algorithm": algorithm,
        "critic": critic,
        "ref": bool(ref),
        "rollout_n": rollout_n,
        "lora_rank": lora_rank,
        "lora_alpha": lora_alpha,
        "lora_target_modules": modules,
    }
