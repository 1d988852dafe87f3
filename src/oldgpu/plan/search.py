"""The search: the train batch, offload level, checkpointing and micro batches that fit.

The largest ``train_batch_size`` (throughput grows about linearly
with the rollout batch while generation dominates the step) whose every phase
stays at or under the cap; at that batch the least offload (none, critic
optimizer, both optimizers, critic params, actor params), the largest micro batches
with gradient checkpointing, and then (LoRA) checkpointing off where a micro batch at
least half as large fits without it (its recompute is about a sixth of an update's
math, which a P40's fp32 rate makes the step's largest part). A LoRA job's
``base_dtype`` auto is fp32 when that plan fits and bf16 (the frozen base at 16 bits)
when only that one does.
Batch sizes divide as verl asserts: ``train_batch_size`` is a multiple of
``ppo_mini_batch_size``, itself a multiple of micro batch x GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from oldgpu.output import EngineError
from oldgpu.plan import recipes
from oldgpu.plan.inputs import Choice, Inputs, Offload
from oldgpu.plan.memory import (
    PhaseEstimate,
    card_processes,
    card_usable_mib,
    estimate,
    estimate_phase,
    per_gpu_batch,
)
from oldgpu.plan.model import FAMILIES, PRECISIONS, SHAPES
from oldgpu.plan.spelling import NO_CRITIC, NO_REF, setting, switch
from oldgpu.plan.spelling import name as spell

# The cap the peak must stay at or under: min(memory - CAP_MARGIN_MIB, CAP_FRACTION *
# memory), i.e. 22 GiB on a 24 GiB card. --headroom-mib N makes it memory - N.
CAP_MARGIN_MIB = 2048
CAP_FRACTION = 0.92

# The search space. Micro batches are powers of two up to BATCH_STEP (16 sequences of a
# few hundred tokens already fill a GPU's matrix units); train_batch_size is 1, 2, 4, 8
# x gpus, then a multiple of BATCH_STEP x gpus, so every micro batch divides it; its
# ceiling is verl's GSM8K quick start's 256 (fp32 training on a Pascal card grows
# linearly with the batch; --target-train-batch goes past it).
BATCH_STEP = 16
MICRO_BATCHES = (16, 8, 4, 2, 1)
LOG_PROB_MICRO_BATCHES = (64, 32, 16, 8, 4, 2, 1)
MAX_TRAIN_BATCH = 256

# Offload levels in the order they are tried: each frees more and costs more transfers.
OFFLOAD_LEVELS: tuple[Offload, ...] = (
    Offload(),
    Offload(critic_optimizer=True),
    Offload(actor_optimizer=True, critic_optimizer=True),
    Offload(actor_optimizer=True, critic_optimizer=True, critic_param=True),
    Offload(True, True, True, True),
)
MAX_OFFLOAD = {"none": 0, "optimizer": 2, "all": 4}
# The LoRA rank a refusal tries (verl's own GRPO LoRA examples use 64; the adapters'
# size hardly matters next to the frozen base weights).
SUGGESTED_LORA_RANK = 64


def cap_mib(inp: Inputs) -> int:
    """The most the peak may reach: min(memory - margin, CAP_FRACTION * memory)."""
    margin = CAP_MARGIN_MIB if inp.headroom_mib is None else inp.headroom_mib
    if inp.headroom_mib is None:
        return int(min(inp.memory_mib - margin, CAP_FRACTION * inp.memory_mib))
    return int(inp.memory_mib - margin)


def level_name(off: Offload) -> str:
    parts = [
        name
        for name, on in (
            ("critic optimizer", off.critic_optimizer),
            ("actor optimizer", off.actor_optimizer),
            ("critic params", off.critic_param),
            ("actor params", off.actor_param),
        )
        if on
    ]
    return " + ".join(parts) or "none"


def offload_levels(inp: Inputs) -> list[tuple[str, Offload]]:
    """The levels this input may use (no critic: its flags drop out; cpu: none)."""
    top = 0 if inp.device == "cpu" else MAX_OFFLOAD[inp.max_offload]
    out: list[tuple[str, Offload]] = []
    for off in OFFLOAD_LEVELS[: top + 1]:
        if not inp.critic:
            off = replace(off, critic_param=False, critic_optimizer=False)
        if all(off != seen for _, seen in out):
            out.append((level_name(off), off))
    return out


def _fits(inp: Inputs, choice: Choice, phases: Sequence[str]) -> bool:
    cap = cap_mib(inp)
    for phase in phases:
        if phase.startswith("critic") and not inp.critic:
            continue
        if phase == "ref_log_prob" and not inp.ref:
            continue
        if estimate_phase(inp, choice, phase).peak > cap:
            return False
    return True


def _mini_batch(train_batch: int, unit: int, mini_batches: int) -> int:
    """The largest multiple of unit that divides train_batch into at least mini_batches
    parts; the smallest such multiple (most optimizer steps) when none does."""
    fits = [
        d
        for d in range(unit, train_batch + 1, unit)
        if train_batch % d == 0 and d * mini_batches <= train_batch
    ]
    return max(fits) if fits else unit


def batch_candidates(inp: Inputs) -> list[int]:
    """train_batch_size values tried, ascending: 1, 2, 4, 8 x gpus, then multiples of
    BATCH_STEP x gpus, so every micro batch up to BATCH_STEP divides the per-GPU share."""
    n = inp.gpus
    if inp.target_train_batch is not None:
        return [inp.target_train_batch] if inp.target_train_batch % n == 0 else []
    small = [k * n for k in (1, 2, 4, 8) if k < BATCH_STEP]
    top = max(MAX_TRAIN_BATCH, BATCH_STEP * n)
    return small + list(range(BATCH_STEP * n, top + 1, BATCH_STEP * n))


def _pow2_micro(limit: int, candidates: Sequence[int], ok: Any) -> int | None:
    """The largest candidate <= limit for which ok(m) holds."""
    return next((m for m in candidates if m <= limit and ok(m)), None)


@dataclass(frozen=True)
class Plan:
    inputs: Inputs
    choice: Choice
    phases: dict[str, PhaseEstimate]
    largest_batch: dict[str, int | None]  # per offload level: the largest batch that fits

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k].peak)

    @property
    def peak(self) -> float:
        return self.phases[self.peak_phase].peak


def _no_gc(actor: int, critic: int | None = None) -> dict[str, Any]:
    """A probe's change: checkpointing off at these micro batches."""
    return {
        "gradient_checkpointing": False,
        "actor_micro": actor,
        "critic_micro": actor if critic is None else critic,
    }


