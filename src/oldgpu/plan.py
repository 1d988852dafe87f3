"""``oldgpu plan``: batch sizes, micro batches, checkpointing and offload that fit the GPU.

From the GPU's memory, the model's shape, the prompt and response lengths and
the profile (dtype, rollout, device), the planner picks verl 0.5.0's
``train_batch_size``, ``ppo_mini_batch_size``, the micro batches of the actor,
critic, rollout log-prob and ref log-prob, gradient checkpointing, and the
param/optimizer offload of actor, ref and critic; it prints them as Hydra
overrides with the memory estimate behind each choice. Inputs that cannot fit
are refused (``plan-does-not-fit``) with what to change, never turned into a
config that will run out of memory.

The memory model (docs/planner.md has it with the measurements)
---------------------------------------------------------------
verl's colocated layout: one process per GPU holds the actor (and the HF
rollout, which generates with the actor's own weights), the ref and the
critic, and runs one phase at a time: generate, actor log-prob, ref log-prob,
critic values, critic update, actor update. The peak is the largest phase;
each phase counts

* resident state (bytes per parameter from the dtype, ``Precision``): FSDP
  shards weights, the gradient and Adam's two moments over the GPUs
  (``/ gpus``). Optimizer offload moves a role's Adam moments to the host
  between its updates. Param offload frees nothing on ONE GPU in verl 0.5.0:
  FSDP1 switches to NO_SHARD there and the module keeps views of the GPU
  weights, so verl's ``offload_fsdp_model_to_cpu`` copies them out without
  freeing them; for the same reason the ref, which verl wraps with FSDP
  CPUOffload, stays on the GPU (both measured: see the calibration). On
  several GPUs the shards do leave (not measured yet).
* unsharded copies: with the HF rollout verl wraps the actor as ONE FSDP
  unit, so on several GPUs (or with a bf16 compute copy) the whole model is
  unsharded for generate, log-prob and update; the critic is wrapped per layer
  (root unit: the embeddings).
* transient tensors, as "moments" of a phase that do not coexist (the phase
  needs the largest):
  - generate (HF ``generate`` over the whole per-GPU rollout batch at once):
    the prefill (live layer activations, the prompt's KV cache) or the end
    of decoding (KV cache ``2 * layers * kv_heads * head_dim * bytes * batch *
    (prompt + response)``, sampling logits);
  - log-prob (no grad, one micro batch): the trunk's live activations, or the
    logits ``micro * seq * vocab * bytes`` plus copies over the response
    (entropy's softmax and product; the ref: one row's logsumexp);
  - update (one micro batch): the backward's start (saved activations
    ``ACT_H * hidden + ACT_I * intermediate`` per token per layer, or under
    gradient checkpointing the layer inputs plus one recomputed layer; the
    actor's ``LOGITS_TRAIN_COPIES`` logits; the embedding's dense gradient),
    or the optimizer step (foreach AdamW's ``sqrt(exp_avg_sq)``, one
    parameter-sized temporary).
* the caching allocator: reserved = ``RESERVE_FACTOR`` x allocated (freed
  blocks of other sizes, optimizer state moved in and out), plus
  ``CUDA_CONTEXT_MIB`` outside torch.

Calibration (tests/test_plan.py): the lent GPU's two measured verl runs,
12.95 / 17.75 GiB (batch 1, micro 1, offload on) and 22.35 / 33.65 GiB
(batch 16, micro 4, no offload, gradient checkpointing off) allocated /
reserved, and per-operation figures from a replication of verl's memory path
(real FSDP1, verl's offload functions, HF generate; H200, fp32) that
reproduces both runs' allocated peaks to 0.1%.

The search: the largest ``train_batch_size`` (throughput grows about linearly
with the rollout batch while generation dominates the step) whose every phase
stays at or under the cap; at that batch the least offload (none, critic
optimizer, both optimizers, critic params, actor params), gradient
checkpointing on (cheap next to generation), then the largest micro batches.
Batch sizes divide as verl asserts: ``train_batch_size`` is a multiple of
``ppo_mini_batch_size``, itself a multiple of micro batch x GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from oldgpu import detect, profile
from oldgpu.output import EngineError, Result

MIB = 1024 * 1024

# -- the constants of the memory model: one place, tunable ------------------------------
# The GPU-proof issue adjusts these to measured peaks; docs/planner.md gives the
# measurement behind each ("measured" = the H200 replication of verl's memory path).

# The cap the peak must stay at or under: min(memory - CAP_MARGIN_MIB, CAP_FRACTION *
# memory), i.e. 22 GiB on a 24 GiB card. --headroom-mib N makes it memory - N.
CAP_MARGIN_MIB = 2048
CAP_FRACTION = 0.92
# Outside torch's allocator: the CUDA context with cuBLAS/cuDNN handles; on the cpu
# device, Python, torch, Ray and verl in the worker process (a guess).
CUDA_CONTEXT_MIB = 500
HOST_PROCESS_MIB = 1024
# Reserved / allocated at the peak. Fitted to the two measured verl runs (17.75/12.95 =
# 1.37, 33.65/22.35 = 1.51); the replication gave 1.47 and 1.52. The cpu figure is a guess.
RESERVE_FACTOR = {"cuda": 1.44, "cpu": 1.2}
# verl 0.5.0 on one GPU: FSDP1 NO_SHARD keeps the module's views of the GPU weights, so
# param offload frees nothing and the CPUOffload-wrapped ref stays on the GPU (measured:
# offloading left the 3 models' 5654 MiB allocated); see RELOAD_COPIES for what it adds.
PARAM_OFFLOAD_FREES_ON_ONE_GPU = False
# Saved activations of one decoder layer per token, in elements: ACT_H * hidden +
# ACT_I * intermediate (RMSNorm in/out 2h, q and the repeated k/v and the attention
# output 4h, o_proj input h, post-norm 2h; MLP gate, act, up, product 4i). Measured:
# 1318 MiB per 512-token sequence of Qwen2.5-0.5B without checkpointing (formula 1318).
ACT_H = 9
ACT_I = 4
# Outside the layers, per token: embedding output, final norm in/out.
ACT_OUTSIDE_H = 3
# Under gradient checkpointing each layer keeps its input (GC_H * hidden per token),
# and the layer being recomputed holds the full set above.
GC_H = 1
# Gradients flowing through a layer in the backward, per token.
BACKWARD_H = 2
BACKWARD_I = 2
# Live in one no-grad layer forward, per token (residual, norm, q, repeated k/v, out;
# MLP act, up, product). Measured: prefill 18 MiB per 256-token prompt, formula 17.75.
INFER_H = 5
INFER_I = 3
# Logits (micro x seq x vocab) alive in the actor's backward: the lm_head output, the
# response slice's gradient scattered back to full length, the temperature division's.
# Measured 2.0 without and 3.0 with gradient checkpointing under FSDP: 3.
LOGITS_TRAIN_COPIES = 3.0
# Log-prob phases: the full logits plus copies over the response (actor: entropy's
# softmax and its product; ref: one row's logsumexp). Measured exactly: 594 and 445 MiB
# for one 256 + 256 sequence.
LOGITS_ENTROPY_RESPONSE_COPIES = 2.0
# The embedding's (and a tied lm_head's) dense gradient before it is accumulated:
# vocab x hidden x bytes in each update (measured about 520 MiB in the critic's).
EMBEDDING_GRAD_COPIES = 1.0
# On one GPU, loading offloaded weights back (verl's load_fsdp_model_to_gpu, and FSDP
# CPUOffload before the ref's forward) makes a new GPU copy while the module's views still
# hold the old one, until the first forward rebinds them: a weights-sized moment at the
# start of the role's phase (measured: +1885 MiB at every reload of 494M fp32 weights).
RELOAD_COPIES = 1.0
# Sampling in HF generate, per decoding step: batch x vocab logits, their fp32 copy,
# the softmax probabilities.
SAMPLING_LOGITS_COPIES = 3.0
# torch's foreach AdamW allocates sqrt(exp_avg_sq) for all parameters at once
# (measured 1886 MiB for 494M fp32 parameters).
ADAM_STEP_TEMP_COPIES = 1.0
# The actor is ONE FSDP unit with the HF rollout: at the end of its backward the whole
# flat gradient exists twice beyond .grad (the incoming gradient and its accumulation;
# on several GPUs the unsharded gradient before the reduce-scatter). Measured on one GPU:
# +2 x weights beyond weights, Adam and .grad at micro 1, 2 and 4, except right after a
# param-offload reload (a fresh flat parameter), where only the Adam step's copy shows.
ACTOR_GRAD_END_COPIES = 2.0
# Rollout tensors kept on the GPU per sequence: int64 ids/mask/positions over the
# sequence and responses; fp32 log-probs, values, advantages, returns, rewards.
DATA_INT64_SEQ = 3
DATA_INT64_RESP = 2
DATA_FP32_RESP = 8
# vLLM (Ampere and newer profiles only, not measured): its own weights copy and a
# workspace beside the KV cache, inside gpu_memory_utilization * memory.
VLLM_WORKSPACE_MIB = 1024
VLLM_MAX_UTILIZATION = 0.9

# The search space. Micro batches are powers of two up to BATCH_STEP (16 sequences of a
# few hundred tokens already fill a GPU's matrix units); train_batch_size is 1, 2, 4, 8
# x gpus, then a multiple of BATCH_STEP x gpus, so every micro batch divides it; its
# ceiling is verl's GSM8K quick start's 256 (fp32 training on a Pascal card grows
# linearly with the batch; --target-train-batch goes past it).
BATCH_STEP = 16
MICRO_BATCHES = (16, 8, 4, 2, 1)
LOG_PROB_MICRO_BATCHES = (64, 32, 16, 8, 4, 2, 1)
MAX_TRAIN_BATCH = 256
PPO_MINI_BATCHES = 4  # optimizer steps per PPO step, as verl's defaults (1024/256, 256/64)

PHASES = (
    "generate",
    "actor_log_prob",
    "ref_log_prob",
    "critic_values",
    "critic_update",
    "actor_update",
)


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what each role keeps, for one compute dtype."""

    master: int  # the sharded weights FSDP trains (fp32 in both modes)
    grad: int  # the sharded gradient
    adam: int  # Adam's two moments
    compute: int  # activations, logits, KV cache, the unsharded compute copy
    ref: int  # the reference model's weights


