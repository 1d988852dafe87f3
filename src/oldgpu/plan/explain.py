"""What the plan says: verl's Hydra overrides, the reason behind each, notes, the JSON
document and its text rendering."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

from oldgpu.plan import memory, recipes
from oldgpu.plan.inputs import Choice, Inputs
from oldgpu.plan.memory import (
    AUTOCAST_FP32_LOGITS_COPIES,
    LOGITS_TRAIN_COPIES,
    VLLM_CUDA_GRAPH_MIB,
    PhaseEstimate,
    estimate_phase,
    generate_kv,
    param_offload_frees,
    per_gpu_batch,
    reserve_factor,
    vllm_settings,
)
from oldgpu.plan.model import SHAPES
from oldgpu.plan.search import (
    LOG_PROB_MICRO_BATCHES,
    MAX_TRAIN_BATCH,
    MICRO_BATCHES,
    Largest,
    Plan,
    batch_candidates,
    cap_mib,
    offload_levels,
)
from oldgpu.plan.spelling import NO_REF, setting, switch
from oldgpu.plan.spelling import name as spell

# verl 0.5.0 loads the actor at this dtype (fsdp_workers.py) and FSDP's MixedPrecision
# (param_dtype fp32, the profile's) upcasts a unit at a time: a LoRA base at 16 bits.
BASE_DTYPE_KEY = "+actor_rollout_ref.actor.fsdp_config.model_dtype"


# The offload reasons describe verl 0.5.0's workers, where they were measured; a newer
# release's plan counts them the same and says so rather than pass them off as its own.
NOT_MEASURED_APART = " (counted the same for this release's FSDP engine: not measured apart)"


def _b(value: bool) -> str:
    return "True" if value else "False"


def hydra_overrides(inp: Inputs, choice: Choice, phases: Mapping[str, PhaseEstimate]) -> list[str]:
    """verl 0.5.0 keys, all present in its ppo_trainer config (no ``+``; a test composes
    them), but BASE_DTYPE_KEY for a 16-bit base."""
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
    out += recipe_overrides(inp)
    if inp.base16:  # the one key 0.5.0's config lacks (verl reads it with .get)
        out.append(f"{BASE_DTYPE_KEY}={inp.base_dtype}")
    if inp.rollout == "vllm":  # never for the HF rollout: these settings are vLLM's
        vllm = vllm_settings(inp, choice.train_batch_size, phases["generate"])
        out += [
            f"actor_rollout_ref.rollout.gpu_memory_utilization={vllm['gpu_memory_utilization']}",
            f"actor_rollout_ref.rollout.max_num_seqs={vllm['max_num_seqs']}",
            f"actor_rollout_ref.rollout.max_num_batched_tokens={vllm['max_num_batched_tokens']}",
            f"actor_rollout_ref.rollout.enforce_eager={_b(vllm['enforce_eager'])}",
        ]
    if inp.rollout_server:
        # The in-process server generates the GPU's whole rollout batch in one pass, within
        # the token budget the generate phase leaves room for.
        gen = phases["generate"]
        tokens = memory.rollout_tokens(inp, gen, choice.train_batch_size, cap_mib(inp))
        out += [
            f"actor_rollout_ref.rollout.max_num_seqs={per_gpu_batch(inp, choice.train_batch_size)}",
            f"{memory.SERVER_TOKENS_KEY}={tokens}",
        ]
    if inp.device == "cuda":
        out.append(f"trainer.n_gpus_per_node={inp.gpus}")
    return out


def recipe_overrides(inp: Inputs) -> list[str]:
    """The recipe's keys the memory depends on: the estimator (when given) and LoRA."""
    out = []
    if inp.algorithm is not None:
        out.append(f"algorithm.adv_estimator={inp.algorithm}")
    if inp.lora:
        modules = recipes.target_modules_value(inp.lora_target_modules)
        out += [
            f"actor_rollout_ref.model.lora_rank={inp.lora_rank}",
            f"actor_rollout_ref.model.lora_alpha={inp.lora_alpha_value}",
            f"actor_rollout_ref.model.target_modules={modules}",
        ]
    return out


