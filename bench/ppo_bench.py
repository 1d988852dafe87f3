"""verl 0.5.0 training benchmark under the P40 guard, through the production start path.

Every setting is a training job: the fields of ``oldgpu job`` (src/oldgpu/jobs/settings.py), and
in the job's ``overrides`` what only a benchmark needs. A run

1. builds the assets (bench/bench_assets.py), offline: a model of the setting's shape
   with random weights and a GSM8K-shaped parquet; or the smoke model and data;
2. writes the job's env file with ``oldgpu job env`` and asks ``oldgpu job command`` what
   the start script will run (command.txt; the guard's per-op step count comes from it);
3. starts ``files/bin/verl-train``, the script ``verl-train@<job>.service`` runs, with
   that env file, under ``OLDGPU_GUARD=pascal`` (the volta settings: ``volta``, a 32 GB
   V100's cap), and reads verl's console step lines.

Afterwards it checks that verl-train ran exactly what ``oldgpu job command`` composed
(the job's ``plan.json``) and records whether the doctor passed. The bench's own parts
are the assets, the guard's log, the timing and the summary (bench/bench_report.py).

On the lent GPU machine (bench/setup.sh prepares it): verl-train finds the engine, the
interpreter and the patched tree through the variables it honours (``OLDGPU_BIN``,
``VERL_VENV``, ``VERL_DIR``; ``STATE_DIRECTORY`` and ``LOGS_DIRECTORY`` as systemd sets
them); ``oldgpu job command`` plans against a P40's recorded nvidia-smi line
(bench/p40.nvidia-smi.csv), as on a P40 host, where nvidia-smi would name the H200; and
verl-train runs with ``--doctor-warn-only-for-benchmarks``, since the doctor rightly
refuses the Pascal profile on that machine's torch (the log says it ran past).

Settings: ``ppo_bench.py settings`` lists SETTINGS. A setting whose job fields this
engine does not have yet (GRPO, LoRA) says so instead of running.

Subcommands::

    ppo_bench.py settings
    ppo_bench.py assets  [--kind bench|bench-1.5b|learn|smoke]
    ppo_bench.py command SETTING [--steps N] [--smoke|--cpu]    # the job and its command
    ppo_bench.py run     SETTING --steps N --out DIR [--deadline EPOCH] [--smoke|--cpu]
    ppo_bench.py summary RUNS                                   # table over RUNS/*/result.json
    ppo_bench.py export  RUNS DEST [--setup DIR]                # the few files for $OUT
    ppo_bench.py merge   CALL1/bench.json CALL2/bench.json --runs DIR   # here, afterwards

Scales: the default is the GPU (profile pascal, the setting's model); ``--cpu`` runs the
setting's model on the cpu profile; ``--smoke`` the smoke model (``oldgpu smoke-assets``)
on the cpu profile with a batch of at most 4: the whole path on a host without GPU.
Per run: ``DIR/{job.json,job.env,command.txt,run.json,train.log,metrics.jsonl,
guard.jsonl,result.json,state/}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# This checkout's engine and the bench's modules, whatever else is installed.
for _path in (ROOT / "src", ROOT / "bench"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench_report as report  # noqa: E402
from bench_assets import KINDS, build_assets  # noqa: E402
from bench_run import run_checked  # noqa: E402

from oldgpu import guard, jobs  # noqa: E402

HOME = Path(os.environ.get("BENCH_HOME", ROOT / ".device" / "bench"))
PYTHON = os.environ.get("BENCH_PYTHON", sys.executable)
VERL_TRAIN = ROOT / "files" / "bin" / "verl-train"
DOCTOR_FLAG = "--doctor-warn-only-for-benchmarks"
REWARD = ROOT / "bench" / "reward_digits.py"
GUARD_PROFILE = "pascal"
SMOKE_BATCH = 4

# -- the settings -----------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One benchmark job. ``job``: fields of src/oldgpu/jobs/settings.py; ``overrides``: Hydra
    overrides only a benchmark needs (the job's ``overrides``, applied last; ``{batch}``,
    ``{half}`` and ``{reward}`` are filled in); ``gpu_only``: those dropped on the cpu
    profile."""

    name: str
    what: str
    kind: str = "bench"
    job: dict[str, Any] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()
    gpu_only: tuple[str, ...] = ()
    # The GPU profile the job is forced to and the guard makes the GPU (cpu scales: cpu).
    profile: str = GUARD_PROFILE
    # What the guard allows when the job forces another dtype than the profile's.
    guard_dtype: str = ""
    # Variables the run's processes get beside the job's (a baseline's switch).
    env: dict[str, str] = field(default_factory=dict)
    # The job saves its checkpoint at its last step (BENCH_OVERRIDES turns saving off: a
    # save inside the timed steps would count in tokens/s).
    save: bool = False


