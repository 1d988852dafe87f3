"""The memory model: each phase's peak per GPU, in MiB (docs/planner.md has it with the
measurements).

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
  unsharded for generate, log-prob and update; the critic and the ref are
  wrapped per layer (root unit: the embeddings), so FULL_SHARD gathers a unit
  at a time (``unit_params``).
* the recipe (recipes.py has the why): a critic-free estimator drops the
  critic; ``rollout.n`` multiplies the sequences per GPU (``per_gpu_batch``);
  LoRA keeps the frozen base weights and the base model's activations, trains
  the adapters only (gradients, Adam, its step temporary, the flat gradient
  copies: ``Inputs.trained_params``), freezes the embedding (no embedding
  gradient), wraps the actor per layer, and runs the ref log-prob on the actor
  with its adapters disabled (no ref weights, no ref reload).
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

A new memory term goes into ``estimate_phase`` (resident state, a moment of a phase, or
the common rollout tensors), with its constant and the measurement behind it below.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oldgpu.plan import recipes
from oldgpu.plan.inputs import Choice, Inputs
from oldgpu.plan.model import ModelShape

MIB = 1024 * 1024

# -- the calibrated constants: one place, tunable -----------------------------------------
# The GPU-proof issue adjusts these to measured peaks; docs/planner.md gives the
# measurement behind each ("measured" = the H200 replication of verl's memory path).

# Outside torch's allocator: the CUDA context with cuBLAS/cuDNN handles; on the cpu
# device, Python, torch, Ray and verl in the worker process (a guess).
CUDA_CONTEXT_MIB = 500
HOST_PROCESS_MIB = 1024
# Reserved / allocated at the peak. Fitted to the two measured verl runs (17.75/12.95 =
# 1.37, 33.65/22.35 = 1.51); the replication gave 1.47 and 1.52. The cpu figure is a guess.
RESERVE_FACTOR = {"cuda": 1.44, "cpu": 1.2}
# fp16 autocast on CUDA (the volta/turing path) fragments less: its extra tensors are
# short-lived casts and fp32 logits copies of the few sizes a micro batch has. Three fp16
# runs reserved 1.324-1.329 x what they allocated (H200, volta guard; calls 6, 7, 10 of
# bench/results/2026-12-03-h200); 1.38 keeps a margin of 4% above the largest.
AUTOCAST_RESERVE_FACTOR = 1.38


# LoRA on CUDA: the frozen base is allocated once and reserved as it is (PhaseEstimate's
# ``frozen``); this factor is for the rest (adapters, their gradients and Adam, the
# activations, logits and KV cache). Three GRPO + LoRA runs under the P40 guard reserved
# 17.58, 17.47 and 16.00 GiB (0.5B, 1.5B, 3B shapes) where the planner allocated 14.49,
# 14.89 and 14.85 GiB, of them 1.84, 5.74 and 11.50 GiB fp32 base: the rest reserved
# 1.244, 1.282 and 1.343 x its planned size (the measured reserved / allocated of the whole
# was 1.06-1.08; the planner's allocation was short for the two smaller ones). 1.37 covers
# the worst with a margin of 2% (bench/results/2026-12-03-h200 calls 3-4,
# 2026-12-06-h100 call 4; docs/planner.md).
LORA_RESERVE_FACTOR = 1.37


def reserve_factor(inp: Inputs) -> float:
    """Reserved / allocated at the peak for the run's device and compute dtype."""
    if inp.device == "cuda" and inp.compute_dtype == "fp16":
        return AUTOCAST_RESERVE_FACTOR
    if inp.device == "cuda" and inp.lora:
        return LORA_RESERVE_FACTOR
    return RESERVE_FACTOR[inp.device]


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
# fp16 (the volta/turing path) is autocast over FSDP's fp32 weights, and autocast runs
# softmax, log_softmax and logsumexp in fp32. The actor's update (entropy_coeff 0: no
# entropy) keeps verl's row-wise log_softmax outputs for the backward: one fp32 copy of
# the response logits, micro x response x vocab x 4 bytes, beside the fp16 logits.
AUTOCAST_FP32_LOGITS_COPIES = 1.0
# Its log-prob phase computes the entropy (softmax, logsumexp, their product) on fp16
# logits: the softmax's fp32 output, logsumexp's fp32 copy of its input and the
# exp temporary are alive at once, 3 fp32 copies of the response logits (fp32 needs 2,
# measured exactly: LOGITS_ENTROPY_RESPONSE_COPIES); the ref's row-wise log_softmax, a
# row's fp32 copy and output. And autocast caches no weight casts under FSDP1 (its
# module's weights are views of the flat parameter; autocast caches leaves only): no
# fp16 copy of the weights outside generation. Measured (H200 under the volta guard,
# bench/results/2026-12-03-h200/call6, 7, 10): 22.22-22.23 GiB allocated at log-prob
# micro 16 whatever the batch (128, 256) and the update's micro (4, 8), and 18.47 in the
# first step, before the actor's Adam state (3.68 GiB) exists: the log-prob phase
# (22.17 and 18.49 with these terms), not the update, sets the fp16 peak.
AUTOCAST_LOGPROB_FP32_RESPONSE_COPIES = 3.0
# The logits patch set's entropy-by-rows (every profile) computes the log-prob phase's
# entropy this many tokens at a time (compat_logits.ENTROPY_ROWS; a test keeps the two
# equal), so its copies are of a chunk, not of the micro batch's responses: fp16's 3 fp32
# copies above, fp32's 2 (the softmax and its product). None: verl's own entropy (the
# runs measured before the patch).
ENTROPY_ROWS: int | None = 256
# The logits patch set's response-logits (every profile): the actor's and ref's model
# calls compute the logits of the last response + 1 positions only (HF's logits_to_keep),
# not of the whole sequence, and the log-probs go ENTROPY_ROWS tokens at a time with the
# softmax recomputed in the backward: the update keeps no fp32 copy of the response
# logits (AUTOCAST_FP32_LOGITS_COPIES) but a chunk's fp32 copy and its exp, 2 x rows, and
# LOGITS_TRAIN_COPIES counts response + 1 positions. False: verl's own (the runs measured
# before the patch).
RESPONSE_LOGITS = True
LOGPROB_CHUNK_COPIES = 2.0
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
# vLLM's CUDA graphs are captured after its KV cache, outside its share: about this
# much per GPU for the batch sizes it captures (vLLM logs 0.5-1.5 GiB for small
# models). Without that much free beside the generate phase, eager mode.
VLLM_CUDA_GRAPH_MIB = 1536
# verl's default max_num_batched_tokens; raised to a whole sequence when longer.
VLLM_BATCHED_TOKENS = 8192
# A newer release's rollout server (0.9.0's oldgpu-hf) generates in the trainer's process
# from the trainer's own parameters: one copy of the weights, one CUDA context, so the
# generate phase is counted as 0.5.0's HF rollout (the KV cache and sampling of the GPU's
# rollout batch). The plan gives the server that batch in one pass (max_num_seqs) and a
# token budget (``rollout_tokens``) under the engine key below.
SERVER_TOKENS_KEY = "+actor_rollout_ref.rollout.engine_kwargs.oldgpu_hf.max_batch_tokens"
# What a card keeps from its processes: the driver's and ECC's share. The card-wide sum of
# a job's processes on one GPU (each one's peak with its CUDA context) must stay within the
# card's memory less this: a P40's 24 GiB -> 22.5 GiB, the guard's card-wide cap
# (guard/policy.py's DEFAULT_MEMORY_MIB; a test keeps the two equal).
CARD_RESERVED_MIB = 1536