def _choose_at(inp: Inputs, batch: int, level: str, off: Offload) -> Choice | None:
    """The micro batches for one batch and offload level, or None when a phase cannot fit.

    Micro batches must divide the per-GPU share of the mini batch; the largest that
    fits wins (actor first, the critic at most the actor's so the sizes divide).
    """
    n = inp.gpus
    share = batch // n  # prompts per GPU: the mini batch is a multiple of micro x gpus
    rollout = per_gpu_batch(inp, batch)
    probe = Choice(batch, batch, 1, 1, 1, True, off, level)

    def fits(phase: str, **change: Any) -> bool:
        return _fits(inp, replace(probe, **change), (phase,))

    divides = [m for m in MICRO_BATCHES if share % m == 0]
    m_a = _pow2_micro(share, divides, lambda m: fits("actor_update", actor_micro=m))
    if m_a is None:
        return None
    m_c = m_a
    if inp.critic:
        m_c = _pow2_micro(m_a, divides, lambda m: fits("critic_update", critic_micro=m))
        if m_c is None or not fits("critic_values", critic_micro=m_c):
            return None
    m_lp = _pow2_micro(
        rollout,
        LOG_PROB_MICRO_BATCHES,
        lambda m: (
            fits("actor_log_prob", log_prob_micro=m) and fits("ref_log_prob", log_prob_micro=m)
        ),
    )
    if m_lp is None or not fits("generate"):
        return None
    unit = max(m_a, m_c) * n
    mini = _mini_batch(batch, unit, inp.ppo_mini_batches)
    chosen = replace(
        probe,
        ppo_mini_batch_size=mini,
        actor_micro=m_a,
        critic_micro=m_c,
        log_prob_micro=m_lp,
    )
    # Only the updates keep activations for a backward: checkpointing off where they fit
    # at a micro batch at least half the checkpointed one (a few hundred tokens a micro
    # batch already fill a P40; the recompute it saves is a sixth of an update's math).
    # LoRA only for now: its measured runs calibrate this; full fine-tuning's measured
    # plans (docs/benchmarks.md) keep checkpointing until a run without it is measured.
    if not inp.lora:
        return chosen
    off = replace(chosen, gradient_checkpointing=False)
    halves = [m for m in divides if m >= max(1, m_a // 2)]
    m_off = _pow2_micro(m_a, halves, lambda m: fits("actor_update", **_no_gc(m)))
    if m_off is None:
        return chosen
    m_c_off = m_off
    if inp.critic:
        m_c_off = _pow2_micro(m_off, halves, lambda m: fits("critic_update", **_no_gc(m_off, m)))
        if m_c_off is None:
            return chosen
    unit = max(m_off, m_c_off) * n
    return replace(
        off,
        ppo_mini_batch_size=_mini_batch(batch, unit, inp.ppo_mini_batches),
        actor_micro=m_off,
        critic_micro=m_c_off,
    )


def base_dtypes(inp: Inputs) -> tuple[str, ...]:
    """The base dtypes to try, in order: auto is fp32, then bf16 with LoRA."""
    if inp.base_dtype != "auto":
        return (inp.base_dtype,)
    return ("fp32", "bf16") if inp.lora else ("fp32",)


def search(inp: Inputs) -> Plan | None:
    """The largest batch that fits; at that batch the least offload, then the largest micros.

    Each offload level's feasible batches only grow with memory, so the batch chosen
    never shrinks when memory grows. ``base_dtype`` auto: the first of base_dtypes that
    fits (the plan's inputs then name it).
    """
    validate(inp)
    for base in base_dtypes(inp):
        found = _search(replace(inp, base_dtype=base, base_auto=inp.base_dtype == "auto"))
        if found is not None:
            return found
    return None


def _search(inp: Inputs) -> Plan | None:
    candidates = batch_candidates(inp)
    largest: dict[str, int | None] = {}
    best: tuple[int, int, Choice] | None = None  # (batch, -level, choice)
    for li, (level, off) in enumerate(offload_levels(inp)):
        # feasibility is monotone in the batch (only generate and the rollout tensors grow)
        lo, hi, found = 0, len(candidates) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            choice = _choose_at(inp, candidates[mid], level, off)
            if choice is None:
                hi = mid - 1
            else:
                found, lo = choice, mid + 1
        largest[level] = found.train_batch_size if found else None
        if found and (best is None or found.train_batch_size > best[0]):
            best = (found.train_batch_size, -li, found)
    if best is None:
        return None
    choice = best[2]
    return Plan(inp, choice, estimate(inp, choice), largest)


def validate(inp: Inputs) -> None:
    ui = inp.interface
    for name in ("memory_mib", "gpus", "prompt_length", "response_length", "rollout_n"):
        value = getattr(inp, name)
        if not isinstance(value, int) or value < 1:
            raise EngineError(
                "plan-bad-input", f"{spell(ui, name)} must be a positive integer, not {value}"
            )
    if inp.target_train_batch is not None and inp.target_train_batch < 1:
        raise EngineError(
            "plan-bad-input", f"{spell(ui, 'target_train_batch')} must be a positive integer"
        )
    if inp.headroom_mib is not None and inp.headroom_mib < 0:
        # A negative margin plans a peak above the card's memory.
        raise EngineError(
            "plan-bad-input", f"--headroom-mib must be 0 or more, not {inp.headroom_mib}"
        )
    if not isinstance(inp.ppo_mini_batches, int) or inp.ppo_mini_batches < 1:
        raise EngineError(
            "plan-bad-input",
            f"--ppo-mini-batches must be a positive integer, not {inp.ppo_mini_batches}",
        )
    limit = inp.shape.max_position_embeddings
    if limit and inp.seq > limit:
        raise EngineError(
            "plan-sequence-too-long",
            f"prompt + response ({inp.prompt_length} + {inp.response_length} = {inp.seq}) "
            f"exceeds the model's max_position_embeddings ({limit})",
        )
    if inp.compute_dtype not in PRECISIONS:
        raise EngineError("plan-bad-input", f"no memory figures for dtype {inp.compute_dtype!r}")
    if inp.device == "cpu" and inp.gpus != 1:
        raise EngineError(
            "plan-bad-input",
            f"the cpu profile plans one worker process: {setting(inp.interface, 'gpus', 1)}",
        )
    recipes.validate(
        inp.algorithm,
        inp.critic,
        inp.rollout_n,
        inp.lora_rank,
        inp.lora_alpha,
        inp.lora_target_modules,
        inp.base_dtype,
    )


def plan(inp: Inputs) -> Plan:
    """The plan, or EngineError("plan-does-not-fit") naming what to change, or
    EngineError("plan-over-card") when its processes on one GPU hold more than the card."""
    found = search(inp)
    if found is None:
        raise EngineError("plan-does-not-fit", does_not_fit(inp))
    check_card(found)
    return found


def check_card(found: Plan) -> None:
    """The card-wide sum (every process the job puts on one GPU, each with its CUDA
    context) within the card's usable memory, as the guard caps it: a cap the per-process
    search allowed (a small headroom) can still be over the card."""
    inp = found.inputs
    if inp.device != "cuda":
        return
    procs = card_processes(inp, found.phases)
    total = sum(p["peak_mib"] for p in procs)
    usable = card_usable_mib(inp)
    if total > usable:
        each = ", ".join(
            f"{p['process']} {p['peak_mib']} MiB in {p['phase']} (context {p['context_mib']})"
            for p in procs
        )
        raise EngineError(
            "plan-over-card",
            f"the plan's processes on one GPU hold {total} MiB together ({each}), over the "
            f"card's usable {usable} MiB ({inp.memory_mib} MiB less {inp.memory_mib - usable} "
            f"for the driver); what to change: a larger "
            f"{spell(inp.interface, 'headroom_mib')} (the default cap is "
            f"{int(min(inp.memory_mib - CAP_MARGIN_MIB, CAP_FRACTION * inp.memory_mib))} MiB) "
            f"or a smaller {spell(inp.interface, 'target_train_batch')}",
        )


def does_not_fit(inp: Inputs) -> str:
    """Why the smallest setting does not fit, and which changes would."""
    inp = replace(inp, base_dtype=base_dtypes(inp)[-1])  # auto: its smallest, tried last
    batch = inp.target_train_batch or inp.gpus
    tries = []
    for level, off in offload_levels(inp):
        phases = estimate(inp, Choice(batch, batch, 1, 1, 1, True, off, level))
        worst = max(phases, key=lambda k: phases[k].peak)
        tries.append((phases[worst].peak, level, worst, phases[worst]))
    _, level, worst, est = min(tries, key=lambda t: t[0])
    top = sorted({**est.resident, **est.transient}.items(), key=lambda kv: -kv[1])[:4]
    parts = ", ".join(f"{k} {v:.0f}" for k, v in top)
    what = f"target batch {inp.target_train_batch}" if inp.target_train_batch else f"batch {batch}"
    head = (
        f"{inp.model_name or 'the model'} ({inp.shape.params() / 1e9:.2f}B params, "
        f"{inp.compute_dtype}) does not fit {inp.gpus} x {inp.memory_mib} MiB: even at {what}, "
        f"micro batch 1, gradient checkpointing and the best offload ('{level}'), the {worst} "
        f"phase needs {est.peak:.0f} MiB, over the cap of {cap_mib(inp)} MiB ({parts} MiB)."
    )
    ui = inp.interface  # the fixes in the asker's terms: flags, or a job's settings
    fixes = []
    if inp.target_train_batch and search(replace(inp, target_train_batch=None)):
        fixes.append(
            f"a smaller {spell(ui, 'target_train_batch')} (or none: the planner finds the largest)"
        )
    shorter = _longest_response_that_fits(inp)
    if shorter:
        fixes.append(f"shorter responses ({setting(ui, 'response_length', shorter)} fits)")
    if inp.device == "cuda":
        more = next(
            (g for g in (2, 4, 8, 16) if g > inp.gpus and search(replace(inp, gpus=g))), None
        )
        if more:
            fixes.append(
                f"more GPUs ({setting(ui, 'gpus', more)} fits: FSDP shards weights, grads, Adam)"
            )
        else:
            fixes.append(
                "more GPUs do not help alone"
                + ("" if inp.lora else " (each GPU holds the whole actor unsharded)")
            )
        capped = MAX_OFFLOAD[inp.max_offload] < MAX_OFFLOAD["all"]
        if capped and search(replace(inp, max_offload="all")):
            fixes.append(f"allow offload ({setting(ui, 'max_offload', 'all')})")
    if inp.critic and inp.algorithm is None and search(replace(inp, critic=False)):
        fixes.append(f"no critic (GRPO: {switch(ui, NO_CRITIC)} fits)")
    elif inp.critic and search(replace(inp, algorithm="grpo", critic=False)):
        fixes.append(f"a critic-free estimator ({setting(ui, 'algorithm', 'grpo')} fits)")
    if inp.ref and not inp.lora and search(replace(inp, ref=False)):
        fixes.append(f"no reference model (no KL: {switch(ui, NO_REF)} fits)")
    if not inp.lora and search(replace(inp, lora_rank=SUGGESTED_LORA_RANK, base_dtype="auto")):
        fixes.append(
            f"LoRA ({setting(ui, 'lora_rank', SUGGESTED_LORA_RANK)} fits: gradients and Adam "
            "for the adapters only, and no ref copy; the frozen base at 16 bits where fp32 "
            "does not fit)"
        )
    elif inp.lora and inp.base_dtype == "fp32" and search(replace(inp, base_dtype="bf16")):
        fixes.append(f"the frozen base at 16 bits ({setting(ui, 'base_dtype', 'bf16')} fits)")
    smaller = [
        name
        for name, shape in SHAPES.items()
        if shape.params() < inp.shape.params() and search(replace(inp, shape=shape))
    ]
    fixes.append(f"a smaller model ({', '.join(smaller)} fits)" if smaller else "a smaller model")
    return f"{head} What to change: {'; '.join(fixes)}."


def _longest_response_that_fits(inp: Inputs) -> int | None:
    lo, hi = 0, inp.response_length - 1
    if hi < 1 or search(replace(inp, response_length=1)) is None:
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if search(replace(inp, response_length=mid)):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class Largest:
    """The answer to "the largest model of these shapes that fits": each shape of the
    family, smallest first, with its plan or None."""

    inputs: Inputs
    family: str
    tried: tuple[tuple[str, Plan | None], ...]

    @property
    def best(self) -> tuple[str, Plan] | None:
        fits = [(name, found) for name, found in self.tried if found is not None]
        return fits[-1] if fits else None


def largest(inp: Inputs, family: str) -> Largest:
    """Plan each built-in shape of ``family`` for this card and recipe (``inp``'s shape
    is replaced); the largest that fits is ``best``."""
    if family not in FAMILIES:
        raise EngineError(
            "plan-bad-input", f"no built-in shapes of family {family!r} ({', '.join(FAMILIES)})"
        )
    validate(inp)
    tried = tuple(
        (name, search(replace(inp, shape=SHAPES[name], model_name=name)))
        for name in FAMILIES[family]
    )
    return Largest(inp, family, tried)