# fp32: 4 + 4 + 8 = 16 bytes per trained parameter. bf16 mixed precision keeps fp32
# master weights, gradients and moments (16 bytes) and computes with a bf16 copy
# (+2 bytes while a role computes); verl loads the ref in bf16.
PRECISIONS = {
    "fp32": Precision(master=4, grad=4, adam=8, compute=4, ref=4),
    "bf16": Precision(master=4, grad=4, adam=8, compute=2, ref=2),
}


# -- the model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    attention_bias: bool = True  # Qwen2 has q/k/v biases
    max_position_embeddings: int | None = None

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def layer_params(self) -> int:
        h, d = self.hidden_size, self.dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        return attn + 3 * h * self.intermediate_size + 2 * h

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def params(self) -> int:
        """Parameters of the causal LM (actor, ref)."""
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params()
        return (
            self.embedding_params()
            + self.num_hidden_layers * self.layer_params()
            + self.hidden_size
            + lm_head
        )

    def critic_params(self) -> int:
        """The critic: the same trunk with a value head (hidden -> 1) for the lm_head."""
        trunk = self.embedding_params() + self.num_hidden_layers * self.layer_params()
        return trunk + self.hidden_size + self.hidden_size + 1


# Built-in shapes (their config.json values).
SHAPES: dict[str, ModelShape] = {
    "qwen2.5-0.5b": ModelShape(896, 24, 14, 2, 4864, 151936, True, max_position_embeddings=32768),
    "qwen2.5-1.5b": ModelShape(1536, 28, 12, 2, 8960, 151936, True, max_position_embeddings=32768),
    "qwen2.5-3b": ModelShape(2048, 36, 16, 2, 11008, 151936, True, max_position_embeddings=32768),
    "qwen2.5-7b": ModelShape(3584, 28, 28, 4, 18944, 152064, False, max_position_embeddings=32768),
}

