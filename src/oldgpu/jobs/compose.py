"""Composing a job's run: the profile, the plan, verl's overrides and argv, the environment.

Everything derived from the host — the profile of the GPUs fitted now, the
planner's batch sizes and offload, the cards and NCCL's settings — is decided
here when the job starts, so a card swap needs no re-provisioning.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from oldgpu import detect, devices, fleet, paths, profile, recipe, topology, verl_release
from oldgpu import plan as planner
from oldgpu.guard.policy import ENV_STORAGE_DTYPES
from oldgpu.jobs import batches
from oldgpu.jobs.settings import CONFIG_INVALID, Job, invalid, profile_name
from oldgpu.output import EngineError
from oldgpu.plan import spelling
from oldgpu.rollout import settings as rollout_settings


def resolve_profile(job: Job, gpus: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The job's forced profile, else the one of the GPUs fitted now; with the job's
    rollout and dtype choices applied."""
    if job.profile:
        arch, cc = profile_name(job.profile)
        return with_choices(job, profile.profile_for_arch(arch, cc))
    if gpus is None:
        gpus = detect.detect()["gpus"]
    return with_choices(job, profile.profile_for_gpus(gpus))


def with_choices(job: Job, prof: Mapping[str, Any]) -> dict[str, Any]:
    """The profile with the job's ``rollout``/``compute_dtype`` (the profile refuses what
    the card cannot do; a config error: restarting will not help)."""
    try:
        return profile.with_choices(prof, job.rollout, job.compute_dtype)
    except EngineError as exc:
        raise invalid(exc.message) from None


def plan_inputs(
    job: Job,
    prof: Mapping[str, Any],
    memory_mib: int,
    model_config: Mapping[str, Any],
    gpus: int | None = None,
) -> planner.Inputs:
    """The planner's inputs; ``gpus`` is the count of the chosen cards (FSDP shards over them)."""
    version = job.verl_version or verl_release.default()
    return planner.Inputs(
        memory_mib=int(memory_mib),
        gpus=_gpu_count(job, prof) if gpus is None else gpus,
        shape=planner.shape_from_config(model_config),
        prompt_length=job.prompt_length,
        response_length=job.response_length,
        compute_dtype=prof["compute_dtype"],
        rollout=prof["rollout"],
        device=prof["device"],
        target_train_batch=job.train_batch_size or None,
        model_name=job.model_path,
        profile_name=prof["name"],
        interface=spelling.JOB,  # a refusal names the job's settings, not plan's flags
        **verl_release.plan_fields(version),
        # The recipe, validated by the planner (it owns which estimator has a critic).
        **planner.recipe_fields(
            algorithm=job.algorithm,
            rollout_n=job.rollout_n,
            lora_rank=job.lora_rank,
            lora_alpha=job.lora_alpha,
            lora_target_modules=job.lora_target_modules,
            ref=recipe.needs_ref(job),
            base_dtype=verl_release.plan_base_dtype(version, job.base_dtype),
        ),
    )


CUDA = {"device": "cuda"}  # a caller that names no profile


def _gpu_count(job: Job, prof: Mapping[str, Any]) -> int:
    """The job's count when no cards were chosen (``all`` needs the host's cards; the cpu
    profile plans one worker)."""
    if job.gpus == "all" and prof["device"] == "cpu":
        return 1
    if job.gpus == "all":
        raise EngineError(
            "gpus-all-needs-host",
            "gpus: all counts this host's GPUs; compose it with the host's facts",
            code=CONFIG_INVALID,
        )
    return int(job.gpus)


def override_key(override: str) -> str:
    """The config key an override sets (``+a.b=1`` -> ``a.b``)."""
    return override.lstrip("~+").split("=", 1)[0]


def merge_overrides(*groups: Iterable[str]) -> list[str]:
    """One override per key (Hydra refuses repeats): the last one wins, in its own position.

    A key set again moves to where it was set last: ``[a=1, b=2], [a=3]`` gives ``[b=2, a=3]``.
    """
    merged: dict[str, str] = {}
    for group in groups:
        for item in group:
            key = override_key(item)
            merged.pop(key, None)
            merged[key] = item
    return list(merged.values())