# Every run: no checkpoint inside the timed steps (a job saves at its last step).
BENCH_OVERRIDES = ("trainer.save_freq=-1",)
# The ref model exists only with a KL term; the article and the planner both count it.
KL_LOSS = ("actor_rollout_ref.actor.use_kl_loss=True",)
ARTICLE_OFFLOAD = (
    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "critic.model.fsdp_config.param_offload=True",
    "critic.model.fsdp_config.optimizer_offload=True",
)
ARTICLE = (
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
    "critic.ppo_mini_batch_size=1",
    "critic.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "critic.model.enable_gradient_checkpointing=True",
    *ARTICLE_OFFLOAD,
)
# The learning check: two mini-batches a step, a higher learning rate, an easy reward.
LEARN = (
    "actor_rollout_ref.actor.ppo_mini_batch_size={half}",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={half}",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch}",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={batch}",
    "critic.ppo_mini_batch_size={half}",
    "critic.ppo_micro_batch_size_per_gpu={half}",
    "actor_rollout_ref.actor.optim.lr=1e-4",
    "critic.optim.lr=1e-4",
    "actor_rollout_ref.model.enable_gradient_checkpointing=False",
    "critic.model.enable_gradient_checkpointing=False",
    "custom_reward_function.path={reward}",
    "custom_reward_function.name=compute_score",
)
# LoRA trains a few parameters: its usual learning rate is ten times full fine-tuning's.
LEARN_LORA = ("actor_rollout_ref.actor.optim.lr=1e-3",)
# GRPO's job fields; n and the LoRA numbers are verl's GRPO/LoRA examples'.
GRPO = {"algorithm": "grpo", "rollout_n": 4, "kl_loss_coef": 0.001}
# fp16 against fp32 on the volta profile (a 32 GB V100's plan, its guard's cap). The
# HF rollout: vLLM 0.8.x needs torch 2.6, not the lent machine's. One batch for both
# so tokens/s compare; 64, not the planner's 256, so that both fit one device call
# (the planner picks the micro batches, offload and checkpointing at that batch).
# BENCH_VOLTA_BATCH sets another (HF generation is launch-bound and costs about the
# same at any batch, so a larger one shows more of the update's fp16 speed-up).
VOLTA_BATCH = int(os.environ.get("BENCH_VOLTA_BATCH", "64"))
FP16 = {"rollout": "hf", "train_batch_size": VOLTA_BATCH}
FP32 = {**FP16, "compute_dtype": "fp32"}
# The recorded nvidia-smi line `job command` plans against on the lent GPU, per profile.
PROFILE_SMI = {
    "pascal": ROOT / "tests" / "data" / "detect" / "p40.nvidia-smi.csv",
    "volta": ROOT / "tests" / "data" / "detect" / "v100.nvidia-smi.csv",
}
# verl 0.9.0 beside 0.5.0 (issue 27): one GRPO batch for both releases, small enough that
# both runs fit one device call; each at its own planner's micro batches (0.9.0 computes
# verl's own logits and its rollout server holds a second copy of the weights).
NEWER = {"verl_version": "0.9.0"}
GRPO_CMP = {**GRPO, "train_batch_size": 32}
LORA = {"lora_rank": 32, "lora_alpha": 32, "lora_target_modules": []}  # empty: all-linear
# The baseline of the logits patch set: verl's own logits, log-probs and entropy
# (compat_logits.py's switch) at the micro batches the planner gave a P40 before it
# counted them (engine of 2026-12-05: actor and critic micro 2, log-prob micro 16).
VERLS_OWN_LOGITS = {"OLDGPU_RESPONSE_LOGITS": "off"}
BEFORE_LOGITS = (
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
)

SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "a",
            "the seed article's: batch 1, mini 1, micro 1, param + optimizer offload for "
            "actor, ref and critic (PPO, GAE)",
            job={"train_batch_size": 1},
            overrides=KL_LOSS + ARTICLE,
            gpu_only=ARTICLE_OFFLOAD,  # verl's offload moves to "cuda": broken on CPU
        ),
        Setting("b", "the planner's for a P40 (PPO, GAE)", overrides=KL_LOSS),
        Setting(
            "b-before",
            "b before the logits patch set: verl's own logits (OLDGPU_RESPONSE_LOGITS=off) "
            "at the planner's earlier micro batches (2, 2; log-prob 16)",
            overrides=KL_LOSS + BEFORE_LOGITS,
            env=VERLS_OWN_LOGITS,
        ),
        Setting("grpo", "GRPO at the planner's batch", job=dict(GRPO)),
        Setting(
            "grpo-09",
            "GRPO at the planner's batch, verl 0.9.0 (oldgpu-hf generating in the trainer's "
            "process; grpo's twin for issue 32)",
            job={**GRPO, **NEWER},
        ),
        Setting("grpo-lora", "GRPO + LoRA at the planner's batch", job={**GRPO, **LORA}),
        Setting(
            "grpo-lora-1p5b",
            "GRPO + LoRA, Qwen2.5-1.5B-shaped, at the planner's batch",
            kind="bench-1.5b",
            job={**GRPO, **LORA},
        ),
        Setting(
            "grpo-lora-3b",
            "GRPO + LoRA, Qwen2.5-3B-shaped, at the planner's batch",
            kind="bench-3b",
            job={**GRPO, **LORA},
        ),
        Setting(
            "grpo-lora-7b",
            "GRPO + LoRA, Qwen2.5-7B-shaped (a bf16 checkpoint), the base stored at 16 bits "
            "and computed in fp32 (base_dtype bf16), at the planner's batch; saves its "
            "checkpoint at its last step",
            kind="bench-7b",
            job={**GRPO, **LORA, "base_dtype": "bf16"},
            save=True,
            # The card-wide bar, 22.5 GiB across processes: the worker keeps 1.3 GiB
            # outside torch's allocator (context, cuBLAS, NCCL; 24350 MiB in all against
            # 22.45 GiB reserved in call 1 of 2026-12-06-h100-b), so its allocator gets 21.
            env={"OLDGPU_GUARD_MEMORY_MIB": "21504"},
        ),
        Setting(
            "learn",
            "learning check (PPO): a small model must raise bench/reward_digits.py's reward",
            kind="learn",
            job={"train_batch_size": 64},
            overrides=LEARN,
        ),
        Setting(
            "learn-grpo",
            "learning check (GRPO)",
            kind="learn",
            job={"train_batch_size": 64, **GRPO},
            overrides=LEARN,
        ),
        Setting(
            "learn-grpo-lora",
            "learning check (GRPO + LoRA, rank 32, LoRA's learning rate), Qwen2.5-0.5B-shaped "
            "(a bf16 checkpoint), fp32 base",
            kind="learn-0.5b",
            job={"train_batch_size": 64, **GRPO, **LORA, "base_dtype": "fp32"},
            overrides=(*LEARN, *LEARN_LORA),
        ),
        Setting(
            "learn-grpo-lora-bf16",
            "learn-grpo-lora with the base stored at bf16 (base_dtype), computed in fp32",
            kind="learn-0.5b",
            job={"train_batch_size": 64, **GRPO, **LORA, "base_dtype": "bf16"},
            overrides=(*LEARN, *LEARN_LORA),
        ),
        Setting(
            "grpo-cmp",
            "GRPO, batch 32 x 4, verl 0.5.0 (grpo-cmp-09's baseline)",
            job=dict(GRPO_CMP),
        ),
        Setting(
            "grpo-cmp-09",
            "GRPO, batch 32 x 4, verl 0.9.0 (the oldgpu-hf rollout server)",
            job={**GRPO_CMP, **NEWER},
        ),
        Setting(
            "learn-grpo-09",
            "learning check (GRPO), verl 0.9.0; saves its checkpoint at its last step",
            kind="learn",
            job={"train_batch_size": 64, **GRPO, **NEWER},
            overrides=LEARN,
            save=True,
        ),
        Setting(
            "fp16-volta",
            f"the volta profile's fp16 with the loss scaler, batch {VOLTA_BATCH} (PPO, GAE; "
            "HF rollout)",
            job=dict(FP16),
            overrides=KL_LOSS,
            profile="volta",
        ),
        Setting(
            "fp32-volta",
            f"the volta profile forced to fp32 (the baseline of fp16-volta), batch {VOLTA_BATCH}",
            job=dict(FP32),
            overrides=KL_LOSS,
            profile="volta",
            guard_dtype="fp32",
        ),
        Setting(
            "learn-fp16",
            "learning check (PPO) in fp16 with the loss scaler, the volta profile",
            kind="learn",
            job={"train_batch_size": 64, "rollout": "hf"},
            overrides=LEARN,
            profile="volta",
        ),
    )
}