_REQUIRED_CONFIG_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


def shape_from_config(config: Mapping[str, Any]) -> ModelShape:
    """A ModelShape from a Hugging Face config.json's fields."""
    if "hidden_size" not in config and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]  # multimodal configs nest the language model
    missing = [k for k in _REQUIRED_CONFIG_KEYS if not isinstance(config.get(k), int)]
    if missing:
        raise EngineError(
            "plan-model-config-invalid",
            f"config.json lacks integer {', '.join(missing)}; pass --model-shape instead",
        )
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    model_type = str(config.get("model_type", ""))
    bias = config.get("attention_bias", model_type.startswith("qwen2"))
    return ModelShape(
        hidden_size=config["hidden_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=int(kv),
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=int(config.get("head_dim") or 0),
        attention_bias=bool(bias),
        max_position_embeddings=config.get("max_position_embeddings"),
    )


def load_model_dir(path: str | Path) -> ModelShape:
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise EngineError(
            "plan-model-config-missing", f"{config_path} does not exist (pass --model-shape)"
        ) from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise EngineError("plan-model-config-invalid", f"{config_path}: {exc}") from exc
    if not isinstance(config, Mapping):
        raise EngineError("plan-model-config-invalid", f"{config_path} is not a JSON object")
    return shape_from_config(config)


# -- inputs and choices -------------------------------------------------------------------


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


# Offload levels in the order they are tried: each frees more and costs more transfers.
OFFLOAD_LEVELS: tuple[Offload, ...] = (
    Offload(),
    Offload(critic_optimizer=True),
    Offload(actor_optimizer=True, critic_optimizer=True),
    Offload(actor_optimizer=True, critic_optimizer=True, critic_param=True),
    Offload(True, True, True, True),
)
_MAX_OFFLOAD = {"none": 0, "optimizer": 2, "all": 4}


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
    top = 0 if inp.device == "cpu" else _MAX_OFFLOAD[inp.max_offload]
    out: list[tuple[str, Offload]] = []
    for off in OFFLOAD_LEVELS[: top + 1]:
        if not inp.critic:
            off = replace(off, critic_param=False, critic_optimizer=False)
        if all(off != seen for _, seen in out):
            out.append((level_name(off), off))
    return out


# -- the estimate -------------------------------------------------------------------------


def _mib(n_bytes: float) -> float:
    return n_bytes / MIB


@dataclass
class PhaseEstimate:
    """One phase's memory in MiB: what stays, what comes and goes, what the allocator adds.

    ``moments`` are sets of transient tensors that do not coexist (the prefill and the
    end of decoding; the backward and the optimizer step): the phase needs the largest,
    on top of ``common`` (the rollout tensors) and ``resident``.
    """

    resident: dict[str, float]  # weights, gradients, optimizer state
    moments: dict[str, dict[str, float]]
    common: dict[str, float] = field(default_factory=dict)
    context: float = 0.0
    reserve_factor: float = 1.0

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=lambda k: sum(self.moments[k].values()), default="")

    @property
    def transient(self) -> dict[str, float]:
        """The tensors of the largest moment, with the common ones."""
        return {**self.common, **self.moments.get(self.peak_moment, {})}

    @property
    def allocated(self) -> float:
        return sum(self.resident.values()) + sum(self.transient.values())

    @property
    def reserved(self) -> float:
        return self.reserve_factor * self.allocated

    @property
    def peak(self) -> float:
        return self.reserved + self.context

    def as_dict(self) -> dict[str, Any]:
        def r(d: Mapping[str, float]) -> dict[str, float]:
            return {k: round(v, 1) for k, v in d.items() if v}

        return {
            "peak_mib": round(self.peak),
            "allocated_mib": round(self.allocated),
            "reserved_mib": round(self.reserved),
            "peak_moment": self.peak_moment,
            "breakdown": {
                "resident": r(self.resident),
                "transient": r(self.transient),
                "other_moments": {
                    k: r(v) for k, v in self.moments.items() if k != self.peak_moment
                },
                "allocator_reserve": round(self.reserved - self.allocated, 1),
                "context": self.context,
            },
        }


_ABSENT = PhaseEstimate({}, {})


def _layer_train_elems(s: ModelShape, checkpointing: bool) -> float:
    """Elements per token held for the backward, all layers."""
    layer = ACT_H * s.hidden_size + ACT_I * s.intermediate_size
    backward = BACKWARD_H * s.hidden_size + BACKWARD_I * s.intermediate_size
    outside = ACT_OUTSIDE_H * s.hidden_size
    if checkpointing:
        return s.num_hidden_layers * GC_H * s.hidden_size + layer + backward + outside
    return s.num_hidden_layers * layer + backward + outside


def _infer_elems(s: ModelShape) -> float:
    return INFER_H * s.hidden_size + INFER_I * s.intermediate_size


def per_gpu_batch(inp: Inputs, train_batch: int) -> int:
    """Sequences each GPU generates and scores: train_batch_size x rollout.n / gpus."""
    return max(1, math.ceil(train_batch * inp.rollout_n / inp.gpus))