def _recipe_reasons(found: Plan) -> dict[str, str]:
    inp = found.inputs
    r: dict[str, str] = {}
    if inp.algorithm is not None:
        r["algorithm.adv_estimator"] = (
            f"the input; verl builds {'a' if inp.critic else 'no'} critic for it"
            + ("" if inp.critic else ": no critic weights, gradients, Adam or phases")
        )
    if inp.lora:
        upd = found.phases["actor_update"]
        r["actor_rollout_ref.model.lora_rank"] = (
            f"the input: {inp.adapter_params / 1e6:.1f}M adapter parameters train "
            f"(gradients {upd.resident.get('actor_grads', 0):.0f} MiB, Adam "
            f"{upd.resident.get('actor_adam', 0):.0f} MiB); the {inp.shape.params() / 1e6:.0f}M "
            f"base weights stay frozen ({inp.base_dtype if inp.base16 else 'fp32'}, computed "
            f"in {inp.compute_dtype}), and the ref is the actor without its adapters"
        )
        r["actor_rollout_ref.model.lora_alpha"] = (
            "the input"
            if inp.lora_alpha
            else f"twice the rank (no {spell(inp.interface, 'lora_alpha')})"
        )
        r["actor_rollout_ref.model.target_modules"] = (
            "the input" if inp.lora_target_modules else "every linear layer of the decoder"
        )
        upd = found.phases["actor_update"]
        r[BASE_DTYPE_KEY] = (  # its override exists only for a 16-bit base
            f"the frozen base stored at {inp.base_dtype} "
            f"({upd.resident.get('actor_weights', 0):.0f} MiB), "
            f"computed in {inp.compute_dtype}: FSDP upcasts a unit at a time "
            f"({upd.resident.get('actor_fp32_units', 0):.0f} MiB at once); "
            + ("the input" if not inp.base_auto else "the fp32 base does not fit")
        )
    return r