def missing_fields(setting: Setting) -> list[str]:
    """The setting's job fields this engine does not have (yet)."""
    return sorted(set(setting.job) - set(jobs.FIELD_BY_NAME))


# -- a run: the job, its env file, the start script -------------------------------------------


def engine(*args: str, env: dict[str, str] | None = None) -> str:
    """``oldgpu ARGS`` as verl-train calls it ($OLDGPU_BIN; else this python's engine)."""
    cmd = [os.environ["OLDGPU_BIN"]] if os.environ.get("OLDGPU_BIN") else [PYTHON, "-m", "oldgpu"]
    return run_checked([*cmd, *args], {**os.environ, **(env or {})}, f"oldgpu {' '.join(args)}")


def job_spec(setting: Setting, steps: int, scale: str, assets: dict[str, Any]) -> dict[str, Any]:
    """The job's fields, as an inventory would declare them."""
    job = dict(setting.job)
    if scale == "smoke":
        job["train_batch_size"] = min(job.get("train_batch_size") or SMOKE_BATCH, SMOKE_BATCH)
    batch = int(job.get("train_batch_size", 0))
    fill = {"batch": batch, "half": max(1, batch // 2), "reward": REWARD}
    overrides = [
        o.format(**fill)
        for o in (*(() if setting.save else BENCH_OVERRIDES), *setting.overrides)
        if scale == "gpu" or o not in setting.gpu_only
    ]
    # A calibration run's departures from the planner (recorded with the run's job).
    overrides += os.environ.get("BENCH_EXTRA_OVERRIDES", "").split()
    return {
        "name": f"bench-{setting.name}",
        "model_path": assets["model"],
        "train_files": assets["train"],
        "val_files": assets["test"],
        "total_steps": steps,
        "save_freq": steps,  # a job must save; BENCH_OVERRIDES turns it off for the bench
        "prompt_length": assets["prompt_length"],
        "response_length": assets["response_length"],
        "profile": setting.profile if scale == "gpu" else "cpu",
        # one card, as every result so far (a job's default, all, follows the machine)
        "gpus": 1,
        **job,
        "overrides": overrides,
    }


def gpu_profile_env(setting: Setting, scale: str) -> dict[str, str]:
    """On the GPU, for a profile other than pascal: the card `job command` plans against
    (bench/setup.sh's engine wrapper reads BENCH_SMI_FILE) and verl patched for that
    profile (setup.sh patches a copy of the carry's pascal tree: verl-tree-<profile>)."""
    if scale != "gpu" or setting.profile == GUARD_PROFILE:
        return {}
    tree = HOME / "env" / f"verl-tree-{setting.profile}"
    return {"BENCH_SMI_FILE": str(PROFILE_SMI[setting.profile]), "VERL_DIR": str(tree)}


def assets_for(kind: str) -> dict[str, Any]:
    """The kind's assets, built in a child process when missing: its CUDA context (612 MiB
    on the H100, 2026-12-06) is gone before the run, which the card-wide peak counts."""
    if not (HOME / "assets" / kind / "assets.json").exists():
        run_checked([PYTHON, __file__, "assets", "--kind", kind], dict(os.environ), "assets")
    return build_assets(kind, HOME)  # the complete one, read back


def prepare(name: str, steps: int, out: Path, scale: str) -> dict[str, Any]:
    """Write the run's job (spec, env file) and what the start script will run."""
    setting = SETTINGS[name]
    missing = missing_fields(setting)
    if missing:
        raise SystemExit(
            f"setting {name} needs the job fields {', '.join(missing)}, which this engine "
            "does not have yet (oldgpu job fields)"
        )
    kind = "smoke" if scale == "smoke" else setting.kind
    assets = assets_for(kind)
    spec = job_spec(setting, steps, scale, assets)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "guard.jsonl", "train.log", "result.json", "job.env"):
        (out / stale).unlink(missing_ok=True)
    shutil.rmtree(out / "state", ignore_errors=True)  # resume_mode=auto: start afresh
    (out / "job.json").write_text(json.dumps(spec, indent=1) + "\n")
    # run by this script, not verl-train@.service: its sandbox's path checks do not apply
    env_text = engine("job", "env", "--outside-unit", str(out / "job.json"))
    (out / "job.env").write_text(env_text)
    state = out / "state"
    composed = json.loads(
        engine(
            "job", "command", "--env-file", str(out / "job.env"), "--json",
            env={"STATE_DIRECTORY": str(state), **gpu_profile_env(setting, scale)},
        )
    )  # fmt: skip
    env = {
        "VERL_JOB_ENV_FILE": str(out / "job.env"),
        "STATE_DIRECTORY": str(state),
        # verl-train copies its output to LOGS_DIRECTORY/<job>.log when that directory
        # exists; it does not: train.log already holds the same lines.
        "LOGS_DIRECTORY": str(out / "verl-log"),
        **guard.environment(setting.profile, str(out / "guard.jsonl")),
        "OLDGPU_GUARD_OPS_STEPS": str(report.ops_steps(composed["argv"])),
        **gpu_profile_env(setting, scale),
    }
    if setting.guard_dtype:
        env["OLDGPU_GUARD_DTYPE"] = setting.guard_dtype
    env.update(setting.env)
    if os.environ.get("BENCH_MEMORY_PHASES") == "1":
        # The peak per verl phase (guard/phases.py): a calibration run, not a timed one.
        env["OLDGPU_GUARD_MEMORY_PHASES"] = "1"
    if scale != "gpu":
        env["OLDGPU_GUARD_DEVICE"] = "cpu"  # watch the CPU tensors: the fp32 path there
    return {
        "setting": name,
        "what": setting.what,
        "scale": scale,
        "kind": kind,
        "steps": steps,
        "assets": assets,
        "job": spec,
        "env_file": env_text,
        "composed": composed,
        "argv": composed["argv"],
        "start": [str(VERL_TRAIN), DOCTOR_FLAG],
        "env": env,
        # the tree's logits patch set on (the projection counts the lm_head over the
        # response's positions) or switched off (verl's own: every position)
        "response_logits": env.get("OLDGPU_RESPONSE_LOGITS", "on") != "off",
    }


def shell_line(run: dict[str, Any]) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in run["env"].items())
    composed = run["composed"]
    return "\n".join(
        [
            f"# job {run['job']['name']}: {run['what']} ({run['scale']})",
            *(f"#   {line}" for line in run["env_file"].splitlines()[1:]),
            f"env {env} " + " ".join(shlex.quote(a) for a in run["start"]),
            f"# verl-train runs (oldgpu job command; profile {composed['profile']}, "
            f"{composed['memory_mib']} MiB):",
            *(f"#   {k}={shlex.quote(v)}" for k, v in composed["environment"].items()),
            "#   $VERL_VENV/bin/python " + " ".join(shlex.quote(a) for a in run["argv"]),
        ]
    )