def param_offload_frees(inp: Inputs) -> bool:
    return inp.device == "cuda" and (inp.gpus > 1 or PARAM_OFFLOAD_FREES_ON_ONE_GPU)


def estimate_phase(inp: Inputs, choice: Choice, phase: str) -> PhaseEstimate:
    """Memory of one phase of one PPO step, per GPU, in MiB."""
    if (phase.startswith("critic") and not inp.critic) or (phase == "ref_log_prob" and not inp.ref):
        return _ABSENT  # the role is absent
    s, p, n = inp.shape, inp.precision, inp.gpus
    off = choice.offload
    cuda = inp.device == "cuda"
    frees = param_offload_frees(inp)
    pa, pc = s.params(), s.critic_params()
    seq, resp, vocab, cb = inp.seq, inp.response_length, s.vocab_size, p.compute
    embed = s.embedding_params()
    batch = per_gpu_batch(inp, choice.train_batch_size)
    lp_micro = min(choice.log_prob_micro, batch)
    a_micro = min(choice.actor_micro, batch)
    c_micro = min(choice.critic_micro, batch)
    mixed = p.compute != p.master
    actor_phase = phase in ("generate", "actor_log_prob", "actor_update")
    critic_phase = phase in ("critic_values", "critic_update")

    res: dict[str, float] = {}
    if actor_phase or not (off.actor_param and frees):
        res["actor_weights"] = _mib(pa * p.master / n)
    if phase == "actor_update" or not (off.actor_optimizer and cuda):
        res["actor_adam"] = _mib(pa * p.adam / n)
    if inp.critic:
        if critic_phase or not (off.critic_param and frees):
            res["critic_weights"] = _mib(pc * p.master / n)
        if phase == "critic_update" or not (off.critic_optimizer and cuda):
            res["critic_adam"] = _mib(pc * p.adam / n)
    if inp.ref and (phase == "ref_log_prob" or n == 1 or not cuda):
        # FSDP CPUOffload: the whole ref (one unit with the HF rollout) comes to the GPU
        # for its forward; on one GPU it never leaves (NO_SHARD views).
        res["ref_weights"] = _mib(pa * p.ref)
    if actor_phase and (n > 1 or mixed):
        unshard = p.master if phase == "generate" else p.compute  # summon_full_params
        res["actor_unsharded_weights"] = _mib(pa * unshard)
    if critic_phase and (n > 1 or mixed):
        res["critic_unsharded_units"] = _mib((embed + 2 * s.layer_params()) * cb)
    if phase == "actor_update":
        res["actor_grads"] = _mib(pa * p.grad / n)
    if phase == "critic_update":
        res["critic_grads"] = _mib(pc * p.grad / n)

    data_seq = 8 * (DATA_INT64_SEQ * seq + DATA_INT64_RESP * resp) + 4 * DATA_FP32_RESP * resp
    common = {"rollout_data": _mib(batch * data_seq)}
    moments: dict[str, dict[str, float]] = {}
    if phase == "generate":
        if inp.rollout == "vllm":
            moments["decode"] = _vllm_generate(inp, batch)
        else:
            layers, kvdim = s.num_hidden_layers, s.num_key_value_heads * s.dim
            kv_token = 2 * layers * kvdim * cb
            prompt = inp.prompt_length
            moments["prefill"] = {
                "kv_cache": _mib(kv_token * batch * prompt),
                "prefill_activations": _mib(
                    batch * prompt * _infer_elems(s) * cb + batch * prompt**2 * cb
                ),
            }
            moments["decode"] = {
                # DynamicCache concatenates a layer at a time: one layer's cache doubles
                "kv_cache": _mib(kv_token * batch * seq * (1 + 1 / layers)),
                "sampling_logits": _mib(SAMPLING_LOGITS_COPIES * batch * vocab * 4),
            }
    elif phase in ("actor_log_prob", "ref_log_prob", "critic_values"):
        micro = c_micro if phase == "critic_values" else lp_micro
        tokens = micro * seq
        moments["trunk"] = {
            "activations": _mib(tokens * _infer_elems(s) * cb + micro * seq * seq * cb)
        }
        if phase != "critic_values":
            full = tokens * vocab * cb
            if phase == "actor_log_prob":
                extra = LOGITS_ENTROPY_RESPONSE_COPIES * micro * resp * vocab * cb
            else:
                extra = resp * vocab * cb
            moments["logits"] = {
                "logits": _mib(full + extra),
                "hidden_states": _mib(tokens * s.hidden_size * cb),
            }
    else:
        micro, params = (a_micro, pa) if phase == "actor_update" else (c_micro, pc)
        tokens = micro * seq
        back = {
            "activations": _mib(
                tokens * _layer_train_elems(s, choice.gradient_checkpointing) * cb
                + micro * seq * seq * cb  # the 4D attention mask sdpa keeps
            ),
            "embedding_grad": _mib(EMBEDDING_GRAD_COPIES * embed * cb),
        }
        if phase == "actor_update":
            back["logits"] = _mib(LOGITS_TRAIN_COPIES * tokens * vocab * cb)
        moments["backward"] = back
        moments["optimizer_step"] = {
            "adam_sqrt_temp": _mib(ADAM_STEP_TEMP_COPIES * params * p.master / n)
        }
        reloaded = off.actor_param and cuda and not frees
        if phase == "actor_update" and not reloaded:
            moments["backward_end"] = {
                "flat_gradient_copies": _mib(ACTOR_GRAD_END_COPIES * pa * (cb if n > 1 else p.grad))
            }
    if cuda and not frees:
        # one GPU: reloading makes a second copy until the first forward (see RELOAD_COPIES)
        reload = 0.0
        if actor_phase and off.actor_param:
            reload = pa * p.master
        elif critic_phase and inp.critic and off.critic_param:
            reload = pc * p.master
        elif phase == "ref_log_prob":
            reload = pa * p.ref
        if reload:
            moments["reload"] = {"reloaded_weights_copy": _mib(RELOAD_COPIES * reload)}
    context = CUDA_CONTEXT_MIB if cuda else HOST_PROCESS_MIB
    return PhaseEstimate(res, moments, common, context, RESERVE_FACTOR[inp.device])


