"""What a benchmark run measured: verl's console step lines, the guard's log, the P40
projection, the summary table and the few files a device call returns.

bench/ppo_bench.py starts the runs; this module only reads what they left behind
(``RUN/{run.json,metrics.jsonl,guard.jsonl,train.log,result.json}``), so a summary can
be re-derived here, afterwards, from the ``bench.json`` files the device calls returned.
"""

from __future__ import annotations

import io
import json
import math
import re
import statistics
import tarfile
from pathlib import Path
from typing import Any

# The GPUs of the projection: peaks (the P40's at boost clock, the H200's fp32 without
# tensor cores, which the guard's TF32-off leaves it) and host links (the P40's PCIe 3.0
# x16 measured about 12 GB/s pinned; the H200 VM's link is an assumption). Achieved
# fractions of the peaks are assumptions too; the H200 run checks the model.
P40 = {"fp32_tflops": 11.76, "bandwidth_gbs": 347.0, "pcie_gbs": 12.0, "memory_mib": 24576}
# fp16_tflops: dense fp16 on tensor cores, what an fp16 run's matmuls get (the P40 has
# none: 1/64 rate, so no fp16 figure). V100 SXM2 32 GB: 15.7 fp32, 125 fp16 tensor.
H200 = {"fp32_tflops": 67.0, "fp16_tflops": 989.0, "bandwidth_gbs": 4800.0, "pcie_gbs": 25.0}
V100 = {
    "fp32_tflops": 15.7,
    "fp16_tflops": 125.0,
    "bandwidth_gbs": 900.0,
    "pcie_gbs": 12.0,
    "memory_mib": 32768,
}
FLOPS_EFFICIENCY = 0.7
BW_EFFICIENCY = 0.8
# The settings the summary compares every run with: the article's and the planner's.
BASELINES = ("a", "b")

# -- verl's console lines -------------------------------------------------------------

STEP_LINE = re.compile(r"step:(\d+) - (.*)$")
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf")


def parse_value(text: str) -> Any:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    m = re.fullmatch(r"[\w.]+\((.*)\)", text)  # np.float64(1.5), tensor(2.)
    if m:
        found = NUMBER.search(m.group(1))
        if found:
            return float(found.group(0))
    return text


def parse_step(line: str) -> dict[str, Any] | None:
    """verl's LocalLogger line ``step:N - key:value - ...`` (behind Ray's actor prefix)."""
    m = STEP_LINE.search(line)
    if not m:
        return None
    metrics: dict[str, Any] = {"step": int(m.group(1))}
    for item in m.group(2).split(" - "):
        key, sep, value = item.partition(":")
        if sep:
            metrics[key.strip()] = parse_value(value)
    return metrics


SCALER_KEYS = ("actor/grad_scale", "critic/grad_scale")
SKIPPED_KEYS = ("actor/skipped_steps", "critic/skipped_steps")


def scaler_text(m: dict[str, Any]) -> str:
    """The loss scaler's metrics of one step line (fp16 trees report them), or ''."""
    parts = [
        f"{key} {m[key]:g}"
        for key in (*SCALER_KEYS, *SKIPPED_KEYS)
        if isinstance(m.get(key), (int, float))
    ]
    return (", " + ", ".join(parts)) if parts else ""


def scaler_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The loss scale at the last step and the optimizer steps skipped on inf/nan: in
    all, and after step 2 (the scale settles in the first steps)."""

    def skipped(rows: list[dict[str, Any]]) -> float:
        return sum(s[k] for s in rows for k in SKIPPED_KEYS if isinstance(s.get(k), (int, float)))

    if not any(k in s for s in steps for k in SCALER_KEYS):
        return {}
    last = steps[-1]
    return {
        "grad_scale_last": {k: last.get(k) for k in SCALER_KEYS if k in last},
        "skipped_steps": skipped(steps),
        "skipped_after_step_2": skipped([s for s in steps if s["step"] > 2]),
    }


def overrides_of(argv: list[str]) -> dict[str, str]:
    """The Hydra overrides of verl's argv as key -> value (``+a.b=1`` -> ``a.b``)."""
    out = {}
    for item in argv:
        key, sep, value = item.partition("=")
        if sep and not key.startswith("-"):
            out[key.lstrip("~+")] = value
    return out


def uses_critic(values: dict[str, str]) -> bool:
    # verl 0.5.0 builds the critic for GAE only.
    return values.get("algorithm.adv_estimator", "gae") == "gae"