DOCTOR_FAILED = re.compile(r"the doctor's preflight failed \(exit (\d+)\)")
VERL_STARTED = re.compile(r"^verl-train: \S+ -m verl\.trainer\.")


def doctor_outcome(log: str) -> str:
    failed = DOCTOR_FAILED.search(log)
    started = any(VERL_STARTED.match(line) for line in log.splitlines())
    if failed:
        how = f"ran past it ({DOCTOR_FLAG})" if started else "not started"
        return f"failed (exit {failed.group(1)}), {how}"
    return "passed" if started else "not reached"


def session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` (verl-train, then verl, and what it started:
    Ray's raylet, GCS and workers), read from /proc."""
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


class DeviceMemory:
    """The GPU's memory in use, device-wide, every second (nvidia-smi): every process of
    the run counts (a newer release's rollout server is a second process beside the
    trainer's, each under its own guard cap), as on the P40 they would share 24 GiB."""

    QUERY = ("nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0")
    APPS = ("nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")

    def __init__(self) -> None:
        self.samples: list[int] = []
        self.processes = 0
        # each process's MiB (nvidia-smi's compute apps) at the largest sample
        self.at_peak: list[dict[str, Any]] = []
        # What an earlier process (the setup's, the last run's Ray workers) still holds is
        # let go first, for up to 20 s: the peak is this run's.
        end = time.time() + 20
        self.baseline = self._used()
        while self.baseline and self.baseline > 100 and time.time() < end:
            time.sleep(1)
            self.baseline = self._used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _used(self) -> int | None:
        try:
            out = subprocess.run(self.QUERY, capture_output=True, text=True, timeout=10).stdout
            return int(out.split()[0])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            used = self._used()
            apps: list[dict[str, Any]] = []
            with contextlib.suppress(OSError, ValueError, subprocess.TimeoutExpired):
                out = subprocess.run(self.APPS, capture_output=True, text=True, timeout=10)
                for line in out.stdout.strip().splitlines():
                    pid, mib = (x.strip() for x in line.split(","))
                    apps.append({"pid": int(pid), "mib": int(mib), "name": _comm(int(pid))})
            self.processes = max(self.processes, len(apps))
            if used is not None:
                if not self.samples or used > max(self.samples):
                    self.at_peak = apps
                self.samples.append(used)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def record(self) -> dict[str, Any]:
        return {
            "device_used_peak_mib": max(self.samples) if self.samples else None,
            "device_used_baseline_mib": self.baseline,
            "device_samples": len(self.samples),
            "device_processes_max": self.processes,
            "device_processes_at_peak": self.at_peak,
        }


def _comm(pid: int) -> str:
    """A process's name as Ray sets it (``ray::WorkerDict...``), else its command."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return "?"
    return cmd[:80]


def checkpoint_record(root: Path) -> dict[str, Any] | None:
    """What the job saved: the tracker's step, and whether that step is complete as the
    start script judges it (its data.pt, written after the models, and the actor's)."""
    if not root.is_dir():
        return None
    tracker = root / "latest_checkpointed_iteration.txt"
    step = tracker.read_text().strip() if tracker.exists() else None
    done = root / f"global_step_{step}" if step else None
    return {
        "tracker": step,
        "steps": sorted(p.name for p in root.glob("global_step_*")),
        "complete": bool(done and (done / "data.pt").is_file() and (done / "actor").is_dir()),
        "actor_files": sorted(p.name for p in (done / "actor").iterdir())[:20]
        if done and (done / "actor").is_dir()
        else [],
    }


def execute(run: dict[str, Any], out: Path, deadline: float | None) -> dict[str, Any]:
    (out / "command.txt").write_text(shell_line(run) + "\n")
    (out / "run.json").write_text(json.dumps(run, indent=1))
    t0 = time.time()
    first_step_at = None
    steps: list[dict[str, Any]] = []
    with (out / "train.log").open("w") as log, (out / "metrics.jsonl").open("w") as metrics:
        proc = subprocess.Popen(
            run["start"],
            cwd=out,
            env={**os.environ, **run["env"]},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own session: a timeout ends all of it
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
        sampler = DeviceMemory() if run["scale"] == "gpu" else None
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            m = report.parse_step(line)
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
                    f"score {m.get('critic/score/mean', float('nan')):.4f}" + report.scaler_text(m),
                    file=sys.stderr,
                    flush=True,
                )
        rc = proc.wait()
        if sampler:
            sampler.stop()
        end_session(proc.pid, log)  # what Ray left behind
        (out / "session.pid").unlink(missing_ok=True)
    result = report.summarize(run, steps, out)
    plan_file = out / "state" / "plan.json"
    started = json.loads(plan_file.read_text()) if plan_file.exists() else None
    text = (out / "train.log").read_text(errors="replace")
    result.update(
        rc=rc,
        timed_out=timed_out.is_set(),
        wall_s=round(time.time() - t0, 1),
        first_step_wall_s=first_step_at,
        # verl-train composed its command itself; it must be the one recorded before.
        ran_job_command=bool(started and started["argv"] == run["argv"]),
        doctor=doctor_outcome(text),
        verl_version=(run.get("composed") or {}).get("verl_version"),
        checkpoint=checkpoint_record(out / "state" / "checkpoints"),
    )
    if sampler:
        result.update(sampler.record())
    if rc and not steps:
        result["log_tail"] = text.splitlines()[-40:]
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


# -- CLI ----------------------------------------------------------------------------------


def settings_text() -> str:
    lines = []
    for s in SETTINGS.values():
        missing = missing_fields(s)
        state = f"needs job fields {', '.join(missing)}" if missing else "ready"
        lines.append(f"{s.name:16} {s.kind:11} {state}: {s.what}")
        if s.job:
            lines.append(f"{'':16} job: {json.dumps(s.job)}")
        if s.overrides:
            lines.append(f"{'':16} overrides: {' '.join(s.overrides)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("settings")
    p = sub.add_parser("assets")
    p.add_argument("--kind", choices=sorted(KINDS), default="bench")
    for name in ("command", "run"):
        p = sub.add_parser(name)
        p.add_argument("setting", choices=sorted(SETTINGS))
        scale = p.add_mutually_exclusive_group()
        scale.add_argument("--smoke", action="store_true", help="CPU, the smoke model")
        scale.add_argument("--cpu", action="store_true", help="CPU, the setting's model")
        if name == "command":
            p.add_argument("--steps", type=int, default=5)
            p.add_argument("--out", type=Path, help="default BENCH_HOME/commands/SETTING")
        else:
            p.add_argument("--steps", type=int, required=True)
            p.add_argument("--out", type=Path, required=True, help="the run's directory")
            p.add_argument("--deadline", type=float, help="epoch seconds: stop the run by then")
            p.add_argument("--no-guard", action="store_true", help="without the guard (compare)")
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
    if args.cmd == "settings":
        print(settings_text())
    elif args.cmd == "assets":
        print(json.dumps(build_assets(args.kind, HOME), indent=1))
    elif args.cmd in ("command", "run"):
        scale = "smoke" if args.smoke else ("cpu" if args.cpu else "gpu")
        out = args.out or HOME / "commands" / args.setting
        run = prepare(args.setting, args.steps, out, scale)
        if args.cmd == "command":
            print(shell_line(run))
            return
        if args.no_guard:
            run["env"] = {k: v for k, v in run["env"].items() if not k.startswith("OLDGPU_GUARD")}
        print(f"[bench] {shell_line(run)[:1500]} ...", file=sys.stderr)
        result = execute(run, args.out, args.deadline)
        keys = ("setting", "rc", "timed_out", "steps_done", "first_step_wall_s", "wall_s")
        keys += ("tokens_per_s", "s_per_step", "peak_allocated_gb", "peak_reserved_gb")
        keys += ("guard_ok", "ran_job_command", "doctor", "score_first5", "score_last5")
        keys += ("learned", "grad_scale_last", "skipped_steps", "skipped_after_step_2")
        print("[bench] result " + json.dumps({k: result.get(k) for k in keys}))
        if not result["guard_ok"]:
            print(f"[bench] guard: {json.dumps(result['guard'])[:1500]}", file=sys.stderr)
        if result.get("log_tail"):
            print("\n".join(result["log_tail"]), file=sys.stderr)
        sys.exit(0 if result["steps_done"] else 1)
    elif args.cmd == "summary":
        print(report.summary(args.runs))
    elif args.cmd == "merge":
        print(report.merge_calls(args.bench_json, args.runs))
    else:
        for f in report.export(args.runs, args.dest, args.setup):
            print(f"{f} {f.stat().st_size} bytes")


if __name__ == "__main__":
    main()