def _vllm_generate(inp: Inputs, batch: int) -> dict[str, float]:
    """vLLM holds gpu_memory_utilization * memory: its weights, KV cache and workspace."""
    s, cb = inp.shape, inp.precision.compute
    kv = 2 * s.num_hidden_layers * s.num_key_value_heads * s.dim * cb * batch * inp.seq
    return {
        "vllm_weights": _mib(s.params() * cb),
        "kv_cache": _mib(kv),
        "vllm_workspace": float(VLLM_WORKSPACE_MIB),
    }


def estimate(inp: Inputs, choice: Choice) -> dict[str, PhaseEstimate]:
    out = {}
    for phase in PHASES:
        if phase.startswith("critic") and not inp.critic:
            continue
        if phase == "ref_log_prob" and not inp.ref:
            continue
        out[phase] = estimate_phase(inp, choice, phase)
    return out


def vllm_utilization(inp: Inputs, phase: PhaseEstimate) -> float:
    """The gpu_memory_utilization that gives vLLM its share of the generate phase."""
    pool = sum(phase.moments.get("decode", {}).values()) * phase.reserve_factor
    return min(VLLM_MAX_UTILIZATION, math.ceil(100 * pool / inp.memory_mib) / 100)


# -- the search ---------------------------------------------------------------------------


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
    return replace(
        probe,
        ppo_mini_batch_size=mini,
        actor_micro=m_a,
        critic_micro=m_c,
        log_prob_micro=m_lp,
    )


def search(inp: Inputs) -> Plan | None:
    """The largest batch that fits; at that batch the least offload, then the largest micros.

    Each offload level's feasible batches only grow with memory, so the batch chosen
    never shrinks when memory grows.
    """
    validate(inp)
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
    for name in ("memory_mib", "gpus", "prompt_length", "response_length", "rollout_n"):
        value = getattr(inp, name)
        if not isinstance(value, int) or value < 1:
            raise EngineError("plan-bad-input", f"{name} must be a positive integer, not {value}")
    if inp.target_train_batch is not None and inp.target_train_batch < 1:
        raise EngineError("plan-bad-input", "--target-train-batch must be a positive integer")
    if inp.compute_dtype not in PRECISIONS:
        raise EngineError("plan-bad-input", f"no memory figures for dtype {inp.compute_dtype!r}")
    if inp.device == "cpu" and inp.gpus != 1:
        raise EngineError("plan-bad-input", "the cpu profile plans one worker process: --gpus 1")


def plan(inp: Inputs) -> Plan:
    """The plan, or EngineError("plan-does-not-fit") naming what to change."""
    found = search(inp)
    if found is None:
        raise EngineError("plan-does-not-fit", _does_not_fit(inp))
    return found


def _does_not_fit(inp: Inputs) -> str:
    """Why the smallest setting does not fit, and which changes would."""
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
    fixes = []
    if inp.target_train_batch and search(replace(inp, target_train_batch=None)):
        fixes.append("a smaller --target-train-batch (or none: the planner finds the largest)")
    shorter = _longest_response_that_fits(inp)
    if shorter:
        fixes.append(f"shorter responses (--response-length {shorter} fits)")
    if inp.device == "cuda":
        more = next(
            (g for g in (2, 4, 8, 16) if g > inp.gpus and search(replace(inp, gpus=g))), None
        )
        if more:
            fixes.append(f"more GPUs (--gpus {more} fits: FSDP shards weights, grads, Adam)")
        else:
            fixes.append("more GPUs do not help alone (each GPU holds the whole actor unsharded)")
        capped = _MAX_OFFLOAD[inp.max_offload] < _MAX_OFFLOAD["all"]
        if capped and search(replace(inp, max_offload="all")):
            fixes.append("allow offload (--max-offload all)")
    if inp.critic and search(replace(inp, critic=False)):
        fixes.append("no critic (GRPO: --no-critic fits)")
    if inp.ref and search(replace(inp, ref=False)):
        fixes.append("no reference model (no KL: --no-ref fits)")
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


# -- what the plan says -------------------------------------------------------------------


def _b(value: bool) -> str:
    return "True" if value else "False"


def hydra_overrides(inp: Inputs, choice: Choice, phases: Mapping[str, PhaseEstimate]) -> list[str]:
    """verl 0.5.0 keys, all present in its ppo_trainer config (no ``+``; a test composes them)."""
    off, gc = choice.offload, _b(choice.gradient_checkpointing)
    out = [
        f"data.train_batch_size={choice.train_batch_size}",
        f"data.max_prompt_length={inp.prompt_length}",
        f"data.max_response_length={inp.response_length}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={choice.ppo_mini_batch_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={choice.actor_micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={choice.log_prob_micro}",
    ]
    if inp.ref:
        out.append(
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={choice.log_prob_micro}"
        )
    out += [
        f"actor_rollout_ref.model.enable_gradient_checkpointing={gc}",
        f"actor_rollout_ref.actor.fsdp_config.param_offload={_b(off.actor_param)}",
        f"actor_rollout_ref.actor.fsdp_config.optimizer_offload={_b(off.actor_optimizer)}",
    ]
    if inp.ref:
        out.append(f"actor_rollout_ref.ref.fsdp_config.param_offload={_b(off.ref_param)}")
    if inp.critic:
        out += [
            f"critic.ppo_mini_batch_size={choice.ppo_mini_batch_size}",
            f"critic.ppo_micro_batch_size_per_gpu={choice.critic_micro}",
            f"critic.model.enable_gradient_checkpointing={gc}",
            f"critic.model.fsdp_config.param_offload={_b(off.critic_param)}",
            f"critic.model.fsdp_config.optimizer_offload={_b(off.critic_optimizer)}",
        ]
    if inp.rollout_n != 1:
        out.append(f"actor_rollout_ref.rollout.n={inp.rollout_n}")
    if inp.rollout == "vllm":  # never for the HF rollout: these settings are vLLM's
        util = vllm_utilization(inp, phases["generate"])
        out.append(f"actor_rollout_ref.rollout.gpu_memory_utilization={util}")
    if inp.device == "cuda":
        out.append(f"trainer.n_gpus_per_node={inp.gpus}")
    return out


