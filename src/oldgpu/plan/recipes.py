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

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from oldgpu.output import EngineError
from oldgpu.plan.model import ModelShape
from oldgpu.plan.spelling import name as spell

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
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
LM_HEAD = "lm_head"
# How a LoRA actor stores its frozen base (it computes in fp32 on a P40 either way; the
# adapters, their gradients and Adam stay fp32). auto: fp32 when that fits, else bf16
# (plan/search.py). bf16, not fp16, at 16 bits: Qwen's and Llama's checkpoints are bf16,
# which bf16 stores bit for bit, while fp16 changes every weight below 2**-14 in
# magnitude (its subnormals keep fewer bits) and cannot hold one above 65504
# (`oldgpu base-dtype MODEL_DIR` counts both for a checkpoint). 16 bits need LoRA: full
# fine-tuning updates every weight, and an fp32 master copy is what its optimizer steps.
BASE_DTYPES = ("auto", "fp32", "bf16", "fp16")
DEFAULT_BASE_DTYPE = "auto"
SIXTEEN_BIT = ("bf16", "fp16")
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
    base_dtype: str = "fp32",
) -> None:
    """Named errors for recipe values the planner cannot plan."""
    problem = base_dtype_problem(base_dtype, lora_rank, "plan")
    if problem:
        raise EngineError("plan-bad-input", problem)
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
    base_dtype: str = DEFAULT_BASE_DTYPE,
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
    validate(algorithm, critic, rollout_n, lora_rank, lora_alpha, modules, base_dtype)
    return {
        "base_dtype": base_dtype,
        "algorithm": algorithm,
        "critic": critic,
        "ref": bool(ref),
        "rollout_n": rollout_n,
        "lora_rank": lora_rank,
        "lora_alpha": lora_alpha,
        "lora_target_modules": modules,
    }


# -- the settings a job and `oldgpu plan` share ------------------------------------------
# One table, so the planner and a job accept, default and refuse alike (each names the
# setting in its own terms: plan/spelling.py).


@dataclass(frozen=True)
class Algorithm:
    name: str
    min_rollout_n: int
    about: str

    @property
    def critic(self) -> bool:
        """Whether verl builds a critic (``ESTIMATORS``)."""
        return uses_critic(self.name)


# Offered: the estimators that work with verl's default policy loss and the HF rollout
# (oldgpu.recipe has the why). The group estimators compare a prompt's responses with each
# other: with one response verl falls back to a zero baseline, so a job refuses it.
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
# verl's estimators not offered (their own policy loss): reachable through a job's overrides.
BY_OVERRIDES = tuple(e for e in ESTIMATORS if e not in ALGORITHMS)
# Names people type for an algorithm verl calls otherwise.
ALIASES = {"ppo": "gae", "reinforce++": "reinforce_plus_plus"}
DEFAULT_ROLLOUT_N = 1  # verl's; the group estimators need more (ALGORITHMS' min_rollout_n)
# data.max_prompt_length. 512, verl's own default and its GSM8K examples' value: verl
# refuses a longer prompt mid-run (data.truncation=error), and GSM8K under a chat template
# comes close to 256; a longer limit only costs batch size, which the planner shrinks to fit.
DEFAULT_PROMPT_LENGTH = 512
DEFAULT_RESPONSE_LENGTH = 256


def algorithm_problem(algorithm: str, interface: str) -> str | None:
    """Why ``algorithm`` is refused (None: it is offered), with what to use instead."""
    if algorithm in ALGORITHMS:
        return None
    key = spell(interface, "algorithm")
    offered = ", ".join(ALGORITHMS)
    if algorithm in BY_OVERRIDES:
        how = (
            "a job's overrides: algorithm.adv_estimator=" + algorithm
            if interface == "job"
            else "a job's overrides; plan with --algorithm grpo (no critic, as it)"
        )
        return (
            f"{key}: {algorithm!r} is verl's but not offered ({offered}): the engine does not "
            f"set up what it needs beyond them; it stays reachable through {how}"
        )
    hint = ALIASES.get(algorithm.lower())
    if hint is None:
        close = difflib.get_close_matches(algorithm, [*ALGORITHMS, *ALIASES], n=1)
        hint = ALIASES.get(close[0], close[0]) if close else None
    more = f"; did you mean {hint}?" if hint else ""
    if algorithm.lower() == "ppo":
        more = "; PPO with a critic is gae (verl's algorithm.adv_estimator=gae)"
    return f"{key}: {algorithm!r} is not one of {offered}{more}"


def setting_problems(values: Mapping[str, Any], interface: str) -> list[str]:
    """What is wrong with a recipe's settings (already of the right types), named in
    ``interface``'s terms. ``values``: algorithm, rollout_n, lora_rank, lora_alpha,
    lora_target_modules, and a job's kl_loss_coef and critic_model_path when it has them."""
    out: list[str] = []
    algorithm = values["algorithm"]
    problem = algorithm_problem(algorithm, interface)
    if problem:
        return [problem]
    algo = ALGORITHMS[algorithm]
    n = values["rollout_n"]
    name = spell(interface, "rollout_n")
    if n < 1:
        out.append(f"{name}: {n} must be at least 1")
    elif n < algo.min_rollout_n:
        out.append(
            f"{name}: {n} is too few for algorithm {algorithm} ({algo.about}): "
            f"it needs at least {algo.min_rollout_n} responses per prompt"
        )
    if values.get("kl_loss_coef", 0) < 0:
        out.append(f"kl_loss_coef: {values['kl_loss_coef']} must be 0 (no KL loss) or more")
    if values.get("critic_model_path") and not algo.critic:
        out.append(f"critic_model_path: algorithm {algorithm} trains no critic")
    rank, alpha, modules = values["lora_rank"], values["lora_alpha"], values["lora_target_modules"]
    r_name, a_name = spell(interface, "lora_rank"), spell(interface, "lora_alpha")
    m_name = spell(interface, "lora_target_modules")
    if rank < 0:
        out.append(f"{r_name}: {rank} must be 0 (no LoRA) or more")
    if alpha < 0:
        out.append(f"{a_name}: {alpha} must be 0 (twice {r_name}) or more")
    if rank == 0:
        if alpha:
            out.append(f"{a_name}: set without {r_name} (LoRA is off while {r_name} is 0)")
        if modules:
            out.append(f"{m_name}: set without {r_name} (LoRA is off while {r_name} is 0)")
    for module in modules:
        if module != ALL_LINEAR and not MODULE_RE.match(module):
            out.append(f"{m_name}: {module!r} is not a module name (e.g. q_proj)")
    if ALL_LINEAR in modules and len(modules) > 1:
        out.append(f"{m_name}: {ALL_LINEAR} stands alone (it means every linear layer)")
    problem = base_dtype_problem(values.get("base_dtype", DEFAULT_BASE_DTYPE), rank, interface)
    if problem:
        out.append(problem)
    return out


def base_dtype_problem(base_dtype: Any, lora_rank: Any, interface: str) -> str | None:
    """Why ``base_dtype`` is refused (None: fine), in ``interface``'s terms."""
    key, r_name = spell(interface, "base_dtype"), spell(interface, "lora_rank")
    if base_dtype not in BASE_DTYPES:
        return f"{key}: {base_dtype!r} is not one of {', '.join(BASE_DTYPES)}"
    if base_dtype in SIXTEEN_BIT and not lora_rank:
        return (
            f"{key}: {base_dtype} stores a frozen base at 16 bits, which needs LoRA "
            f"({r_name}): full fine-tuning updates every weight"
        )
    return None