PHASES = (
    "generate",
    "actor_log_prob",
    "ref_log_prob",
    "critic_values",
    "critic_update",
    "actor_update",
)


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
    # Of ``resident``, what is allocated once and never freed (a LoRA actor's frozen base):
    # the allocator reserves it as it is, so the factor applies to the rest only.
    frozen: float = 0.0

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
        return self.frozen + self.reserve_factor * (self.allocated - self.frozen)

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


def _layer_train_elems(s: ModelShape, checkpointing: bool, adapters: int = 0) -> float:
    """Elements per token held for the backward, all layers (``adapters``: what LoRA
    adds per layer, ``recipes.adapter_act_elems``)."""
    layer = ACT_H * s.hidden_size + ACT_I * s.intermediate_size + adapters
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


def generate_kv(inp: Inputs, phase: PhaseEstimate, train_batch: int) -> tuple[float, int]:
    """The generate phase's KV cache in MiB at the end of decoding, and the sequences it
    holds at once: the GPU's whole rollout batch (HF generate, vLLM, the in-process server)."""
    decode = phase.moments.get("decode", {})
    return decode.get("kv_cache", 0.0), per_gpu_batch(inp, train_batch)


def kv_token_mib(inp: Inputs) -> float:
    """One token's KV cache over all layers (one layer's doubled, as DynamicCache grows)."""
    s = inp.shape
    layers = s.num_hidden_layers
    per_token = 2 * layers * s.num_key_value_heads * s.dim * inp.precision.compute
    return _mib(per_token * (1 + 1 / layers))