def _reasons(found: Plan) -> dict[str, str]:
    """One line per choice with the numbers behind it, keyed by the override's key."""
    inp, c, ph = found.inputs, found.choice, found.phases
    cap = cap_mib(inp)

    def peak(phase: str, **change: Any) -> float:
        return estimate_phase(inp, replace(c, **change), phase).peak

    def item(est: PhaseEstimate, moment: str, key: str) -> float:
        return est.moments.get(moment, {}).get(key, 0.0)

    gen = ph["generate"]
    kv = item(gen, "decode", "kv_cache")
    r: dict[str, str] = {}
    batch_line = (
        f"generate {gen.peak:.0f} MiB of the {cap} MiB cap (KV cache {kv:.0f} MiB for "
        f"{per_gpu_batch(inp, c.train_batch_size)} x {inp.seq} tokens per GPU)"
    )
    cands = batch_candidates(replace(inp, target_train_batch=None))
    nxt = next((b for b in cands if b > c.train_batch_size), None)
    if inp.target_train_batch:
        r["data.train_batch_size"] = f"the --target-train-batch; {batch_line}"
    elif nxt is None:
        r["data.train_batch_size"] = f"the planner's ceiling ({MAX_TRAIN_BATCH}); {batch_line}"
    else:
        ok = [lv for lv, b in found.largest_batch.items() if b]
        why = "no offload level fits it" if ok else "nothing larger fits"
        r["data.train_batch_size"] = (
            f"the largest that fits ({nxt}: {why}); {batch_line}; peak {found.peak:.0f} MiB "
            f"in {found.peak_phase}"
        )
    r["data.max_prompt_length"] = f"the input, {inp.prompt_length} tokens"
    r["data.max_response_length"] = f"the input, {inp.response_length} tokens"
    steps = c.train_batch_size // c.ppo_mini_batch_size
    r["actor_rollout_ref.actor.ppo_mini_batch_size"] = (
        f"{c.train_batch_size} / {c.ppo_mini_batch_size} = {steps} optimizer step(s) per PPO "
        f"step (aim {inp.ppo_mini_batches}); a multiple of micro {c.actor_micro} x "
        f"{inp.gpus} GPU(s)"
    )
    upd = ph["actor_update"]
    bigger = next((m for m in reversed(MICRO_BATCHES) if m > c.actor_micro), None)
    share = c.train_batch_size // inp.gpus
    more = ""
    if bigger and share % bigger == 0:
        more = f"; {bigger} would need {peak('actor_update', actor_micro=bigger):.0f} MiB"
    r["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] = (
        f"the largest that fits: actor_update {upd.peak:.0f} MiB at its {upd.peak_moment} "
        f"(backward: activations {item(upd, 'backward', 'activations'):.0f}, logits "
        f"{item(upd, 'backward', 'logits'):.0f} = {LOGITS_TRAIN_COPIES:g} x {c.actor_micro} x "
        f"{inp.seq} x {inp.shape.vocab_size} x {inp.precision.compute} B){more}"
    )
    alp = ph["actor_log_prob"]
    bigger_lp = next((m for m in reversed(LOG_PROB_MICRO_BATCHES) if m > c.log_prob_micro), None)
    more_lp = ""
    if bigger_lp and bigger_lp <= per_gpu_batch(inp, c.train_batch_size):
        more_lp = f"; {bigger_lp} would need {peak('actor_log_prob', log_prob_micro=bigger_lp):.0f}"
    r["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"] = (
        f"the largest that fits (no gradients, so at least the train micro where it fits): "
        f"actor_log_prob {alp.peak:.0f} MiB (logits with entropy "
        f"{item(alp, 'logits', 'logits'):.0f}){more_lp}"
    )
    if inp.ref:
        rlp = ph["ref_log_prob"]
        r["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"] = (
            f"as the rollout's: ref_log_prob {rlp.peak:.0f} MiB (logits "
            f"{item(rlp, 'logits', 'logits'):.0f}, ref weights {rlp.resident['ref_weights']:.0f})"
        )
    gc_off = estimate_phase(inp, replace(c, gradient_checkpointing=False), "actor_update")
    r["actor_rollout_ref.model.enable_gradient_checkpointing"] = (
        f"on: actor_update activations {item(upd, 'backward', 'activations'):.0f} MiB, "
        f"{item(gc_off, 'backward', 'activations'):.0f} without ({gc_off.peak:.0f} MiB peak); "
        f"recompute is cheap next to generation"
    )
    lvl = [name for name, _ in offload_levels(inp)]
    idx = lvl.index(c.offload_level)
    off_line = f"offload '{c.offload_level}' (level {idx} of {len(lvl) - 1})"
    if idx == 0:
        off_line += ": none needed"
    else:
        less = found.largest_batch.get(lvl[idx - 1])
        off_line += (
            f": with '{lvl[idx - 1]}' the largest batch is {less}"
            if less
            else f": with '{lvl[idx - 1]}' nothing fits"
        )
    for key in (
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
        "critic.model.fsdp_config.param_offload",
        "critic.model.fsdp_config.optimizer_offload",
    ):
        r[key] = off_line
    if not param_offload_frees(inp) and inp.device == "cuda":
        note = (
            "; on one GPU param offload frees nothing in verl 0.5.0 (FSDP NO_SHARD keeps the "
            "module's views of the weights) and a reload holds the weights twice"
        )
        if c.offload.actor_param:
            note += ", but a reloaded actor skips the double flat gradient of its backward's end"
        r["actor_rollout_ref.actor.fsdp_config.param_offload"] += note
        r["critic.model.fsdp_config.param_offload"] += note.split(", but")[0]
    if c.offload.actor_param and inp.rollout == "hf":
        r["actor_rollout_ref.actor.fsdp_config.param_offload"] += (
            "; needs oldgpu patch's hf-rollout-param-offload"
        )
    if inp.ref:
        r["actor_rollout_ref.ref.fsdp_config.param_offload"] = (
            "follows the actor's: verl 0.5.0 wraps the ref with FSDP CPUOffload itself and the "
            "colocated worker reads the actor's flags"
        )
    if inp.critic:
        r["critic.ppo_mini_batch_size"] = "the actor's (verl's default follows it)"
        cu = ph["critic_update"]
        r["critic.ppo_micro_batch_size_per_gpu"] = (
            f"the largest that fits, at most the actor's so the sizes divide: critic_update "
            f"{cu.peak:.0f} MiB at its {cu.peak_moment} (a value head: no vocab logits); "
            f"critic values use it too"
        )
        r["critic.model.enable_gradient_checkpointing"] = "as the actor's"
    r["actor_rollout_ref.rollout.n"] = f"the input: {inp.rollout_n} responses per prompt"
    if inp.rollout == "vllm":
        r["actor_rollout_ref.rollout.gpu_memory_utilization"] = (
            "vLLM's share of the GPU: its weights, KV cache and workspace in generate"
        )
    r["trainer.n_gpus_per_node"] = f"{inp.gpus}: verl divides the batch sizes by it"
    return r