def job_overrides(
    job: Job,
    paths: Mapping[str, Path],
    gpus: int | None = None,
    nnodes: int = 1,
    prof: Mapping[str, Any] | None = None,
) -> list[str]:
    """What the job itself decides: data, model, schedule, logging, resume."""
    critic = []
    if recipe.uses_critic(job.algorithm):
        critic = [
            f"critic.model.path={job.critic_model_path or job.model_path}",
            # The tokenizer is the actor's (verl reads it from critic.model.tokenizer_path).
            f"critic.model.tokenizer_path={job.model_path}",
        ]
    return [
        f"data.train_files={job.train_files}",
        f"data.val_files={job.val_files}",
        f"actor_rollout_ref.model.path={job.model_path}",
        *critic,
        f"trainer.total_training_steps={job.total_steps}",
        # verl stops at the end of total_epochs even short of the steps; every
        # epoch has a step, so this many never ends a job early.
        f"trainer.total_epochs={job.total_steps}",
        f"trainer.save_freq={job.save_freq}",
        f"trainer.test_freq={job.test_freq}",
        f"trainer.nnodes={nnodes}",
        f"trainer.n_gpus_per_node={_gpu_count(job, prof or CUDA) if gpus is None else gpus}",
        "trainer.project_name=verl",
        f"trainer.experiment_name={job.name}",
        "trainer.logger=['console','tensorboard']",
        f"trainer.default_local_dir={paths['checkpoints']}",
        "trainer.resume_mode=auto",
        # A unit restart must not spend minutes validating before it trains.
        "trainer.val_before_train=False",
    ]