def rollout_tokens(inp: Inputs, phase: PhaseEstimate, train_batch: int, cap: int) -> int:
    """The rollout server's batch token budget: the GPU's rollout batch x (prompt +
    response), bounded by the KV cache the cap leaves room for in the generate phase."""
    want = per_gpu_batch(inp, train_batch) * inp.seq
    kv, _rows = generate_kv(inp, phase, train_batch)
    room = kv + (cap - phase.peak) / phase.reserve_factor
    return max(inp.seq, min(want, int(room / kv_token_mib(inp))))


def card_usable_mib(inp: Inputs) -> int:
    """What a job's processes on one GPU may hold together (``CARD_RESERVED_MIB``)."""
    return inp.memory_mib - CARD_RESERVED_MIB


def card_processes(inp: Inputs, phases: dict[str, PhaseEstimate]) -> list[dict[str, Any]]:
    """Every process the job puts on one GPU, with its peak (its CUDA context counted):
    verl's colocated worker (actor, ref, critic, and the rollout, 0.5.0's HF one or a
    newer release's server in the same process)."""
    worst = max(phases, key=lambda k: phases[k].peak)
    return [
        {
            "process": "trainer",
            "holds": "actor, ref, critic, rollout" if inp.critic else "actor, ref, rollout",
            "peak_mib": round(phases[worst].peak),
            "context_mib": round(phases[worst].context),
            "phase": worst,
        }
    ]


def param_offload_frees(inp: Inputs) -> bool:
    return inp.device == "cuda" and (inp.gpus > 1 or PARAM_OFFLOAD_FREES_ON_ONE_GPU)


def unit_params(s: ModelShape, per_layer_extra: int = 0, lm_head: bool = True) -> int:
    """What FULL_SHARD holds unsharded at once in a model wrapped per decoder layer: the
    root unit (the embeddings, an untied lm_head; FSDP1 keeps the root gathered through
    the whole pass) and two layers (the one computing and the one prefetched). verl
    wraps so the critic, the ref (its own worker, role "ref", keeps the wrap policy the
    HF rollout drops for the actor) and, with LoRA, the actor (recipes.py)."""
    untied = lm_head and not s.tie_word_embeddings
    root = s.embedding_params() * (2 if untied else 1)
    return root + 2 * (s.layer_params() + per_layer_extra)


# A base stored at 16 bits: bf16 or fp16, 2 bytes a weight.
BASE16_BYTES = 2


def base_weight_bytes(inp: Inputs) -> float:
    """The model's own weights: at master precision, or a LoRA base stored at 16 bits, whose
    tied embeddings get a second (frozen) copy for the lm_head (compat_base16.py)."""
    s = inp.shape
    if not inp.base16:
        return s.params() * inp.precision.master
    untied = s.embedding_params() if s.tie_word_embeddings else 0
    return (s.params() + untied) * BASE16_BYTES


def base16_units(s: ModelShape) -> int:
    """The weights a 16-bit base holds upcast at once: two decoder layers (the one
    computing, the one prefetched), or its embeddings' unit or an untied lm_head's."""
    return max(2 * s.layer_params(), s.embedding_params())