def _notes(found: Plan) -> list[str]:
    inp = found.inputs
    notes = [
        "estimates are peak reserved memory as a GPU without memory pressure shows it "
        f"(reserved = {RESERVE_FACTOR[inp.device]} x allocated) plus the context; under "
        "pressure the allocator frees its cached blocks before failing, so runs near the "
        "cap usually need less than estimated",
    ]
    if inp.ref:
        notes.append(
            "verl builds the ref only with actor_rollout_ref.actor.use_kl_loss=True or "
            "algorithm.use_kl_in_reward=True; without either, plan with --no-ref"
        )
    if inp.critic:
        notes.append("verl uses the critic only with algorithm.adv_estimator=gae (its default)")
    else:
        notes.append("no critic: set an estimator without one (e.g. algorithm.adv_estimator=grpo)")
    limit = inp.shape.max_position_embeddings
    if limit and inp.seq > limit:
        notes.append(f"prompt + response ({inp.seq}) exceeds the model's {limit} positions")
    if inp.rollout == "vllm":
        notes.append("vLLM's share is modelled, not measured (the measurements are HF rollout)")
    if inp.device == "cuda" and inp.gpus > 1:
        notes.append(
            "several GPUs: sharding and offload follow FSDP's design; only one GPU was measured"
        )
    return notes


def payload(found: Plan) -> dict[str, Any]:
    inp, c = found.inputs, found.choice
    s = inp.shape
    overrides = hydra_overrides(inp, c, found.phases)
    reasons = _reasons(found)
    return {
        "inputs": {
            "memory_mib": inp.memory_mib,
            "memory_source": "host" if inp.device == "cpu" else "gpu",
            "gpus": inp.gpus,
            "model": inp.model_name,
            "prompt_length": inp.prompt_length,
            "response_length": inp.response_length,
            "profile": inp.profile_name,
            "compute_dtype": inp.compute_dtype,
            "rollout": inp.rollout,
            "device": inp.device,
            "critic": inp.critic,
            "ref": inp.ref,
            "rollout_n": inp.rollout_n,
            "headroom_mib": inp.headroom_mib,
            "target_train_batch": inp.target_train_batch,
            "max_offload": inp.max_offload,
            "ppo_mini_batches": inp.ppo_mini_batches,
        },
        "model": {
            "name": inp.model_name,
            "params": s.params(),
            "critic_params": s.critic_params(),
            **{k: v for k, v in asdict(s).items() if k != "head_dim"},
            "head_dim": s.dim,
            "bytes_per_trained_param": inp.precision.master
            + inp.precision.grad
            + inp.precision.adam,
        },
        "choice": {
            "train_batch_size": c.train_batch_size,
            "ppo_mini_batch_size": c.ppo_mini_batch_size,
            "micro_batches": {
                "actor": c.actor_micro,
                "critic": c.critic_micro if inp.critic else None,
                "rollout_log_prob": c.log_prob_micro,
                "ref_log_prob": c.log_prob_micro if inp.ref else None,
            },
            "gradient_checkpointing": {
                "actor": c.gradient_checkpointing,
                "critic": c.gradient_checkpointing if inp.critic else None,
            },
            "offload": {
                "level": c.offload_level,
                "actor_param": c.offload.actor_param,
                "actor_optimizer": c.offload.actor_optimizer,
                "ref_param": c.offload.ref_param if inp.ref else None,
                "critic_param": c.offload.critic_param if inp.critic else None,
                "critic_optimizer": c.offload.critic_optimizer if inp.critic else None,
            },
        },
        "estimate": {
            "peak_mib": round(found.peak),
            "cap_mib": cap_mib(inp),
            "memory_mib": inp.memory_mib,
            "peak_phase": found.peak_phase,
            "per_phase": {k: v.as_dict() for k, v in found.phases.items()},
        },
        "hydra_overrides": overrides,
        "reasons": [f"{o}: {reasons.get(o.split('=', 1)[0], '')}" for o in overrides],
        "notes": _notes(found),
    }