def _reasons(found: Plan) -> dict[str, str]:
    """One line per choice with the numbers behind it, keyed by the override's key."""
    inp, c, ph = found.inputs, found.choice, found.phases
    cap = cap_mib(inp)

    def peak(phase: str, **change: Any) -> float:
        return estimate_phase(inp, replace(c, **change), phase).peak

    def item(est: PhaseEstimate, moment: str, key: str) -> float:
        return est.moments.get(moment, {}).get(key, 0.0)

    gen = ph["generate"]
    kv, rows = generate_kv(inp, gen, c.train_batch_size)
    r: dict[str, str] = {}
    held = f"{rows} x {inp.seq} tokens per GPU"
    batch_line = (
        f"generate {gen.peak:.0f} MiB of the {cap} MiB cap (KV cache {kv:.0f} MiB for {held})"
    )
    cands = batch_candidates(replace(inp, target_train_batch=None))
    nxt = next((b for b in cands if b > c.train_batch_size), None)
    if inp.target_train_batch:
        given = spell(inp.interface, "target_train_batch")
        r["data.train_batch_size"] = f"the {given}; {batch_line}"
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
    fp32_logits = item(upd, "backward", "fp32_response_logits")
    autocast = (
        f", autocast's fp32 response logits {fp32_logits:.0f} = "
        f"{AUTOCAST_FP32_LOGITS_COPIES:g} x {c.actor_micro} x {inp.response_length} x "
        f"{inp.shape.vocab_size} x 4 B"
        if fp32_logits
        else ""
    )
    # the positions the model computes logits for: the response's + 1 (response-logits)
    positions = inp.response_length + 1 if memory.RESPONSE_LOGITS and inp.logits_patch else inp.seq
    r["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] = (
        f"the largest that fits: actor_update {upd.peak:.0f} MiB at its {upd.peak_moment} "
        f"(backward: activations {item(upd, 'backward', 'activations'):.0f}, logits "
        f"{item(upd, 'backward', 'logits'):.0f} = {LOGITS_TRAIN_COPIES:g} x {c.actor_micro} x "
        f"{positions} x {inp.shape.vocab_size} x {inp.precision.compute} B{autocast}){more}"
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
    if inp.ref and inp.lora:
        rlp = ph["ref_log_prob"]
        r["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"] = (
            f"as the rollout's, which verl uses for it with LoRA (the actor without its "
            f"adapters, no ref copy): ref_log_prob {rlp.peak:.0f} MiB (logits "
            f"{item(rlp, 'logits', 'logits'):.0f})"
        )
    elif inp.ref:
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
        if inp.rollout_server:
            note += NOT_MEASURED_APART
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
        if inp.rollout_server:
            r["actor_rollout_ref.ref.fsdp_config.param_offload"] += NOT_MEASURED_APART
        if inp.lora:
            r["actor_rollout_ref.ref.fsdp_config.param_offload"] = (
                "follows the actor's; with LoRA verl builds no ref model, so it changes nothing"
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
        r["actor_rollout_ref.rollout.max_num_seqs"] = (
            "the GPU's whole rollout batch (train batch x rollout.n / GPUs) at once"
        )
        r["actor_rollout_ref.rollout.max_num_batched_tokens"] = (
            "at least one whole prompt + response (vLLM refuses less), verl's 8192 otherwise"
        )
        r["actor_rollout_ref.rollout.enforce_eager"] = (
            "CUDA graphs are captured outside vLLM's share: eager unless "
            f"{VLLM_CUDA_GRAPH_MIB} MiB are free beside the generate phase"
        )
    if inp.rollout_server:
        tokens = memory.rollout_tokens(inp, gen, c.train_batch_size, cap)
        r["actor_rollout_ref.rollout.max_num_seqs"] = (
            "the GPU's whole rollout batch (train batch x rollout.n / GPUs) in one pass: the "
            "server generates in the trainer's process, from its weights"
        )
        r[memory.SERVER_TOKENS_KEY] = (
            f"the server's batch token budget: {rows} sequences x {inp.seq} tokens, within "
            f"the KV cache the generate phase counts ({kv:.0f} MiB; {tokens} tokens)"
        )
    r["trainer.n_gpus_per_node"] = f"{inp.gpus}: verl divides the batch sizes by it"
    r.update(_recipe_reasons(found))
    return r


def _notes(found: Plan) -> list[str]:
    inp = found.inputs
    notes = [
        "estimates are peak reserved memory as a GPU without memory pressure shows it "
        f"(reserved = {reserve_factor(inp)} x allocated"
        + (", the frozen LoRA base as allocated" if inp.lora and inp.device == "cuda" else "")
        + ") plus the context; under "
        "pressure the allocator frees its cached blocks before failing, so runs near the "
        "cap usually need less than estimated",
    ]
    if inp.ref:
        notes.append(
            "verl builds the ref only with actor_rollout_ref.actor.use_kl_loss=True or "
            "algorithm.use_kl_in_reward=True; without either, plan with "
            + switch(inp.interface, NO_REF)
        )
    if inp.algorithm is not None:
        notes += _recipe_notes(inp)
    elif inp.critic:
        notes.append("verl uses the critic only with algorithm.adv_estimator=gae (its default)")
    else:
        notes.append("no critic: set an estimator without one (e.g. algorithm.adv_estimator=grpo)")
    if inp.lora:
        notes.append(
            "LoRA: the ref log-prob is the actor with its adapters disabled (no ref copy); "
            "under the HF rollout verl 0.5.0 needs oldgpu patch's hf-rollout-lora-wrap"
        )
    if inp.rollout == "vllm":
        notes.append("vLLM's share is modelled, not measured (the measurements are HF rollout)")
    if inp.device == "cuda" and inp.gpus > 1:
        notes.append(
            "several GPUs: sharding and offload follow FSDP's design; only one GPU was measured"
        )
    return notes


def _recipe_notes(inp: Inputs) -> list[str]:
    notes = []
    if inp.critic:
        notes.append(f"algorithm.adv_estimator={inp.algorithm}: verl trains a critic")
    elif inp.ref:
        notes.append(
            f"algorithm.adv_estimator={inp.algorithm}: no critic; the ref is counted for the "
            "KL loss (actor_rollout_ref.actor.use_kl_loss=True), as verl's examples set it"
        )
    else:
        notes.append(
            f"algorithm.adv_estimator={inp.algorithm}: no critic, and no ref (no KL: "
            "actor_rollout_ref.actor.use_kl_loss=False, algorithm.use_kl_in_reward=False)"
        )
    if inp.algorithm in recipes.GROUP_ESTIMATORS and inp.rollout_n < 2:
        notes.append(
            f"{inp.algorithm} compares the responses to one prompt: with rollout.n 1 "
            f"verl falls back to a zero baseline; use {setting(inp.interface, 'rollout_n', 2)} "
            "or more"
        )
    return notes


def _recipe_inputs(inp: Inputs) -> dict[str, Any]:
    """The recipe's inputs, present only when given (plans without them stay as they were)."""
    out: dict[str, Any] = {}
    if inp.algorithm is not None:
        out["algorithm"] = inp.algorithm
    if inp.lora:
        out["lora"] = {
            "rank": inp.lora_rank,
            "alpha": inp.lora_alpha_value,
            "target_modules": list(inp.lora_target_modules) or [recipes.ALL_LINEAR],
            "base_dtype": inp.base_dtype,
        }
    return out


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
            **_recipe_inputs(inp),
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
            **(
                {"adapter_params": inp.adapter_params, "trained_params": inp.trained_params}
                if inp.lora
                else {}
            ),
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
            # every process on one GPU, with its context: what the guard caps card-wide
            "card": {
                "processes": memory.card_processes(inp, found.phases),
                "usable_mib": memory.card_usable_mib(inp),
            },
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


def recipe_label(inp: Inputs) -> str:
    """A short name for the recipe: the estimator, responses per prompt, LoRA."""
    name = inp.algorithm or ("gae" if inp.critic else "no critic")
    if inp.rollout_n > 1:
        name += f", rollout.n {inp.rollout_n}"
    if inp.lora:
        name += f", LoRA r{inp.lora_rank}"
    return name


def largest_payload(result: Largest) -> dict[str, Any]:
    """``oldgpu plan --largest``: each shape of the family with whether and how it fits,
    and the plan of the largest that does."""
    inp = result.inputs
    best = result.best
    shapes = []
    for name, found in result.tried:
        row: dict[str, Any] = {"model": name, "params": SHAPES[name].params(), "fits": bool(found)}
        if found:
            c = found.choice
            row.update(
                train_batch_size=c.train_batch_size,
                sequences_per_step=c.train_batch_size * inp.rollout_n,
                peak_mib=round(found.peak),
                peak_phase=found.peak_phase,
                offload=c.offload_level,
                base_dtype=found.inputs.base_dtype if found.inputs.lora else None,
            )
        shapes.append(row)
    return {
        "query": "largest",
        "family": result.family,
        "recipe": recipe_label(inp),
        "memory_mib": inp.memory_mib,
        "cap_mib": cap_mib(inp),
        "gpus": inp.gpus,
        "profile": inp.profile_name,
        "prompt_length": inp.prompt_length,
        "response_length": inp.response_length,
        "largest": best[0] if best else None,
        "shapes": shapes,
        "plan": payload(best[1]) if best else None,
    }


def largest_text(doc: Mapping[str, Any]) -> str:
    best = next((r for r in doc["shapes"] if r["model"] == doc["largest"]), None)
    answer = "none"
    if best:
        answer = (
            f"{best['model']} (batch {best['train_batch_size']}, {best['sequences_per_step']} "
            f"sequences, peak {best['peak_mib']} MiB in {best['peak_phase']})"
        )
    lines = [
        f"largest {doc['family']} for {doc['recipe']} on {doc['gpus']} x {doc['memory_mib']} "
        f"MiB ({doc['profile']}), prompt {doc['prompt_length']} + response "
        f"{doc['response_length']}, cap {doc['cap_mib']} MiB: {answer}"
    ]
    for row in doc["shapes"]:
        head = f"  {row['model']:<14} {row['params'] / 1e9:5.2f}B  "
        if row["fits"]:
            lines.append(
                head + f"fits: batch {row['train_batch_size']} ({row['sequences_per_step']} "
                f"sequences), peak {row['peak_mib']} MiB in {row['peak_phase']}, offload "
                f"'{row['offload']}'"
                + (f", base {row['base_dtype']}" if row.get("base_dtype") else "")
            )
        else:
            lines.append(head + "does not fit")
    if doc["plan"]:
        lines += ["", text(doc["plan"])]
    return "\n".join(lines)