def ops_steps(argv: list[str]) -> int:
    """Optimizer steps of the first training step (actor, plus the critic's with GAE): the
    guard checks them op by op, and the later steps are timed without that cost. verl
    scales the mini batch by ``rollout.n`` itself, so GRPO's count is batch / mini too."""
    values = overrides_of(argv)
    batch = int(values.get("data.train_batch_size", 1))
    mini = int(values.get("actor_rollout_ref.actor.ppo_mini_batch_size", batch))
    steps = max(1, batch // mini)
    if uses_critic(values):
        steps += max(1, batch // int(values.get("critic.ppo_mini_batch_size", mini)))
    return steps


# -- one run's result -------------------------------------------------------------------


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return round(statistics.mean(values), 4) if values else None


def _slope(values: list[float]) -> float | None:
    """Least-squares slope of values over their index (the reward's trend per step)."""
    if len(values) < 3:
        return None
    xs = range(len(values))
    mx, my = statistics.mean(xs), statistics.mean(values)
    var = sum((x - mx) ** 2 for x in xs)
    return round(sum((x - mx) * (y - my) for x, y in zip(xs, values, strict=True)) / var, 5)


def guard_events(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"log": False}
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e["event"]] = kinds.get(e["event"], 0) + 1
    return {
        "log": True,
        "counts": kinds,
        "armed_pids": sorted({e["pid"] for e in events if e["event"] == "armed"}),
        "violations": [
            e for e in events if e["event"] in ("violation", "arm-failed", "card-arm-failed")
        ][:20],
        "install_failed": [e for e in events if e["event"] == "install-failed"][:5],
        "memory_cap": next((e["devices"] for e in events if e["event"] == "memory-cap"), None),
        "ignored": sorted({e.get("what", "") for e in events if e["event"] == "ignored"}),
        "memory_phases": memory_phases(events),
        # the card-wide ledger's peak (guard/card.py): every guarded process on the GPU with
        # its context, beside nvidia-smi's device-wide samples (device_used_peak_mib)
        "card_peak_mib": max(
            (
                d["peak_mib"]
                for e in events
                if e["event"] == "card-memory"
                for d in e["devices"].values()
            ),
            default=None,
        ),
    }


def memory_phases(events: list[dict[str, Any]]) -> dict[str, dict[str, float]] | None:
    """The guard's memory tracer (OLDGPU_GUARD_MEMORY_PHASES): each process's last
    running maxima, merged, MiB per "phase/step"; None when the run was not traced."""
    last: dict[int, dict[str, dict[str, float]]] = {}
    for e in events:
        if e["event"] == "memory-phases":
            last[e["pid"]] = e["peaks"]
    if not last:
        return None
    merged: dict[str, dict[str, float]] = {}
    for peaks in last.values():
        for key, v in peaks.items():
            m = merged.setdefault(key, {"allocated_mib": 0.0, "reserved_mib": 0.0})
            for k in m:
                m[k] = max(m[k], v[k])
    return dict(sorted(merged.items()))


def summarize(run: dict[str, Any], steps: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    timed = [s for s in steps if s["step"] >= 2] or steps

    def col(key: str, rows: list[dict[str, Any]] = timed) -> list[float]:
        return [s[key] for s in rows if isinstance(s.get(key), (int, float))]

    # verl 0.9.0 names the trainer's peaks per role (actor/perf/...)
    peak_alloc = col("perf/max_memory_allocated_gb", steps) or col(
        "actor/perf/max_memory_allocated_gb", steps
    )
    peak_res = col("perf/max_memory_reserved_gb", steps) or col(
        "actor/perf/max_memory_reserved_gb", steps
    )
    scores = col("critic/score/mean", steps)
    plan = (run.get("composed") or {}).get("plan") or {}
    environment = (run.get("composed") or {}).get("environment") or {}
    result = {
        "setting": run["setting"],
        "scale": run["scale"],
        "attn_implementation": environment.get("OLDGPU_ATTN_IMPLEMENTATION"),
        "steps_requested": run["steps"],
        "steps_done": len(steps),
        "steps_timed": [s["step"] for s in timed],
        "tokens_per_s": _mean(col("perf/throughput")),
        "s_per_step": _mean(col("timing_s/step")),
        "gen_s": _mean(col("timing_s/gen")),
        "update_actor_s": _mean(col("timing_s/update_actor")),
        "update_critic_s": _mean(col("timing_s/update_critic")),
        "tokens_per_step": _mean(col("perf/total_num_tokens")),
        "response_length_mean": _mean(col("response_length/mean")),
        "peak_allocated_gb": max(peak_alloc) if peak_alloc else None,
        "peak_reserved_gb": max(peak_res) if peak_res else None,
        "score_first": scores[0] if scores else None,
        "score_last": scores[-1] if scores else None,
        "score_first5": _mean(scores[:5]),
        "score_last5": _mean(scores[-5:]),
        "score_slope_per_step": _slope(scores),
        "guard": guard_events(out / "guard.jsonl"),
        "planner": plan.get("choice"),
        "planner_peak_mib": (plan.get("estimate") or {}).get("peak_mib"),
        "compute_dtype": environment.get("OLDGPU_COMPUTE_DTYPE"),
        **scaler_summary(steps),
    }
    g = result["guard"]
    result["guard_ok"] = bool(
        g.get("log")
        and g.get("armed_pids")
        and not g.get("violations")
        and not g.get("install_failed")
    )
    if run["setting"].startswith("learn") and len(scores) >= 10:
        # It learned: the last 5 steps' mean reward clearly above the first 5's, and a
        # rising trend over the whole run.
        result["learned"] = bool(
            result["score_last5"] - result["score_first5"] > 0.02
            and (result["score_slope_per_step"] or 0) > 0
        )
    if run["scale"] == "gpu" and run["kind"].startswith("bench"):
        result["projection"] = projections(run, result)
    return result


# -- the P40 projection ---------------------------------------------------------------


def lora_params(config: dict[str, Any], rank: int) -> int:
    """LoRA adapters on every linear layer of a Qwen2 block (``all-linear``): rank x
    (in + out) each for q, k, v, o, gate, up and down."""
    h, i = config["hidden_size"], config["intermediate_size"]
    dim = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * dim, config["num_key_value_heads"] * dim
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    return rank * per_layer * config["num_hidden_layers"]


UPCAST_BYTES = 6  # a 16-bit weight read, its fp32 copy written


def project(run: dict[str, Any], r: dict[str, Any], hw: dict[str, float]) -> dict[str, Any]:
    """A step time on GPU ``hw`` from the run's shape and composed command: a model, not
    a measurement.

    - generation, per decoding step: the weights (4 bytes x params; 2 in an fp16 run,
      whose HF rollout generates with an fp16 copy) and the KV cache of
      the batch's ``batch x rollout.n`` sequences read once at ``bandwidth x
      BW_EFFICIENCY``, or their 2 x params FLOPs at ``fp32 peak x FLOPS_EFFICIENCY``,
      whichever is longer; and never faster than the measured run's time per decoding
      step (HF generate is launch-bound, so the measuring host's per-token overhead is a
      floor for any GPU);
    - the other phases: 2 x params FLOPs per token per forward plus attention's 4 x
      layers x seq^2 x hidden per sequence, over the padded sequences, less the
      lm_head's 2 x vocab x hidden over the prompt's positions in the actor's and ref's
      forwards where the logits patch set computes the response's only; log-prob (actor),
      the ref's (with a KL term) and the critic's values (GAE) 1 forward each; the
      actor's update 3 (forward, input and weight gradients; 2 with LoRA, whose frozen
      weights get no gradient) plus 1 with gradient checkpointing; the critic's 3 + 1;
      AdamW memory-bound, 28 bytes per trained parameter (LoRA: the adapters only);
    - offload over PCIe: optimizer states (8 bytes per trained param) out and back per
      update; with param offload the weights (4 bytes/param) each way per phase;
    - a LoRA base stored at 16 bits: UPCAST_BYTES a weight more per decoding step, and
      per micro batch of every forward, backward and recompute (FSDP upcasts each unit).
    """
    config = run["assets"]["config"]
    params = run["assets"]["params"]
    values = overrides_of(run["argv"])
    batch = int(values.get("data.train_batch_size", 1))
    n = int(values.get("actor_rollout_ref.rollout.n", 1))
    seqs = batch * n
    mini = int(values.get("actor_rollout_ref.actor.ppo_mini_batch_size", batch))
    prompt = int(values.get("data.max_prompt_length", 256))
    response = int(values.get("data.max_response_length", 256))
    critic = uses_critic(values)
    ref = "True" in (
        values.get("actor_rollout_ref.actor.use_kl_loss"),
        values.get("algorithm.use_kl_in_reward"),
    )
    rank = int(values.get("actor_rollout_ref.model.lora_rank", 0) or 0)
    actor_ckpt = values.get("actor_rollout_ref.model.enable_gradient_checkpointing") == "True"
    critic_ckpt = values.get("critic.model.enable_gradient_checkpointing") == "True"
    trained = lora_params(config, rank) if rank > 0 else params
    seq = prompt + response
    # An fp16 run's matmuls run on the tensor cores; fp32 (and a card without) at fp32's.
    dtype = ((run.get("composed") or {}).get("environment") or {}).get("OLDGPU_COMPUTE_DTYPE")
    peak = hw.get("fp16_tflops") if dtype == "fp16" else None
    flops = (peak or hw["fp32_tflops"]) * 1e12 * FLOPS_EFFICIENCY
    bw = hw["bandwidth_gbs"] * 1e9 * BW_EFFICIENCY
    pcie = hw["pcie_gbs"] * 1e9
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    head_dim = hidden // config["num_attention_heads"]
    # Generation reads the weights and the KV cache once per decoding step: fp16 for an
    # fp16 run (the HF rollout's fp16 copy of the actor), fp32 otherwise.
    gen_bytes = 2 if dtype == "fp16" else 4
    kv_per_token = 2 * layers * config["num_key_value_heads"] * head_dim * gen_bytes
    kv_bytes = seqs * (prompt + response / 2) * kv_per_token  # the mean over decoding
    # A LoRA base stored at 16 bits (base_dtype): each forward upcasts it, reading 2 bytes
    # and writing 4 per weight before the fp32 matmul reads those 4 (UPCAST_BYTES more).
    base16 = values.get("actor_rollout_ref.actor.fsdp_config.model_dtype") in ("bf16", "fp16")
    upcast = UPCAST_BYTES * params / bw if base16 else 0.0
    weight_bytes = gen_bytes * params
    decode_step = max(weight_bytes / bw + upcast + kv_bytes / bw, 2 * params * seqs / flops)
    host_floor = (r.get("gen_s") or 0) / response
    gen = response * max(decode_step, host_floor)
    actor_forwards = 1 + int(ref) + (2 if rank > 0 else 3) + int(actor_ckpt)
    critic_forwards = 1 + 3 + int(critic_ckpt) if critic else 0
    forwards = actor_forwards + critic_forwards
    per_seq = 2 * params * seq + 4 * layers * seq * seq * hidden
    # The actor's and ref's lm_head: over the response + 1 positions where the run's tree
    # has the logits patch set (run["response_logits"], recorded since 2026-12-06),
    # over every position otherwise (verl's own; the critic's value head is small).
    head = 2 * min(config["vocab_size"] * hidden, params)
    positions = response + 1 if run.get("response_logits") else seq
    actor_per_seq = per_seq - head * (seq - positions)
    train = (actor_forwards * actor_per_seq + critic_forwards * per_seq) * seqs / flops
    if base16:  # one upcast per micro batch per forward, backward and recompute
        lp_micro = int(values.get("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", 1))
        a_micro = int(values.get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 1))
        passes = (1 + int(ref)) * -(-seqs // lp_micro) + (2 + int(actor_ckpt)) * -(-seqs // a_micro)
        train += passes * upcast
    updates = max(1, batch // mini)
    adam = updates * 28 * (trained + (params if critic else 0)) / bw
    offload = 0.0
    roles = [("actor_rollout_ref.actor.fsdp_config", 3, trained)]
    if critic:
        roles.append(("critic.model.fsdp_config", 2, params))
    for role, phases, optimized in roles:
        if values.get(f"{role}.optimizer_offload") == "True":
            offload += 2 * 8 * optimized / pcie
        if values.get(f"{role}.param_offload") == "True":
            offload += phases * 2 * 4 * params / pcie
    total = gen + train + adam + offload
    tokens = r.get("tokens_per_step") or seqs * seq
    return {
        "gen_s": round(gen, 2),
        "compute_s": round(train + adam, 2),
        "offload_s": round(offload, 2),
        "s_per_step": round(total, 2),
        "tokens_per_s": round(tokens / total, 1),
        "decode_step_ms": round(decode_step * 1e3, 2),
        "host_floor_ms": round(host_floor * 1e3, 2),
        "forwards_per_sequence": forwards,
        "trained_params": trained,
    }


def projections(run: dict[str, Any], r: dict[str, Any]) -> dict[str, Any] | None:
    """The same model for the H200 (checked against the measurement) and the P40 (the
    volta profile's runs: the V100, which they stand for)."""
    if r.get("s_per_step") is None:
        return None
    h200, p40 = project(run, r, H200), project(run, r, P40)
    environment = (run.get("composed") or {}).get("environment") or {}
    # A volta run is projected to a V100 (with its compute dtype), any other to a P40.
    volta = str((run.get("composed") or {}).get("profile", "")).startswith("volta")
    card, spec = ("v100", V100) if volta else ("p40", P40)
    target = project(run, r, spec) if volta else p40
    assumptions = {"flops_efficiency": FLOPS_EFFICIENCY, "bandwidth_efficiency": BW_EFFICIENCY}
    assumptions.update({"h200": H200, card: spec})
    if volta:
        assumptions["compute_dtype"] = environment.get("OLDGPU_COMPUTE_DTYPE")
    assumptions["params"] = run["assets"]["params"]
    return {
        "label": "projection (a model, not a measurement)",
        "assumptions": assumptions,
        "h200_model": h200,
        "h200_measured_over_model": round(r["s_per_step"] / h200["s_per_step"], 3),
        card: target,
        f"{card}_over_h200_model": round(target["s_per_step"] / h200["s_per_step"], 2),
    }


# -- the summary, the export, merging calls ---------------------------------------------


def _fmt(v: Any) -> str:
    return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


# fp16 against its fp32 baseline: (fp16 setting, fp32 setting), same batch.
FP16_PAIRS = (("fp16-volta", "fp32-volta"),)


def summary(out: Path) -> str:
    results = {}
    for path in sorted(out.glob("*/result.json")):
        r = json.loads(path.read_text())
        d = path.parent
        if (d / "run.json").exists() and (d / "metrics.jsonl").exists():  # re-derive
            steps = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
            r.update(summarize(json.loads((d / "run.json").read_text()), steps, d))
            path.write_text(json.dumps(r, indent=1))
        results[d.name] = r
    base = {name: results.get(name, {}).get("tokens_per_s") for name in BASELINES}
    lines = [
        "| setting | run | steps (timed) | tokens/s | s/step | gen s | peak alloc GB | "
        "peak reserved GB | planner peak GB | vs a | vs b | guard | "
        "P40 (volta runs: V100) projected s/step (tokens/s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        tps = r.get("tokens_per_s")
        ratios = [
            f"{tps / base[b]:.2f}x" if tps and base[b] and not name.startswith("learn") else "-"
            for b in BASELINES
        ]
        g = r.get("guard", {})
        guard = "ok" if r.get("guard_ok") else f"NOT ok ({len(g.get('violations', []))} viol.)"
        projection = r.get("projection") or {}
        proj = projection.get("p40")
        proj_s = f"{proj['s_per_step']} ({proj['tokens_per_s']})" if proj else "-"
        if projection.get("v100"):
            v = projection["v100"]
            proj_s = f"V100: {v['s_per_step']} ({v['tokens_per_s']})"
        planned = r.get("planner_peak_mib")
        planned_gb = round(planned / 1024, 2) if planned else None
        status = (
            "stopped at deadline"
            if r.get("timed_out")
            else ("ok" if r.get("rc") == 0 else f"failed (rc {r.get('rc')})")
        )
        timed = r["steps_timed"]
        span = f"{timed[0]}-{timed[-1]}" if len(timed) > 1 else ",".join(map(str, timed))
        lines.append(
            f"| {name} | {status} | {r['steps_done']} ({span}) | "
            f"{_fmt(tps)} | {_fmt(r.get('s_per_step'))} | {_fmt(r.get('gen_s'))} | "
            f"{_fmt(r.get('peak_allocated_gb'))} | {_fmt(r.get('peak_reserved_gb'))} | "
            f"{_fmt(planned_gb)} | {' | '.join(ratios)} | {guard} | {proj_s} |"
        )
        if name.startswith("learn") and r.get("score_first5") is not None:
            verdict = {True: "LEARNED", False: "NOT learned"}  # judged from 10 steps on
            lines.append(
                f"| {name} reward | {verdict.get(r.get('learned'), '-')} | "
                f"first 5 steps {_fmt(r.get('score_first5'))}, last 5 "
                f"{_fmt(r.get('score_last5'))}, slope {r.get('score_slope_per_step')}/step "
                "| | | | | | | | | | |"
            )
        if r.get("grad_scale_last"):
            scales = ", ".join(f"{k} {_fmt(v)}" for k, v in r["grad_scale_last"].items())
            lines.append(
                f"| {name} loss scale | {r.get('compute_dtype')} | last step: {scales}; "
                f"skipped steps {_fmt(r.get('skipped_steps'))} (after step 2: "
                f"{_fmt(r.get('skipped_after_step_2'))}) | | | | | | | | | | |"
            )
    for fast, slow in FP16_PAIRS:
        a, b = (results.get(n, {}).get("tokens_per_s") for n in (fast, slow))
        if a and b:
            lines.append(f"\n{fast} / {slow} tokens/s: {a / b:.2f}x ({a:.1f} / {b:.1f})")
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    return text


def export(runs: Path, dest: Path, setup: Path | None = None) -> list[Path]:
    """At most a handful of files for the device tool's $OUT (it returns 8 at most):
    summary.md, bench.json (every run's result, steps, command and guard events, and the
    setup records), setup.txt, logs.tar.xz (each run's train.log and guard.jsonl)."""
    dest.mkdir(parents=True, exist_ok=True)
    table = summary(runs) if runs.exists() else "no runs"
    doc: dict[str, Any] = {"setup": {}, "runs": {}}
    setup_text = []
    if setup and setup.exists():
        for f in sorted(setup.iterdir()):
            if f.suffix == ".json":
                doc["setup"][f.name] = json.loads(f.read_text())
                if f.name == "imports.json":
                    setup_text.append(
                        "== imports\n"
                        + "\n".join(
                            f"{k}: {v.get('version', v)} {v.get('file', '')}"
                            for k, v in doc["setup"][f.name].items()
                        )
                    )
            elif f.is_file():
                doc["setup"][f.name] = f.read_text(errors="replace")[-20000:]
                setup_text.append(f"== {f.name}\n{doc['setup'][f.name]}")
    for d in sorted(p for p in runs.iterdir() if p.is_dir()) if runs.exists() else []:
        if not (d / "result.json").exists():
            continue
        r = json.loads((d / "result.json").read_text())
        metrics = d / "metrics.jsonl"
        r["steps"] = (
            [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        )
        r["command"] = (d / "command.txt").read_text() if (d / "command.txt").exists() else None
        if (d / "run.json").exists():
            r["run"] = json.loads((d / "run.json").read_text())
        doc["runs"][d.name] = r
    files = []
    for name, text in (
        ("summary.md", table + "\n"),
        ("bench.json", json.dumps(doc, indent=1)),
        ("setup.txt", "\n".join(setup_text) + "\n"),
    ):
        tmp = dest / f".{name}.tmp"  # a call cut off mid-write keeps the previous file
        tmp.write_text(text)
        tmp.replace(dest / name)
        files.append(dest / name)
    cap = 24 * 2**20
    tmp = dest / ".logs.tar.xz.tmp"
    with tarfile.open(tmp, "w:xz") as tar:
        sources = sorted(runs.glob("*/train.log")) + sorted(runs.glob("*/guard.jsonl"))
        sources += sorted(runs.glob("*/job.env"))
        if setup:
            sources += sorted(setup.glob("nvidia-smi.txt"))
        for f in sources:
            data = f.read_bytes()[-cap:]
            info = tarfile.TarInfo(f"{f.parent.name}/{f.name}")
            info.size = len(data)
            info.mtime = int(f.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(dest / "logs.tar.xz")
    files.append(dest / "logs.tar.xz")
    return files


def merge_calls(bench_files: list[Path], runs: Path) -> str:
    """Rebuild run directories from returned bench.json files (a later file's run of a
    setting replaces an earlier one's) and summarise them together: the ratios to ``a``
    and ``b`` across device calls."""
    for path in bench_files:
        doc = json.loads(path.read_text())
        for name, r in doc.get("runs", {}).items():
            d = runs / name
            d.mkdir(parents=True, exist_ok=True)
            steps = r.pop("steps", [])
            run = r.pop("run", None)
            r.pop("command", None)
            (d / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
            if run:
                (d / "run.json").write_text(json.dumps(run, indent=1))
            (d / "result.json").write_text(json.dumps(r, indent=1))
    return summary(runs)