def text(doc: Mapping[str, Any]) -> str:
    i, m, e = doc["inputs"], doc["model"], doc["estimate"]
    lines = [
        f"plan: {i['model'] or 'model'} ({m['params'] / 1e6:.1f}M params, {i['compute_dtype']}) "
        f"on {i['gpus']} x {i['memory_mib']} MiB ({i['profile']}, {i['rollout']} rollout), "
        f"prompt {i['prompt_length']} + response {i['response_length']}",
        f"peak {e['peak_mib']} MiB in {e['peak_phase']}, cap {e['cap_mib']} MiB",
        "phases (MiB): " + ", ".join(f"{k} {v['peak_mib']}" for k, v in e["per_phase"].items()),
        "hydra overrides:",
    ]
    for line in doc["reasons"]:
        override, _, why = line.partition(": ")
        lines.append(f"  {override}")
        if why:
            lines.append(f"      # {why}")
    lines += [f"note: {n}" for n in doc["notes"]]
    return "\n".join(lines)


# -- CLI ----------------------------------------------------------------------------------


def _profile_from_args(args: argparse.Namespace) -> tuple[dict[str, Any], list[Any]]:
    """The profile and, when detected, the GPUs it came from."""
    if args.profile:
        arch, _, cc = args.profile.partition("-")
        return profile.profile_for_arch(arch, cc or None), []
    if args.arch:
        return profile.profile_for_arch(args.arch), []
    if args.cc:
        return profile.profile_for_cc(args.cc), []
    gpus = detect.detect_from_args(args)["gpus"]
    return profile.profile_for_gpus(gpus), gpus


def _host_available_mib() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def inputs_from_args(args: argparse.Namespace) -> Inputs:
    prof, gpus = _profile_from_args(args)
    device = prof["device"]
    if device == "cpu":
        if args.gpu_mib is not None and not (args.profile or args.arch or args.cc):
            raise EngineError(
                "plan-profile-unknown",
                "no GPU detected; pass --arch/--cc/--profile for the GPU you plan for, or "
                "--profile cpu with --host-mib",
            )
        memory = args.host_mib or _host_available_mib()
        if not memory:
            raise EngineError("plan-memory-unknown", "the cpu profile needs --host-mib N")
    else:
        memory = args.gpu_mib
        if memory is None:
            sizes = [g.get("memory_mib") for g in gpus]
            if not sizes or not all(sizes):
                raise EngineError(
                    "plan-memory-unknown",
                    "cannot tell the GPU's memory; pass --gpu-mib N (the smallest GPU's)",
                )
            memory = min(sizes)
    if args.model:
        shape, name = load_model_dir(args.model), str(args.model)
    else:
        name = args.model_shape or "qwen2.5-0.5b"
        shape = SHAPES[name]
    return Inputs(
        memory_mib=int(memory),
        gpus=args.gpus,
        shape=shape,
        prompt_length=args.prompt_length,
        response_length=args.response_length,
        compute_dtype=prof["compute_dtype"],
        rollout=prof["rollout"],
        device=device,
        critic=args.critic,
        ref=args.ref,
        rollout_n=args.rollout_n,
        headroom_mib=args.headroom_mib,
        target_train_batch=args.target_train_batch,
        max_offload=args.max_offload,
        ppo_mini_batches=args.ppo_mini_batches,
        model_name=name,
        profile_name=prof["name"],
    )


def run(args: argparse.Namespace) -> Result:
    inp = inputs_from_args(args)
    doc = payload(plan(inp))
    return Result(payload=doc, text=text(doc))


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "plan",
        parents=[common],
        help="batch sizes, micro batches, checkpointing and offload that fit the GPU",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    mem = parser.add_argument_group("memory")
    mem.add_argument("--gpu-mib", type=int, metavar="N", help="one GPU's memory (default: detect)")
    mem.add_argument("--host-mib", type=int, metavar="N", help="host memory budget (cpu profile)")
    mem.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs per node (default 1)")
    mem.add_argument(
        "--headroom-mib",
        type=int,
        metavar="N",
        help=f"keep the peak N MiB under the memory (default: min(memory - {CAP_MARGIN_MIB}, "
        f"{CAP_FRACTION} x memory))",
    )
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", metavar="DIR", help="a model directory with config.json")
    model.add_argument(
        "--model-shape", choices=sorted(SHAPES), help="a built-in shape (default qwen2.5-0.5b)"
    )
    parser.add_argument("--prompt-length", type=int, default=512, metavar="N")
    parser.add_argument("--response-length", type=int, default=256, metavar="N")
    prof = parser.add_mutually_exclusive_group()
    prof.add_argument("--profile", metavar="NAME", help="a profile name: pascal, pascal-6.1, cpu")
    prof.add_argument("--arch", choices=sorted(profile.PROFILES))
    prof.add_argument("--cc", metavar="X.Y")
    parser.add_argument(
        "--critic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a critic (GAE needs one; GRPO does not)",
    )
    parser.add_argument(
        "--ref",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a reference model (KL loss or KL in reward)",
    )
    parser.add_argument("--rollout-n", type=int, default=1, metavar="N", help="responses/prompt")
    parser.add_argument("--target-train-batch", type=int, metavar="N")
    parser.add_argument(
        "--max-offload",
        choices=tuple(_MAX_OFFLOAD),
        default="all",
        help="the most offload the plan may use (default all)",
    )
    parser.add_argument(
        "--ppo-mini-batches",
        type=int,
        default=PPO_MINI_BATCHES,
        metavar="K",
        help=f"optimizer steps per PPO step to aim for (default {PPO_MINI_BATCHES})",
    )
    detect.add_source_args(parser)
    parser.set_defaults(func=run)
