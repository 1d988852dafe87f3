"""verl 0.5.0 PPO benchmark under the P40 guard: assets, settings, runs, summaries.

Everything is built here, offline: a Qwen2.5-0.5B-shaped model with random weights
(fp32), a byte-level BPE tokenizer with a ChatML template trained on the generated
text, and a GSM8K-shaped parquet in verl's layout (``data_source`` openai/gsm8k, a chat
``prompt``, ``reward_model.ground_truth``) whose prompts are padded to about 256 tokens.

Settings (each one ``python -m verl.trainer.main_ppo`` run, HF rollout, fp32, ref model
on through the KL loss, under ``OLDGPU_GUARD=pascal``):

- ``a``: the seed article's: batch 1, mini 1, micro 1, param + optimizer offload for
  actor, ref and critic, eager attention;
- ``b``: what ``oldgpu plan`` picks for the P40 profile (24 GiB), qwen2.5-0.5b,
  prompt 256 + response 256, with sdpa;
- ``c``: ``b`` with eager attention;
- ``learn``: a learning check: a small model, an easy reward (bench/reward_digits.py:
  the share of digits in the response) whose mean must rise over 20+ steps.

Subcommands::

    ppo_bench.py assets  [--kind bench|learn|tiny] [--home DIR]
    ppo_bench.py command SETTING [--steps N] [--tiny]          # print the command line
    ppo_bench.py run     SETTING --steps N --out DIR [--deadline EPOCH] [--tiny]
    ppo_bench.py summary RUNS                                  # table over RUNS/*/result.json
    ppo_bench.py export  RUNS DEST [--setup DIR]               # the few files for $OUT
    ppo_bench.py merge   CALL1/bench.json CALL2/bench.json --runs DIR   # here, afterwards

``--tiny`` is the CPU scale used to test all of this on a host without GPU (a tiny
Qwen2, batch 2, response 16, 2 steps, verl patched for the cpu profile).
Per run: ``RUNS/SETTING/{command.txt,run.json,train.log,metrics.jsonl,guard.jsonl,result.json}``
(``bench/run.sh`` keeps RUNS on the machine, .device/bench/runs, and exports a few
files into $OUT, since the device tool returns 8 at most).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HOME = Path(os.environ.get("BENCH_HOME", ROOT / ".device" / "bench"))
PYTHON = os.environ.get("BENCH_PYTHON", sys.executable)

PAD, IM_END = "<|endoftext|>", "<|im_end|>"  # as oldgpu.smoke's tokenizer names them
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

# Model shapes. bench = Qwen2.5-0.5B's config.json; the tokenizer is smaller than its
# vocabulary (ids stay below 151936; the embedding rows past it are never looked up).
KINDS: dict[str, dict[str, Any]] = {
    "bench": {
        "model": dict(
            hidden_size=896,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=4864,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        "tokenizer_vocab": 4096,
        "prompt": 256,
        "response": 256,
        "rows": 512,
    },
    "learn": {
        "model": dict(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=704,
            max_position_embeddings=1024,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        "tokenizer_vocab": 1024,
        "prompt": 64,
        "response": 32,
        "rows": 512,
    },
    "tiny": {
        "model": dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=512,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        "tokenizer_vocab": 512,
        "prompt": 64,
        "response": 16,
        "rows": 64,
    },
}
SETTINGS = ("a", "b", "c", "learn")
# The GPUs of the projection: peaks (the P40's at boost clock, the H200's fp32 without
# tensor cores, which the guard's TF32-off leaves it) and host links (the P40's PCIe 3.0
# x16 measured about 12 GB/s pinned; the H200 VM's link is an assumption). Achieved
# fractions of the peaks are assumptions too; the H200 run checks the model.
P40 = {"fp32_tflops": 11.76, "bandwidth_gbs": 347.0, "pcie_gbs": 12.0, "memory_mib": 24576}
H200 = {"fp32_tflops": 67.0, "bandwidth_gbs": 4800.0, "pcie_gbs": 25.0}
FLOPS_EFFICIENCY = 0.7
BW_EFFICIENCY = 0.8


# -- assets -------------------------------------------------------------------------------

NAMES = ("Ava", "Ben", "Cleo", "Dev", "Emma", "Finn", "Gia", "Hugo", "Iris", "Jon", "Kai", "Lena")
ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "coins")
FILLER = (
    "The market opens at 9 in the morning and closes at 5 in the evening.",
    "Every box on the shelf is the same size and holds the same number of things.",
    "Nobody else takes or adds anything while this happens.",
    "The question only asks about the total at the very end of the day.",
    "Some of the numbers in this story do not matter for the answer.",
    "Think about each step before writing the final number.",
    "There are 7 days in a week and 12 months in a year.",
    "A dozen means 12, and half a dozen means 6.",
    "The weather was sunny, and the streets were busy with people.",
    "All the prices are in whole dollars.",
)


def problem(rng: random.Random) -> dict[str, str]:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.choice(("add", "sub", "mul"))
    if kind == "add":
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        c = a + b
        q = f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} now?"
        work = f"{name} has {a} + {b} = <<{a}+{b}={c}>>{c} {item}."
    elif kind == "sub":
        a = rng.randint(20, 90)
        b = rng.randint(1, a - 1)
        c = a - b
        q = f"{name} had {a} {item} and gave {b} to {other}. How many {item} are left?"
        work = f"{name} has {a} - {b} = <<{a}-{b}={c}>>{c} {item} left."
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        c = a * b
        q = f"{name} has {a} bags with {b} {item} in each. How many {item} in all?"
        work = f"{name} has {a} * {b} = <<{a}*{b}={c}>>{c} {item}."
    return {"question": q, "answer": f"{work}\n#### {c}", "solution": str(c)}


def build_tokenizer(texts: list[str], vocab: int) -> Any:
    from oldgpu import smoke  # the smoke model's tokenizer: ChatML, byte-level BPE

    return smoke.build_tokenizer(texts, vocab=vocab, max_length=32768)


def prompt_tokens(tokenizer: Any, content: str) -> int:
    messages = [{"role": "user", "content": content}]
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def pad_question(tokenizer: Any, question: str, target: int, rng: random.Random) -> str:
    """Append filler sentences while the chat prompt stays within ``target`` tokens."""
    text = question
    while True:
        longer = f"{text} {rng.choice(FILLER)}"
        if prompt_tokens(tokenizer, f"{longer} {INSTRUCTION}") > target:
            return text
        text = longer


def verl_row(p: dict[str, str], split: str, index: int) -> dict[str, Any]:
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{p['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": p["solution"]},
        "extra_info": {
            "split": split,
            "index": index,
            "answer": p["answer"],
            "question": p["question"],
        },
    }


def build_assets(kind: str, home: Path, seed: int = 0) -> dict[str, Any]:
    """HOME/assets/KIND/{model,data}: written once; a complete one is reused."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    spec = KINDS[kind]
    out = home / "assets" / kind
    done = out / "assets.json"
    if done.exists():
        return json.loads(done.read_text())
    t0 = time.time()
    rng = random.Random(seed)
    problems = [problem(rng) for _ in range(spec["rows"] + 16)]
    corpus = [p["question"] + " " + INSTRUCTION for p in problems]
    corpus += [p["answer"] for p in problems] + list(FILLER) * 20
    tokenizer = build_tokenizer(corpus, spec["tokenizer_vocab"])
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(model_dir)
    pad_id, eos_id = tokenizer.convert_tokens_to_ids(PAD), tokenizer.convert_tokens_to_ids(IM_END)
    shape = dict(spec["model"])
    shape.setdefault("vocab_size", len(tokenizer))
    config = Qwen2Config(
        **shape,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=shape["num_hidden_layers"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(model_dir, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    del model
    # The data: prompts padded towards the prompt length (verl left-pads to it).
    rows: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    lengths = []
    target = spec["prompt"] - 2 if kind == "bench" else spec["prompt"] // 2
    for i, p in enumerate(problems):
        split = "train" if i < spec["rows"] else "test"
        p = dict(p, question=pad_question(tokenizer, p["question"], target, rng))
        lengths.append(prompt_tokens(tokenizer, f"{p['question']} {INSTRUCTION}"))
        rows[split].append(verl_row(p, split, len(rows[split])))
    (out / "data").mkdir(parents=True, exist_ok=True)
    for split, items in rows.items():
        pq.write_table(pa.Table.from_pylist(items), out / "data" / f"{split}.parquet")
    doc = {
        "kind": kind,
        "model": str(model_dir),
        "train": str(out / "data" / "train.parquet"),
        "test": str(out / "data" / "test.parquet"),
        "params": params,
        "tokenizer_size": len(tokenizer),
        "vocab_size": shape["vocab_size"],
        "prompt_tokens": {
            "min": min(lengths),
            "mean": round(statistics.mean(lengths), 1),
            "max": max(lengths),
        },
        "prompt_length": spec["prompt"],
        "response_length": spec["response"],
        "seconds": round(time.time() - t0, 1),
    }
    done.write_text(json.dumps(doc, indent=1))
    return doc


# -- settings -----------------------------------------------------------------------------


def _engine(*args: str) -> dict[str, Any]:
    env = dict(os.environ)
    proc = subprocess.run(
        [PYTHON, "-m", "oldgpu", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise SystemExit(f"oldgpu {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+")


def merge(*groups: list[str]) -> list[str]:
    """Overrides in order, a later one replacing an earlier one of the same key."""
    out: dict[str, str] = {}
    for group in groups:
        for o in group:
            out.pop(_key(o), None)
            out[_key(o)] = o
    return list(out.values())


def ops_steps(overrides: list[str]) -> int:
    """Optimizer steps of the first PPO step (actor + critic): the guard checks them op
    by op and times the later steps without that cost."""
    values = {_key(o): o.split("=", 1)[1] for o in overrides}
    batch = int(values.get("data.train_batch_size", 1))
    mini = int(values.get("actor_rollout_ref.actor.ppo_mini_batch_size", batch))
    critic_mini = int(values.get("critic.ppo_mini_batch_size", mini))
    steps = max(1, batch // mini) + max(1, batch // critic_mini)
    return steps


def compose(
    setting: str, steps: int, out: Path, tiny: bool = False, cpu: bool = False
) -> dict[str, Any]:
    """The command line and environment of one run (``tiny``: CPU and the tiny model;
    ``cpu``: CPU with the setting's own model)."""
    if setting not in SETTINGS:
        raise SystemExit(f"unknown setting {setting!r}: one of {', '.join(SETTINGS)}")
    cpu = cpu or tiny
    kind = "tiny" if tiny else ("learn" if setting == "learn" else "bench")
    assets = build_assets(kind, HOME)
    spec = KINDS[kind]
    prof = _engine("profile", "--arch", "cpu" if cpu else "pascal")
    common = [
        "algorithm.adv_estimator=gae",
        f"data.train_files={assets['train']}",
        f"data.val_files={assets['test']}",
        f"data.max_prompt_length={spec['prompt']}",
        f"data.max_response_length={spec['response']}",
        "data.truncation=error",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={assets['model']}",
        f"critic.model.path={assets['model']}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "critic.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.rollout.do_sample=True",
        "actor_rollout_ref.rollout.temperature=1.0",
        # The ref model exists only with a KL term: the article and the planner count it.
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "trainer.logger=[console]",
        "trainer.project_name=oldgpu-bench",
        f"trainer.experiment_name={setting}{'-tiny' if tiny else '-cpu' if cpu else ''}",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        "trainer.total_epochs=1000",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={out / 'checkpoints'}",
    ]
    attn = "sdpa"
    planner = None
    if setting == "a":
        attn = "eager"
        specific = [
            "data.train_batch_size=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
            "critic.ppo_mini_batch_size=1",
            "critic.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.fsdp_config.param_offload=True",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
            "actor_rollout_ref.ref.fsdp_config.param_offload=True",
            "critic.model.fsdp_config.param_offload=True",
            "critic.model.fsdp_config.optimizer_offload=True",
        ]
        if cpu:  # verl's offload moves to and from "cuda": meaningless, and broken, on CPU
            specific = [o for o in specific if "offload" not in o]
    elif setting in ("b", "c"):
        attn = "sdpa" if setting == "b" else "eager"
        args = ["plan", "--prompt-length", str(spec["prompt"])]
        args += ["--response-length", str(spec["response"])]
        if cpu:
            args += ["--profile", "cpu", "--host-mib", "8192", "--model", assets["model"]]
            args += ["--target-train-batch", "2" if tiny else "16"]
        else:
            args += ["--profile", "pascal", "--gpu-mib", str(P40["memory_mib"])]
            args += ["--model-shape", "qwen2.5-0.5b"]
        planner = _engine(*args)
        planner = {
            "args": args,
            **{k: planner[k] for k in ("choice", "estimate", "hydra_overrides")},
        }
        specific = list(planner["hydra_overrides"])
    else:  # learn: a small model that must learn an easy reward
        batch = 8 if tiny else 64
        specific = [
            f"data.train_batch_size={batch}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={batch // 2}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch // 2}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch}",
            f"critic.ppo_micro_batch_size_per_gpu={batch // 2}",
            "actor_rollout_ref.actor.use_kl_loss=False",
            "actor_rollout_ref.actor.optim.lr=1e-4",
            "critic.optim.lr=1e-4",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "critic.model.enable_gradient_checkpointing=False",
            f"custom_reward_function.path={ROOT / 'bench' / 'reward_digits.py'}",
            "custom_reward_function.name=compute_score",
        ]
    overrides = merge(common, prof["hydra_overrides"], specific)
    env = {
        "OLDGPU_ATTN_IMPLEMENTATION": attn,
        "OLDGPU_COMPUTE_DTYPE": "fp32",
        "OLDGPU_GUARD": "pascal",
        "OLDGPU_GUARD_LOG": str(out / "guard.jsonl"),
        "OLDGPU_GUARD_OPS_STEPS": str(ops_steps(overrides)),
        "HYDRA_FULL_ERROR": "1",
    }
    if cpu:
        env["OLDGPU_GUARD_DEVICE"] = "cpu"  # watch the CPU tensors: the fp32 path there
    return {
        "setting": setting,
        "kind": kind,
        "tiny": tiny,
        "cpu": cpu,
        "steps": steps,
        "attn_implementation": attn,
        "assets": assets,
        "planner": planner,
        "argv": [PYTHON, "-m", "verl.trainer.main_ppo", *overrides],
        "env": env,
    }


def shell_line(run: dict[str, Any]) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in run["env"].items())
    return f"{env} " + " ".join(shlex.quote(a) for a in run["argv"])


# -- running and parsing ------------------------------------------------------------------

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
    m = STEP_LINE.search(line)
    if not m:
        return None
    metrics: dict[str, Any] = {"step": int(m.group(1))}
    for item in m.group(2).split(" - "):
        key, sep, value = item.partition(":")
        if sep:
            metrics[key.strip()] = parse_value(value)
    return metrics


def session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` (the run's driver and what it started: Ray's
    raylet, GCS and workers), read from /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 3 and int(fields[3]) == sid:
            pids.append(int(stat.parent.name))
    return pids


def end_session(sid: int, log: Any = None) -> None:
    """Stop every process of the run's session, by pid: INT, then TERM, then KILL."""
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        pids = session_pids(sid)
        if not pids:
            return
        if log:
            log.write(f"[bench] sending {sig.name} to {len(pids)} processes of the run\n")
            log.flush()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.time() + wait
        while time.time() < end and session_pids(sid):
            time.sleep(0.5)


def execute(run: dict[str, Any], out: Path, deadline: float | None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "guard.jsonl", "train.log", "result.json"):
        (out / stale).unlink(missing_ok=True)
    (out / "command.txt").write_text(shell_line(run) + "\n")
    (out / "run.json").write_text(json.dumps(run, indent=1))
    env = dict(os.environ, **run["env"])
    t0 = time.time()
    first_step_at = None
    steps: list[dict[str, Any]] = []
    with (out / "train.log").open("w") as log, (out / "metrics.jsonl").open("w") as metrics:
        proc = subprocess.Popen(
            run["argv"],
            cwd=out,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: a timeout ends all of it
        )
        (out / "session.pid").write_text(str(proc.pid))
        timed_out = threading.Event()

        def watchdog() -> None:
            while proc.poll() is None:
                if deadline and time.time() > deadline:
                    timed_out.set()
                    log.write("[bench] deadline reached\n")
                    end_session(proc.pid, log)
                    return
                time.sleep(1)

        threading.Thread(target=watchdog, daemon=True).start()
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            m = parse_step(line)
            if m:
                m["wall_s"] = round(time.time() - t0, 2)
                first_step_at = first_step_at or m["wall_s"]
                steps.append(m)
                metrics.write(json.dumps(m) + "\n")
                metrics.flush()
                print(
                    f"[bench] {run['setting']} step {m['step']}: "
                    f"{m.get('timing_s/step', float('nan')):.2f} s, "
                    f"{m.get('perf/throughput', float('nan')):.1f} tok/s, "
                    f"reserved {m.get('perf/max_memory_reserved_gb', float('nan')):.2f} GB, "
                    f"score {m.get('critic/score/mean', float('nan')):.4f}",
                    file=sys.stderr,
                    flush=True,
                )
        rc = proc.wait()
        end_session(proc.pid, log)  # what Ray left behind
        (out / "session.pid").unlink(missing_ok=True)
    result = summarize(run, steps, out)
    result.update(
        rc=rc,
        timed_out=timed_out.is_set(),
        wall_s=round(time.time() - t0, 1),
        first_step_wall_s=first_step_at,
    )
    if rc and not steps:
        tail = (out / "train.log").read_text(errors="replace").splitlines()[-40:]
        result["log_tail"] = tail
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


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
        "violations": [e for e in events if e["event"] in ("violation", "arm-failed")][:20],
        "install_failed": [e for e in events if e["event"] == "install-failed"][:5],
        "memory_cap": next((e["devices"] for e in events if e["event"] == "memory-cap"), None),
        "ignored": sorted({e.get("what", "") for e in events if e["event"] == "ignored"}),
    }


def summarize(run: dict[str, Any], steps: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    timed = [s for s in steps if s["step"] >= 2] or steps

    def col(key: str, rows: list[dict[str, Any]] = timed) -> list[float]:
        return [s[key] for s in rows if isinstance(s.get(key), (int, float))]

    peak_alloc = col("perf/max_memory_allocated_gb", steps)
    peak_res = col("perf/max_memory_reserved_gb", steps)
    scores = col("critic/score/mean", steps)
    result = {
        "setting": run["setting"],
        "tiny": run["tiny"],
        "attn_implementation": run["attn_implementation"],
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
        "planner": run.get("planner") and run["planner"]["choice"],
        "planner_peak_mib": run.get("planner") and run["planner"]["estimate"]["peak_mib"],
    }
    g = result["guard"]
    result["guard_ok"] = bool(
        g.get("log")
        and g.get("armed_pids")
        and not g.get("violations")
        and not g.get("install_failed")
    )
    if run["setting"] == "learn" and len(scores) >= 10:
        # It learned: the last 5 steps' mean reward clearly above the first 5's, and a
        # rising trend over the whole run.
        result["learned"] = bool(
            result["score_last5"] - result["score_first5"] > 0.02
            and (result["score_slope_per_step"] or 0) > 0
        )
    if not run.get("cpu") and run["kind"] == "bench":
        result["projection"] = projections(run, result)
    return result


def project(run: dict[str, Any], r: dict[str, Any], hw: dict[str, float]) -> dict[str, Any]:
    """A step time on GPU ``hw`` from the run's shape: a model, not a measurement.

    - generation, per decoding step: the weights (4 bytes x params) and the KV cache read
      once at ``bandwidth x BW_EFFICIENCY``, or the batch's 2 x params FLOPs at ``fp32
      peak x FLOPS_EFFICIENCY``, whichever is longer; and never faster than the measured
      run's time per decoding step (HF generate is launch-bound, so the measuring host's
      per-token overhead is a floor for any GPU);
    - the other phases: 2 x params FLOPs per token per forward plus attention's 4 x
      layers x seq^2 x hidden per sequence, over the padded sequences (verl pads to
      prompt + response without remove-padding): actor and ref log-prob and critic
      values 1 forward each, each update 3 (forward + backward) + 1 (checkpointing's
      recompute); AdamW's steps are memory-bound (28 bytes/param);
    - offload over PCIe: optimizer states (8 bytes/param) out and back per update; with
      param offload the weights (4 bytes/param) each way per phase of the role.
    """
    shape = KINDS["bench"]["model"]
    params = run["assets"]["params"]
    values = {_key(a): a.split("=", 1)[1] for a in run["argv"][3:]}
    batch = int(values.get("data.train_batch_size", 1))
    mini = int(values.get("actor_rollout_ref.actor.ppo_mini_batch_size", batch))
    prompt = int(values.get("data.max_prompt_length", 256))
    response = int(values.get("data.max_response_length", 256))
    seq = prompt + response
    flops = hw["fp32_tflops"] * 1e12 * FLOPS_EFFICIENCY
    bw = hw["bandwidth_gbs"] * 1e9 * BW_EFFICIENCY
    pcie = hw["pcie_gbs"] * 1e9
    layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
    head_dim = hidden // shape["num_attention_heads"]
    kv_per_token = 2 * layers * shape["num_key_value_heads"] * head_dim * 4
    kv_bytes = batch * (prompt + response / 2) * kv_per_token  # the mean over decoding
    decode_step = max((4 * params + kv_bytes) / bw, 2 * params * batch / flops)
    host_floor = (r.get("gen_s") or 0) / response
    gen = response * max(decode_step, host_floor)
    forwards = 3 + 2 * 4  # log-prob (actor, ref), values; two updates x (3 + 1 recompute)
    per_seq = 2 * params * seq + 4 * layers * seq * seq * hidden
    train = forwards * per_seq * batch / flops
    adam = 2 * max(1, batch // mini) * 28 * params / bw
    offload = 0.0
    for role, phases in (("actor_rollout_ref.actor", 3), ("critic.model", 2)):
        if values.get(f"{role}.fsdp_config.optimizer_offload") == "True":
            offload += 2 * 8 * params / pcie
        if values.get(f"{role}.fsdp_config.param_offload") == "True":
            offload += phases * 2 * 4 * params / pcie
    total = gen + train + adam + offload
    tokens = r.get("tokens_per_step") or batch * seq
    return {
        "gen_s": round(gen, 2),
        "compute_s": round(train + adam, 2),
        "offload_s": round(offload, 2),
        "s_per_step": round(total, 2),
        "tokens_per_s": round(tokens / total, 1),
        "decode_step_ms": round(decode_step * 1e3, 2),
        "host_floor_ms": round(host_floor * 1e3, 2),
    }


def projections(run: dict[str, Any], r: dict[str, Any]) -> dict[str, Any] | None:
    """The same model for the H200 (checked against the measurement) and the P40."""
    if r.get("s_per_step") is None:
        return None
    h200, p40 = project(run, r, H200), project(run, r, P40)
    return {
        "label": "projection (a model, not a measurement)",
        "assumptions": {
            "flops_efficiency": FLOPS_EFFICIENCY,
            "bandwidth_efficiency": BW_EFFICIENCY,
            "h200": H200,
            "p40": P40,
            "params": run["assets"]["params"],
        },
        "h200_model": h200,
        "h200_measured_over_model": round(r["s_per_step"] / h200["s_per_step"], 3),
        "p40": p40,
        "p40_over_h200_model": round(p40["s_per_step"] / h200["s_per_step"], 2),
    }


# -- summary ------------------------------------------------------------------------------


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
    base = results.get("a", {}).get("tokens_per_s")
    lines = [
        "| setting | run | steps (timed) | tokens/s | s/step | gen s | peak alloc GB | "
        "peak reserved GB | vs a | guard | P40 projected s/step (tokens/s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        tps = r.get("tokens_per_s")
        ratio = f"{tps / base:.2f}x" if tps and base and name != "learn" else "-"
        g = r.get("guard", {})
        guard = "ok" if r.get("guard_ok") else f"NOT ok ({len(g.get('violations', []))} viol.)"
        proj = (r.get("projection") or {}).get("p40")
        proj_s = f"{proj['s_per_step']} ({proj['tokens_per_s']})" if proj else "-"

        def fmt(v: Any) -> str:
            return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

        status = (
            "stopped at deadline"
            if r.get("timed_out")
            else ("ok" if r.get("rc") == 0 else f"failed (rc {r.get('rc')})")
        )
        timed = r["steps_timed"]
        span = f"{timed[0]}-{timed[-1]}" if len(timed) > 1 else ",".join(map(str, timed))
        lines.append(
            f"| {name} | {status} | {r['steps_done']} ({span}) | "
            f"{fmt(tps)} | {fmt(r.get('s_per_step'))} | {fmt(r.get('gen_s'))} | "
            f"{fmt(r.get('peak_allocated_gb'))} | {fmt(r.get('peak_reserved_gb'))} | {ratio} | "
            f"{guard} | {proj_s} |"
        )
        if name == "learn" and r.get("score_first5") is not None:
            verdict = {True: "LEARNED", False: "NOT learned"}  # judged from 10 steps on
            lines.append(
                f"| learn reward | {verdict.get(r.get('learned'), '-')} | "
                f"first 5 steps {fmt(r.get('score_first5'))}, last 5 "
                f"{fmt(r.get('score_last5'))}, slope {r.get('score_slope_per_step')}/step "
                "| | | | | | | | |"
            )
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    return text


def export(runs: Path, dest: Path, setup: Path | None = None) -> list[Path]:
    """At most a handful of files for the device tool's $OUT (it returns 8 at most):
    summary.md, bench.json (every run's result, steps, command and guard events, and the
    setup records), setup.txt, logs.tar.xz (each run's train.log and guard.jsonl)."""
    import io
    import tarfile

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
        (dest / name).write_text(text)
        files.append(dest / name)
    cap = 24 * 2**20
    with tarfile.open(dest / "logs.tar.xz", "w:xz") as tar:
        sources = sorted(runs.glob("*/train.log")) + sorted(runs.glob("*/guard.jsonl"))
        if setup:
            sources += sorted(setup.glob("nvidia-smi.txt"))
        for f in sources:
            data = f.read_bytes()[-cap:]
            info = tarfile.TarInfo(f"{f.parent.name}/{f.name}")
            info.size = len(data)
            info.mtime = int(f.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    files.append(dest / "logs.tar.xz")
    return files


def merge_calls(bench_files: list[Path], runs: Path) -> str:
    """Rebuild run directories from returned bench.json files (a later file's run of a
    setting replaces an earlier one's) and summarise them together: the ratio to ``a``
    across device calls."""
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


# -- CLI ----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("assets")
    p.add_argument("--kind", choices=sorted(KINDS), default="bench")
    p = sub.add_parser("command")
    p.add_argument("setting", choices=SETTINGS)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="CPU, the tiny model")
    p.add_argument("--cpu", action="store_true", help="CPU, the setting's model")
    p.add_argument("--out", type=Path, default=HOME / "out")
    p = sub.add_parser("run")
    p.add_argument("setting", choices=SETTINGS)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", type=Path, required=True, help="the run's directory")
    p.add_argument("--tiny", action="store_true", help="CPU, the tiny model")
    p.add_argument("--cpu", action="store_true", help="CPU, the setting's model")
    p.add_argument("--deadline", type=float, help="epoch seconds: stop the run by then")
    p.add_argument("--no-guard", action="store_true", help="run without the guard (compare)")
    p = sub.add_parser("summary")
    p.add_argument("runs", type=Path, help="the directory of the run directories")
    p = sub.add_parser("merge", help="summarise the bench.json files device calls returned")
    p.add_argument("bench_json", type=Path, nargs="+")
    p.add_argument("--runs", type=Path, required=True, help="where to rebuild the run dirs")
    p = sub.add_parser("export")
    p.add_argument("runs", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--setup", type=Path)
    args = parser.parse_args()
    if args.cmd == "assets":
        print(json.dumps(build_assets(args.kind, HOME), indent=1))
    elif args.cmd == "command":
        run = compose(args.setting, args.steps, args.out / args.setting, args.tiny, args.cpu)
        print(shell_line(run))
    elif args.cmd == "run":
        run = compose(args.setting, args.steps, args.out, args.tiny, args.cpu)
        if args.no_guard:
            run["env"] = {k: v for k, v in run["env"].items() if not k.startswith("OLDGPU_GUARD")}
        print(f"[bench] {shell_line(run)[:600]} ...", file=sys.stderr)
        result = execute(run, args.out, args.deadline)
        keys = ("setting", "rc", "timed_out", "steps_done", "first_step_wall_s", "wall_s")
        keys += ("tokens_per_s", "s_per_step", "peak_allocated_gb", "peak_reserved_gb")
        keys += ("guard_ok", "score_first5", "score_last5")
        keys += ("learned",)
        print("[bench] result " + json.dumps({k: result.get(k) for k in keys}))
        if not result["guard_ok"]:
            print(f"[bench] guard: {json.dumps(result['guard'])[:1500]}", file=sys.stderr)
        if result.get("log_tail"):
            print("\n".join(result["log_tail"]), file=sys.stderr)
        sys.exit(0 if result["steps_done"] else 1)
    elif args.cmd == "summary":
        print(summary(args.runs))
    elif args.cmd == "merge":
        print(merge_calls(args.bench_json, args.runs))
    else:
        for f in export(args.runs, args.dest, args.setup):
            print(f"{f} {f.stat().st_size} bytes")


if __name__ == "__main__":
    main()