def compose(
    job: Job,
    prof: Mapping[str, Any],
    memory_mib: int,
    model_config: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    cards: Sequence[int] | None = None,
    nccl: Mapping[str, str] | None = None,
    cluster: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The planner's choice and verl's argv for this job on this profile.

    ``cards`` are the chosen GPUs (``choose_devices``): their count is
    ``n_gpus_per_node`` and the planner's ``gpus``, and the job sees only them.
    None (the cpu profile, or a caller without the host's facts): the job's own
    count, and no CUDA variables. ``nccl`` is the topology's NCCL settings.
    ``cluster`` (``fleet.check_cluster``'s nnodes and n_gpus_per_node): the job
    joins the Ray cluster at ``job.cluster_address``; FSDP shards over all its GPUs.
    """
    paths = job.paths(environ)
    version = job.verl_version or verl_release.default()
    try:
        verl_release.check_job(version, prof, job.cluster)
    except EngineError as exc:
        raise EngineError(exc.name, exc.message, code=CONFIG_INVALID) from None
    count = None if cards is None else len(cards)
    nnodes = 1
    if cluster is not None:
        nnodes, count = cluster["nnodes"], cluster["n_gpus_per_node"]
    # FSDP shards over every GPU of every node. The cpu profile plans one worker
    # in one host's memory: each node has its own.
    world = None if count is None else count * (nnodes if prof["device"] == "cuda" else 1)
    found = planner.plan(plan_inputs(job, prof, memory_mib, model_config, world))
    plan_doc = planner.payload(found)
    plan_overrides = plan_doc["hydra_overrides"]
    if cluster is not None and prof["device"] != "cuda":
        plan_overrides = per_worker_micro_batches(plan_overrides, count * nnodes, job.rollout_n)
    # The planner, the recipe and a job written for 0.5.0 use 0.5.0's keys; the release
    # renames what moved.
    merged = merge_overrides(
        verl_release.profile_overrides(version, prof, verl_release.host_cpus()),
        verl_release.translate(version, plan_overrides),
        job_overrides(job, paths, count, nnodes, prof),
        verl_release.translate(version, recipe.overrides(job, prof)),
        verl_release.translate(version, job.overrides),
    )
    merged = merge_overrides(merged, verl_release.old_log_probs(version, prof, merged))
    argv = ["-m", "verl.trainer.main_ppo", *merged]
    batches.check(job.name, argv)
    try:
        rollout_settings.check_overrides(argv)
    except rollout_settings.RolloutSettingInvalid as exc:
        raise invalid(f"job {job.name}: {exc}") from None
    env = {
        **environment(job, prof, paths),
        **storage_environment(plan_doc),
        **verl_release.environment(version, prof, os.environ if environ is None else environ),
        **({} if cards is None else devices.visible_devices_env(cards)),
        **(nccl or {}),
    }
    if cluster is not None:
        env = cluster_environment(job, env)
    return {
        "job": job.name,
        "profile": prof["name"],
        "verl_version": version,
        "memory_mib": int(memory_mib),
        "paths": {k: str(v) for k, v in paths.items()},
        "plan": plan_doc,
        "argv": argv,
        "devices": None if cards is None else list(cards),
        "cluster": None if cluster is None else {"address": job.cluster_address, **cluster},
        "environment": env,
    }


def per_worker_micro_batches(overrides: Sequence[str], world: int, rollout_n: int) -> list[str]:
    """The cpu profile's plan (one worker in one host's memory) for ``world`` workers.

    verl divides each mini batch over the workers and asserts that a worker's
    share divides by its micro batch: the micro batches become divisors of
    that share (smaller, so they fit the memory the plan was made for).
    """
    values = dict(o.split("=", 1) for o in overrides)
    out = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key.endswith("micro_batch_size_per_gpu"):
            owner = "critic" if key.startswith("critic.") else "actor_rollout_ref.actor"
            mini = int(values.get(f"{owner}.ppo_mini_batch_size", value))
            share = max(1, mini * rollout_n // world)  # verl: mini x n / workers
            item = f"{key}={math.gcd(int(value), share)}"
        out.append(item)
    return out


def cluster_environment(job: Job, env: Mapping[str, str]) -> dict[str, str]:
    """A cluster job's environment: verl's ray.init joins the cluster (RAY_ADDRESS), and
    Ray hands the job's variables to every worker on every node as the job's runtime
    env (RAY_JOB_CONFIG_JSON_ENV_VAR, which ray.init merges with verl's own; verl
    0.5.0 has no config key for it)."""
    verl_dir = os.environ.get("VERL_DIR", str(paths.VERL_DIR))
    # The job's state paths are the same on every node (the ray units may write
    # under the jobs' state directory); Ray's session directory is each node's own.
    workers = {k: v for k, v in env.items() if k != "RAY_TMPDIR"}
    workers["PYTHONPATH"] = verl_dir
    runtime = {"runtime_env": {"env_vars": dict(sorted(workers.items()))}}
    return {
        **env,
        # The driver attaches to the head's session (ray-head.service's --temp-dir).
        "RAY_TMPDIR": str(paths.DATA_DIR / "ray"),
        "RAY_ADDRESS": job.cluster_address,
        "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(runtime, separators=(",", ":")),
    }


def environment(job: Job, prof: Mapping[str, Any], paths: Mapping[str, Path]) -> dict[str, str]:
    """What the start script exports before Python (and Ray's workers) start."""
    env = {
        "HYDRA_FULL_ERROR": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TENSORBOARD_DIR": str(paths["tensorboard"]),
        "HF_HOME": str(paths["cache"] / "huggingface"),
        "XDG_CACHE_HOME": str(paths["cache"]),
        "OLDGPU_COMPUTE_DTYPE": prof["compute_dtype"],
        "OLDGPU_ATTN_IMPLEMENTATION": prof["attn_implementation"],
        # vLLM's engine and attention backend below CC 8.0 (none for the HF rollout).
        **prof.get("rollout_environment", {}),
        # Ray's session files in the unit's private /tmp: one per job, gone when it stops.
        "RAY_TMPDIR": "/tmp/ray",
        # Every worker's line in the journal as it is printed, without terminal colour
        # codes: verl's step metrics come from a Ray actor, whose block-buffered stdout
        # a stop or a crash would otherwise lose.
        "PYTHONUNBUFFERED": "1",
        "RAY_DEDUP_LOGS": "0",
        "RAY_COLOR_PREFIX": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    if prof["device"] == "cuda":
        # Fewer unusable fragments when offload moves tensors in and out.
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def storage_environment(plan_doc: Mapping[str, Any]) -> dict[str, str]:
    """A LoRA base the plan stores at 16 bits: the P40 guard (a GPU proof's) lets the job
    store and convert that dtype, and still refuses any arithmetic in it."""
    base = plan_doc["inputs"].get("lora", {}).get("base_dtype", "fp32")
    return {ENV_STORAGE_DTYPES: base} if base in ("bf16", "fp16") else {}


def _memory_mib(prof: Mapping[str, Any], gpus: Sequence[Mapping[str, Any]]) -> int:
    if prof["device"] == "cpu":
        available = planner._host_available_mib()
        if not available:
            raise invalid("cannot read MemAvailable from /proc/meminfo for the cpu profile")
        return available
    sizes = [g.get("memory_mib") for g in gpus]
    if not sizes or not all(sizes):
        raise invalid("cannot tell the GPUs' memory; is the driver loaded?")
    return min(sizes)


def _model_config(job: Job) -> dict[str, Any]:
    path = Path(job.model_path) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise invalid(f"model_path: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise invalid(f"model_path: {path} is not JSON: {exc}") from None


def compose_for_host(
    job: Job,
    environ: Mapping[str, str] | None = None,
    args: argparse.Namespace | None = None,
) -> dict[str, Any]:
    """``compose`` with this host's facts: the job's cards (one profile's, unless the
    job's profile is cpu), their profile and memory or the host's, the topology
    between the cards, the model's config."""
    args = args or argparse.Namespace()
    cards: list[int] | None = None
    nccl: dict[str, str] = {}
    cluster: dict[str, int] | None = None
    try:
        if job.profile == "cpu":
            gpus: list[Mapping[str, Any]] = []
        else:
            gpus = detect.detect_from_args(args)["gpus"]
        if not gpus and not job.profile:
            # As `oldgpu plan`: a host without a detected GPU never trains on its CPU
            # unless the job says so.
            raise EngineError(
                "job-no-gpu",
                "no NVIDIA GPU detected on this host: set profile: cpu to train on the CPU, "
                "or run oldgpu doctor to see why the GPUs are not found",
                code=CONFIG_INVALID,
            )
        prof = resolve_profile(job, gpus)
        if prof["device"] == "cuda" and not gpus:
            raise invalid(f"profile {prof['name']} needs a GPU and none was detected")
        if job.cluster:
            # The live cluster, checked before verl starts: its nodes, their GPUs,
            # and that every node runs this host's tree and lock.
            recorded = getattr(args, "cluster_nodes_file", None)
            live = fleet.read_nodes(recorded) if recorded else fleet.live_nodes(job.cluster_address)
            per_node = None if job.gpus == "all" else int(job.gpus)
            cluster = fleet.check_cluster(live, per_node, job.cluster_nodes, fleet.facts(gpus))
            if prof["device"] == "cuda":
                # This host's cards of the job's count: the profile, memory and
                # NCCL's settings (the nodes are boxes of one kind: equal counts,
                # checked above). Ray gives each worker its card on its node.
                local = devices.choose_devices(
                    gpus,
                    devices.gpu_profiles(gpus),
                    cluster["n_gpus_per_node"],
                    list(job.devices) or None,
                    profile=job.profile or None,
                )
                gpus = [g for g in gpus if g["index"] in local]
                if len(local) > 1:
                    nccl = _nccl_env(local, args)
        elif prof["device"] == "cuda":
            cards = devices.choose_devices(
                gpus,
                devices.gpu_profiles(gpus),
                job.gpus,
                list(job.devices) or None,
                profile=job.profile or None,
            )
            gpus = [g for g in gpus if g["index"] in cards]
            if not job.profile:
                prof = with_choices(job, profile.profile_for_gpus(gpus))
            if len(cards) > 1:
                nccl = _nccl_env(cards, args)
        for key in ("train_files", "val_files"):
            if not Path(getattr(job, key)).exists():
                raise invalid(f"{key}: {getattr(job, key)} does not exist")
        return compose(
            job, prof, _memory_mib(prof, gpus), _model_config(job), environ, cards, nccl, cluster
        )
    except EngineError as exc:
        if exc.code in (CONFIG_INVALID, fleet.CLUSTER_NOT_READY) or exc.name.startswith(
            "topology-"
        ):
            raise
        # The planner refusing (does not fit), or the host lacking the cards the job
        # asks for, is a config error too: restarting won't help.
        raise EngineError(exc.name, exc.message, code=CONFIG_INVALID) from None


def _nccl_env(cards: Sequence[int], args: argparse.Namespace) -> dict[str, str]:
    """NCCL's settings for a job on several cards, from the host's topology
    (or the recorded ``--topo-file``/``--p2p-file``/``--ib-dir``)."""
    given = argparse.Namespace(
        topo_file=getattr(args, "topo_file", None),
        p2p_file=getattr(args, "p2p_file", None),
        gpus=",".join(map(str, cards)),
        ib_file=None,
        ib_dir=getattr(args, "ib_dir", None) or topology.IB_DIR,
    )
    return dict(topology.from_args(given)["nccl_env"])