def estimate_phase(inp: Inputs, choice: Choice, phase: str) -> PhaseEstimate:
    """Memory of one phase of one PPO step, per GPU, in MiB."""
    if (phase.startswith("critic") and not inp.critic) or (phase == "ref_log_prob" and not inp.ref):
        return _ABSENT  # the role is absent
    s, p, n = inp.shape, inp.precision, inp.gpus
    off = choice.offload
    cuda = inp.device == "cuda"
    frees = param_offload_frees(inp)
    # pa: the actor's weights (with LoRA: frozen base + adapters); pt: what it trains
    # (LoRA: the adapters only, so gradients, Adam and its step temporary shrink).
    lora = inp.lora
    pa, pt, pc = inp.actor_params, inp.trained_params, s.critic_params()
    seq, resp, vocab, cb = inp.seq, inp.response_length, s.vocab_size, p.compute
    embed = s.embedding_params()
    batch = per_gpu_batch(inp, choice.train_batch_size)
    lp_micro = min(choice.log_prob_micro, batch)
    a_micro = min(choice.actor_micro, batch)
    c_micro = min(choice.critic_micro, batch)
    mixed = p.compute != p.master
    autocast = inp.compute_dtype == "fp16"  # FSDP keeps fp32 weights; autocast casts
    # the actor's and ref's logits: every position, or (response-logits) the response's
    # + 1; their log-probs a row, or a 256-token chunk, at a time
    keep = RESPONSE_LOGITS and inp.logits_patch
    chunk = ENTROPY_ROWS if inp.logits_patch else None
    logit_positions = resp + 1 if keep else seq
    lp_rows = min(resp, chunk) if keep and chunk else resp

    # the entropy's rows at once: a chunk (entropy-by-rows), or the micro batch's responses
    def entropy_rows(micro: int) -> int:
        return min(micro * resp, chunk) if chunk else micro * resp

    # LoRA: the ref log-prob is the actor's forward with its adapters disabled (no ref copy)
    actor_phase = phase in ("generate", "actor_log_prob", "actor_update") or (
        lora and phase == "ref_log_prob"
    )
    critic_phase = phase in ("critic_values", "critic_update")

    res: dict[str, float] = {}
    # The actor's frozen (or, without LoRA, trained) weights and its adapters.
    base_bytes = base_weight_bytes(inp)
    actor_bytes = base_bytes + inp.adapter_params * p.master
    if actor_phase or not (off.actor_param and frees):
        res["actor_weights"] = _mib(actor_bytes / n)
    if phase == "actor_update" or not (off.actor_optimizer and cuda):
        res["actor_adam"] = _mib(pt * p.adam / n)
    if inp.critic:
        if critic_phase or not (off.critic_param and frees):
            res["critic_weights"] = _mib(pc * p.master / n)
        if phase == "critic_update" or not (off.critic_optimizer and cuda):
            res["critic_adam"] = _mib(pc * p.adam / n)
    if inp.ref and not lora and (n == 1 or not cuda):
        # On one GPU the CPUOffload-wrapped ref never leaves (NO_SHARD views).
        res["ref_weights"] = _mib(pa * p.ref)
    elif inp.ref and not lora and phase == "ref_log_prob":
        # Several GPUs: FSDP CPUOffload keeps the ref's shards on the host and gathers
        # one unit at a time on the GPU for its forward (the ref is wrapped per layer).
        res["ref_weights"] = _mib(unit_params(s) * p.ref)
    if actor_phase and (n > 1 or (mixed and (not autocast or phase == "generate"))):
        unshard = p.master if phase == "generate" else p.compute  # summon_full_params
        if lora:  # wrapped per layer: a unit at a time
            per_layer = recipes.adapter_layer_params(s, inp.lora_rank, inp.lora_target_modules)
            res["actor_unsharded_units"] = _mib(unit_params(s, per_layer) * unshard)
        else:  # the HF rollout's actor is ONE unit: all of it
            res["actor_unsharded_weights"] = _mib(pa * unshard)
    if actor_phase and inp.base16:
        # FSDP's MixedPrecision upcasts the unit computing (and the one prefetched in the
        # backward) to fp32 and frees it after: two layers, or the embeddings' or the
        # lm_head's own unit (verl_0_5_0/base16.py), whichever is larger.
        res["actor_fp32_units"] = _mib(base16_units(s) * cb)
    if critic_phase and (n > 1 or mixed):
        res["critic_unsharded_units"] = _mib(unit_params(s, lm_head=False) * cb)
    if phase == "actor_update":
        res["actor_grads"] = _mib(pt * p.grad / n)
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
            full = micro * logit_positions * vocab * cb
            entropy = phase == "actor_log_prob" or lora  # LoRA's ref pass computes it too
            if entropy and autocast:  # autocast's fp32 copies, or a row's log_softmax
                copies = AUTOCAST_LOGPROB_FP32_RESPONSE_COPIES
                extra = max(copies * entropy_rows(micro), 2 * lp_rows) * vocab * 4
            elif entropy:
                copies = LOGITS_ENTROPY_RESPONSE_COPIES
                extra = max(copies * entropy_rows(micro), 2 * lp_rows) * vocab * cb
            elif autocast or keep:  # a row's (a chunk's) log-probs: its fp32 copy and exp
                extra = 2 * lp_rows * vocab * 4
            else:
                extra = resp * vocab * cb
            moments["logits"] = {
                "logits": _mib(full + extra),
                "hidden_states": _mib(tokens * s.hidden_size * cb),
            }
    else:
        actor = phase == "actor_update"
        micro, params = (a_micro, pt) if actor else (c_micro, pc)
        tokens = micro * seq
        # LoRA still saves the base model's activations (gradients flow through the
        # frozen layers to the adapters), plus each adapter's r-sized intermediate.
        adapters = recipes.adapter_act_elems(s, inp.lora_rank, inp.lora_target_modules)
        elems = _layer_train_elems(s, choice.gradient_checkpointing, adapters if actor else 0)
        back = {
            "activations": _mib(
                tokens * elems * cb + micro * seq * seq * cb  # + the 4D mask sdpa keeps
            ),
        }
        if not (lora and actor):  # LoRA freezes the embedding: no gradient for it
            back["embedding_grad"] = _mib(EMBEDDING_GRAD_COPIES * embed * cb)
        if actor:
            back["logits"] = _mib(LOGITS_TRAIN_COPIES * micro * logit_positions * vocab * cb)
            if keep:  # a chunk's softmax, recomputed
                back["fp32_logits_chunk"] = _mib(LOGPROB_CHUNK_COPIES * lp_rows * vocab * 4)
            elif mixed:  # autocast's fp32 log_softmax outputs over the response
                back["fp32_response_logits"] = _mib(
                    AUTOCAST_FP32_LOGITS_COPIES * micro * resp * vocab * 4
                )
        moments["backward"] = back
        moments["optimizer_step"] = {
            "adam_sqrt_temp": _mib(ADAM_STEP_TEMP_COPIES * params * p.master / n)
        }
        reloaded = off.actor_param and cuda and not frees
        if phase == "actor_update" and not reloaded:
            moments["backward_end"] = {
                "flat_gradient_copies": _mib(ACTOR_GRAD_END_COPIES * pt * (cb if n > 1 else p.grad))
            }
    if cuda and not frees:
        # one GPU: reloading makes a second copy until the first forward (see RELOAD_COPIES)
        reload = 0.0
        if actor_phase and off.actor_param:
            reload = pa * p.master
        elif critic_phase and inp.critic and off.critic_param:
            reload = pc * p.master
        elif phase == "ref_log_prob" and not lora:
            reload = pa * p.ref
        if reload:
            moments["reload"] = {"reloaded_weights_copy": _mib(RELOAD_COPIES * reload)}
    context = CUDA_CONTEXT_MIB if cuda else HOST_PROCESS_MIB
    frozen = 0.0
    if lora and cuda and "actor_weights" in res:
        frozen = _mib(base_bytes / n)
    return PhaseEstimate(res, moments, common, context, reserve_factor(inp), frozen)


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


def vllm_settings(inp: Inputs, train_batch: int, phase: PhaseEstimate) -> dict[str, Any]:
    """vLLM's settings for the generate phase: its memory share, the sequences it runs
    at once (the GPU's whole rollout batch), the tokens a step may schedule (at least
    one whole prompt + response) and whether CUDA graphs fit beside the phase."""
    util = vllm_utilization(inp, phase)
    headroom = inp.memory_mib - phase.reserved - phase.context
    return {
        "gpu_memory_utilization": util,
        "max_num_seqs": per_gpu_batch(inp, train_batch),
        "max_num_batched_tokens": max(VLLM_BATCHED_TOKENS, inp.seq),
        "enforce_eager": headroom < VLLM_CUDA_GRAPH_MIB,
    }


def vllm_utilization(inp: Inputs, phase: PhaseEstimate) -> float:
    """The gpu_memory_utilization that gives vLLM its share of the generate phase."""
    pool = sum(phase.moments.get("decode", {}).values()) * phase.reserve_factor
    return min(VLLM_MAX_UTILIZATION, math.ceil(100 * pool / inp.memory_mib) / 100)
