"""``oldgpu job``: one training job's settings, and the verl command they make.

A job is declared once (Ansible's ``verl_jobs`` or the NixOS module's
``services.verl-train.jobs``) and lands on the host as ``/etc/verl/jobs/<name>.env``:
only what the user chose. Everything derived — the profile of the GPUs fitted
now, the planner's batch sizes and offload — is decided here when the job
starts, so a card swap needs no re-provisioning.

``FIELDS`` is the one list of job settings; the role's argument specs and the
Nix module's options are tested against it. The env file format is
``KEY='value'`` per line: systemd's EnvironmentFile= and a shell's ``.`` read it
alike, so values may hold neither a quote nor a newline.

Exit codes the unit's RestartPreventExitStatus= names: 3, the doctor's
preflight failed (``oldgpu.doctor.DOCTOR_FAILED``); 4, this job's settings are
invalid (``CONFIG_INVALID``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oldgpu import detect, devices, paths, profile, recipe, subcommand, topology
from oldgpu import plan as planner
from oldgpu.output import EngineError, Result

CONFIG_INVALID = 4

# Where jobs live on a host (oldgpu.paths owns them; the unit names them too).
JOBS_DIR = paths.JOBS_DIR
STATE_DIR = paths.STATE_DIR
LOG_DIR = paths.LOG_DIR
ENV_PREFIX = "VERL_JOB_"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
# What may not appear in a value of the env file (see the module docstring).
FORBIDDEN = ("'", "\n", "\r", "\\")


@dataclass(frozen=True)
class Field:
    name: str  # as in the inventory / Nix option
    kind: str  # str, path, int, float, list, bool; count (an int or "all"), indices (ints)
    default: Any
    help: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


REQUIRED = object()

# fmt: off
FIELDS: tuple[Field, ...] = (
    Field("name", "str", REQUIRED, "the job's name: the unit is verl-train@<name>"),
    Field("model_path", "path", REQUIRED, "a local model directory (config.json, weights, tokenizer)"),  # noqa: E501
    Field("critic_model_path", "path", "", "the critic's model directory (default: model_path)"),
    Field("train_files", "path", REQUIRED, "training parquet in verl's layout (oldgpu data)"),
    Field("val_files", "path", REQUIRED, "validation parquet"),
    Field("data_source", "str", "openai/gsm8k", "the data_source rows carry; picks verl's reward"),
    Field("total_steps", "int", REQUIRED, "trainer.total_training_steps"),
    Field("save_freq", "int", 10, "checkpoint every N steps (resume continues from the last)"),
    Field("test_freq", "int", -1, "validate every N steps (-1: never)"),
    Field("gpus", "count", 1, "GPUs for this job: a number, or all (the cards of one profile)"),
    Field("devices", "indices", [], "the GPUs (nvidia-smi indices) to run on (empty: the engine chooses)"),  # noqa: E501
    Field("prompt_length", "int", 256, "data.max_prompt_length (the planner's input)"),
    Field("response_length", "int", 256, "data.max_response_length (the planner's input)"),
    Field("train_batch_size", "int", 0, "a train batch to plan for (0: the planner chooses)"),
    Field("algorithm", "str", recipe.DEFAULT_ALGORITHM, "advantage estimator: " + ", ".join(recipe.ALGORITHMS) + " (only gae trains a critic)"),  # noqa: E501
    Field("rollout_n", "int", 1, "responses sampled per prompt (grpo, rloo: at least 2)"),
    Field("kl_loss_coef", "float", 0.001, "KL-to-reference loss; on for the critic-free algorithms (0: off)"),  # noqa: E501
    Field("lora_rank", "int", 0, "LoRA adapters of this rank on the actor (0: full fine-tuning)"),
    Field("lora_alpha", "int", 0, "LoRA alpha (0: twice lora_rank)"),
    Field("lora_target_modules", "list", [], "modules LoRA adapts, e.g. [q_proj, v_proj] (empty: all-linear)"),  # noqa: E501
    Field("profile", "str", "", "a profile to use instead of the detected one (cpu, pascal, ...)"),
    Field("overrides", "list", [], "extra Hydra overrides, applied last"),
    Field("enabled", "bool", True, "start the job at boot"),
)
# fmt: on
FIELD_BY_NAME = {f.name: f for f in FIELDS}
# ``enabled`` is systemd's business (the unit's enablement), not the job's env.
ENV_FIELDS = tuple(f for f in FIELDS if f.name != "enabled")


def _invalid(message: str) -> EngineError:
    return EngineError("job-config-invalid", message, code=CONFIG_INVALID)


def _check_value(field: Field, value: str) -> None:
    for bad in FORBIDDEN:
        if bad in value:
            raise _invalid(f"{field.name}: {value!r} holds {bad!r}, which an env file cannot")


@dataclass(frozen=True)
class Job:
    name: str
    model_path: str
    critic_model_path: str
    train_files: str
    val_files: str
    data_source: str
    total_steps: int
    save_freq: int
    test_freq: int
    gpus: int | str
    devices: tuple[int, ...]
    prompt_length: int
    response_length: int
    train_batch_size: int
    algorithm: str
    rollout_n: int
    kl_loss_coef: float
    lora_rank: int
    lora_alpha: int
    lora_target_modules: tuple[str, ...]
    profile: str
    overrides: tuple[str, ...]

    # Where its state lives: systemd's StateDirectory= (STATE_DIRECTORY), else the default.
    def state_dir(self, environ: Mapping[str, str] | None = None) -> Path:
        env = os.environ if environ is None else environ
        given = env.get("STATE_DIRECTORY", "").split(":")[0]
        return Path(given) if given else STATE_DIR / self.name

    def paths(self, environ: Mapping[str, str] | None = None) -> dict[str, Path]:
        state = self.state_dir(environ)
        return {
            "state": state,
            "checkpoints": state / "checkpoints",
            "tensorboard": state / "tensorboard",
            "cache": state / "cache",
            "plan": state / "plan.json",
        }


def job_from_mapping(values: Mapping[str, Any]) -> Job:
    """A job from inventory-style values (``name``, ``model_path``, ...), validated."""
    if not isinstance(values, Mapping):
        raise _invalid(f"a job is a JSON object of settings, not {type(values).__name__}")
    unknown = sorted(set(values) - set(FIELD_BY_NAME))
    if unknown:
        raise _invalid(f"unknown job settings: {', '.join(unknown)}")
    out: dict[str, Any] = {}
    for field in ENV_FIELDS:
        value = values.get(field.name, field.default)
        if value is REQUIRED or (value in ("", None) and field.default is REQUIRED):
            raise _invalid(f"{field.name} is required ({field.help})")
        if field.kind == "int":
            value = _integer(field, value)
        elif field.kind == "count":
            value = _count(field, value)
        elif field.kind == "indices":
            value = _indices(field, value)
        elif field.kind == "float":
            value, problem = recipe.parse_float(field.name, value)
            if problem:
                raise _invalid(problem)
        elif field.kind == "list":
            if not isinstance(value, list | tuple) or not all(
                isinstance(v, str | int | float) and not isinstance(v, bool) for v in value
            ):
                raise _invalid(f"{field.name}: expected a list of strings, got {value!r}")
            value = tuple(str(v) for v in value)
            for item in value:
                _check_value(field, item)
                if '"' in item:  # JSON would escape it with a backslash
                    raise _invalid(
                        f"{field.name}: {item!r} holds a double quote; Hydra takes unquoted values"
                    )
        else:
            value = str(value)
            _check_value(field, value)
            if field.kind == "path" and value and not value.startswith("/"):
                raise _invalid(f"{field.name}: {value!r} is not an absolute path")
            if field.kind == "path" and _under(value, PROTECTED_HOME):
                raise EngineError(
                    "job-path-protected",
                    f"{field.name}: {value!r} is under {', '.join(PROTECTED_HOME)}, which the "
                    "unit cannot read (ProtectHome=); move it, e.g. under /var/lib/verl or /srv",
                    code=CONFIG_INVALID,
                )
        out[field.name] = value
    if not NAME_RE.match(out["name"]):
        raise _invalid(
            f"name: {out['name']!r} must be 1-32 of a-z 0-9 _ - (it names a unit and a directory)"
        )
    for key in ("total_steps", "prompt_length", "response_length"):
        if out[key] < 1:
            raise _invalid(f"{key}: {out[key]} must be at least 1")
    if out["save_freq"] < 1:
        raise _invalid(
            f"save_freq: {out['save_freq']} must be at least 1 (resume needs checkpoints)"
        )
    if out["train_batch_size"] < 0:
        raise _invalid("train_batch_size: must be 0 (planner chooses) or a batch size")
    for item in out["overrides"]:
        if "=" not in item and not item.startswith("~"):
            raise _invalid(f"overrides: {item!r} is not a Hydra override (key=value)")
    if out["profile"] and _profile_name(out["profile"])[0] not in profile.PROFILES:
        raise _invalid(f"profile: {out['profile']!r} is not one of {sorted(profile.PROFILES)}")
    if out["profile"]:
        try:  # what `job command` resolves; refused here so a unit never starts with it
            profile.profile_for_arch(*_profile_name(out["profile"]))
        except EngineError as exc:
            raise _invalid(f"profile: {exc.message}") from None
    for problem in recipe.problems(out):
        raise _invalid(problem)
    return Job(**out)


# systemd's ProtectHome= hides these from the unit (the job's model and data must not be there).
PROTECTED_HOME = ("/home", "/root", "/run/user")


def _under(path: str, roots: Sequence[str]) -> bool:
    normal = os.path.normpath(path)
    return any(normal == root or normal.startswith(root + "/") for root in roots)


def _integer(field: Field, value: Any) -> int:
    """An int, or a string or float that is exactly one (8.5 is refused, not truncated)."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise _invalid(f"{field.name}: {value!r} is not an integer")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise _invalid(f"{field.name}: {value!r} is not an integer") from None


def _count(field: Field, value: Any) -> int | str:
    """A GPU count: an integer of at least 1, or ``all``."""
    if value == "all":
        return "all"
    try:
        count = _integer(field, value)
    except EngineError:
        count = 0
    if count < 1:
        raise EngineError(
            "gpus-invalid",
            f"{field.name}: {value!r} is not a count of at least 1 or 'all'",
            code=CONFIG_INVALID,
        )
    return count


def _indices(field: Field, value: Any) -> tuple[int, ...]:
    """GPU indices as nvidia-smi numbers them: whole numbers, each once."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise EngineError(
            "devices-invalid",
            f"{field.name}: expected a list of GPU indices, got {value!r}",
            code=CONFIG_INVALID,
        )
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | str):
            item = None
        elif isinstance(item, str):
            item = int(item) if item.strip().isascii() and item.strip().isdigit() else None
        if item is None or item < 0:
            raise EngineError(
                "devices-invalid",
                f"{field.name}: {list(value)!r} is not a list of GPU indices",
                code=CONFIG_INVALID,
            )
        out.append(item)
    if len(set(out)) != len(out):
        raise EngineError(
            "devices-invalid", f"{field.name}: {out} names a GPU twice", code=CONFIG_INVALID
        )
    return tuple(out)


def _profile_name(name: str) -> tuple[str, str | None]:
    arch, _, cc = name.partition("-")
    return arch, cc or None


def render_env(job: Job) -> str:
    """The env file, as both front-ends write it (tests compare them with this)."""
    lines = [f"# verl training job {job.name}: read by verl-train@{job.name}.service"]
    for field in ENV_FIELDS:
        value = getattr(job, field.name)
        if field.kind in ("list", "indices"):
            text = json.dumps(list(value))
        elif field.kind == "float":
            text = recipe.format_float(value)
        else:
            text = str(value)
        lines.append(f"{field.env}='{text}'")
    return "\n".join(lines) + "\n"


def parse_env(text: str, source: str = "env file") -> dict[str, str]:
    """``KEY='value'`` lines (or unquoted, or double-quoted without escapes)."""
    env: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key.strip()):
            raise _invalid(f"{source}:{number}: not KEY=value: {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def job_from_env(env: Mapping[str, str]) -> Job:
    """A job from ``VERL_JOB_*`` variables (the unit's environment or a parsed env file)."""
    values: dict[str, Any] = {}
    for field in ENV_FIELDS:
        if field.env not in env:
            continue
        raw = env[field.env]
        if field.kind in ("list", "indices"):
            try:
                values[field.name] = json.loads(raw or "[]")
            except json.JSONDecodeError as exc:
                raise _invalid(f"{field.env}: not a JSON list of strings ({exc})") from None
            if not isinstance(values[field.name], list):
                raise _invalid(f"{field.env}: not a JSON list of strings")
        else:
            values[field.name] = raw
    return job_from_mapping(values)


def load_job(name: str, jobs_dir: Path = JOBS_DIR) -> Job:
    path = jobs_dir / f"{name}.env"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise _invalid(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise _invalid(f"{path}: not UTF-8 text ({exc.reason})") from None
    return job_from_env(parse_env(text, str(path)))


def job_names(jobs_dir: Path = JOBS_DIR) -> list[str]:
    try:
        return sorted(
            p.name[: -len(".env")]
            for p in jobs_dir.glob("*.env")
            if not p.name.endswith(".secrets.env")
        )
    except OSError:
        return []


# ---------------------------------------------------------------------------
# Composing the command.


def resolve_profile(job: Job, gpus: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The job's forced profile, else the one of the GPUs fitted now."""
    if job.profile:
        arch, cc = _profile_name(job.profile)
        return profile.profile_for_arch(arch, cc)
    if gpus is None:
        gpus = detect.detect()["gpus"]
    return profile.profile_for_gpus(gpus)


def plan_inputs(
    job: Job,
    prof: Mapping[str, Any],
    memory_mib: int,
    model_config: Mapping[str, Any],
    gpus: int | None = None,
) -> planner.Inputs:
    """The planner's inputs; ``gpus`` is the count of the chosen cards (FSDP shards over them)."""
    return planner.Inputs(
        memory_mib=int(memory_mib),
        gpus=_gpu_count(job) if gpus is None else gpus,
        shape=planner.shape_from_config(model_config),
        prompt_length=job.prompt_length,
        response_length=job.response_length,
        compute_dtype=prof["compute_dtype"],
        rollout=prof["rollout"],
        device=prof["device"],
        target_train_batch=job.train_batch_size or None,
        model_name=job.model_path,
        profile_name=prof["name"],
        # The recipe, validated by the planner (it owns which estimator has a critic).
        **planner.recipe_fields(
            algorithm=job.algorithm,
            rollout_n=job.rollout_n,
            lora_rank=job.lora_rank,
            lora_alpha=job.lora_alpha,
            lora_target_modules=job.lora_target_modules,
            ref=recipe.needs_ref(job),
        ),
    )


def _gpu_count(job: Job) -> int:
    """The job's count when no cards were chosen (``all`` needs the host's cards)."""
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


def job_overrides(job: Job, paths: Mapping[str, Path], gpus: int | None = None) -> list[str]:
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
        "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={_gpu_count(job) if gpus is None else gpus}",
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
) -> dict[str, Any]:
    """The planner's choice and verl's argv for this job on this profile.

    ``cards`` are the chosen GPUs (``choose_devices``): their count is
    ``n_gpus_per_node`` and the planner's ``gpus``, and the job sees only them.
    None (the cpu profile, or a caller without the host's facts): the job's own
    count, and no CUDA variables. ``nccl`` is the topology's NCCL settings.
    """
    paths = job.paths(environ)
    count = None if cards is None else len(cards)
    found = planner.plan(plan_inputs(job, prof, memory_mib, model_config, count))
    plan_doc = planner.payload(found)
    argv = [
        "-m",
        "verl.trainer.main_ppo",
        *merge_overrides(
            prof["hydra_overrides"],
            plan_doc["hydra_overrides"],
            job_overrides(job, paths, count),
            recipe.overrides(job, prof),
            job.overrides,
        ),
    ]
    return {
        "job": job.name,
        "profile": prof["name"],
        "memory_mib": int(memory_mib),
        "paths": {k: str(v) for k, v in paths.items()},
        "plan": plan_doc,
        "argv": argv,
        "devices": None if cards is None else list(cards),
        "environment": {
            **environment(job, prof, paths),
            **({} if cards is None else devices.visible_devices_env(cards)),
            **(nccl or {}),
        },
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
        # Ray's session files in the unit's private /tmp: one per job, gone when it stops.
        "RAY_TMPDIR": "/tmp/ray",
        # Every worker's line in the journal, without terminal colour codes.
        "RAY_DEDUP_LOGS": "0",
        "RAY_COLOR_PREFIX": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    if prof["device"] == "cuda":
        # Fewer unusable fragments when offload moves tensors in and out.
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def _memory_mib(prof: Mapping[str, Any], gpus: Sequence[Mapping[str, Any]]) -> int:
    if prof["device"] == "cpu":
        available = planner._host_available_mib()
        if not available:
            raise _invalid("cannot read MemAvailable from /proc/meminfo for the cpu profile")
        return available
    sizes = [g.get("memory_mib") for g in gpus]
    if not sizes or not all(sizes):
        raise _invalid("cannot tell the GPUs' memory; is the driver loaded?")
    return min(sizes)


def _model_config(job: Job) -> dict[str, Any]:
    path = Path(job.model_path) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise _invalid(f"model_path: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise _invalid(f"model_path: {path} is not JSON: {exc}") from None


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
    try:
        if job.profile == "cpu":
            gpus: list[Mapping[str, Any]] = []
        else:
            gpus = detect.detect_from_args(args)["gpus"]
        prof = resolve_profile(job, gpus)
        if prof["device"] == "cuda" and not gpus:
            raise _invalid(f"profile {prof['name']} needs a GPU and none was detected")
        if prof["device"] == "cuda":
            cards = devices.choose_devices(
                gpus,
                devices.gpu_profiles(gpus),
                job.gpus,
                list(job.devices) or None,
                profile=job.profile or None,
            )
            gpus = [g for g in gpus if g["index"] in cards]
            if not job.profile:
                prof = profile.profile_for_gpus(gpus)
            if len(cards) > 1:
                nccl = _nccl_env(cards, args)
        for key in ("train_files", "val_files"):
            if not Path(getattr(job, key)).exists():
                raise _invalid(f"{key}: {getattr(job, key)} does not exist")
        return compose(job, prof, _memory_mib(prof, gpus), _model_config(job), environ, cards, nccl)
    except EngineError as exc:
        if exc.code == CONFIG_INVALID or exc.name.startswith("topology-"):
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


def _read_job(args: argparse.Namespace) -> Job:
    if args.env_file:
        path = Path(args.env_file)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise _invalid(f"cannot read {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise _invalid(f"{path}: not UTF-8 text ({exc.reason})") from None
        return job_from_env(parse_env(text, str(path)))
    if args.name:
        return load_job(args.name, Path(args.jobs_dir))
    return job_from_env(os.environ)


def _command_text(doc: Mapping[str, Any]) -> str:
    lines = [f"job {doc['job']}: profile {doc['profile']}, memory {doc['memory_mib']} MiB"]
    lines += [f"  {k}={v}" for k, v in doc["environment"].items()]
    lines.append("  python " + " ".join(doc["argv"]))
    return "\n".join(lines)


def run_command(args: argparse.Namespace) -> Result:
    doc = compose_for_host(_read_job(args), args=args)
    if args.write_plan:
        target = Path(doc["paths"]["plan"])
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(target)
    if args.print0:
        # For the start script: the environment as NAME=value, a blank, then the argv.
        out = [f"{k}={v}" for k, v in doc["environment"].items()] + [""] + doc["argv"]
        sys.stdout.write("".join(item + "\0" for item in out))
        sys.stdout.flush()
        return Result(doc)
    return Result(doc, _command_text(doc))


def run_env(args: argparse.Namespace) -> Result:
    """Render a job's env file from inventory-style JSON (what the front-ends write)."""
    try:
        values = json.loads(
            Path(args.spec).read_text(encoding="utf-8") if args.spec != "-" else sys.stdin.read()
        )
    except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise _invalid(f"cannot read a JSON job from {args.spec}: {exc}") from None
    job = job_from_mapping(values)
    text = render_env(job)
    return Result({"name": job.name, "env": text}, text)


def run_fields(args: argparse.Namespace) -> Result:
    doc = [
        {
            "name": f.name,
            "env": f.env if f in ENV_FIELDS else None,
            "type": f.kind,
            "required": f.default is REQUIRED,
            "default": None if f.default is REQUIRED else f.default,
            "help": f.help,
        }
        for f in FIELDS
    ]
    text = "\n".join(f"{d['name']:<20} {d['type']:<5} {d['help']}" for d in doc)
    return Result(doc, text)


def add_dir_args(parser: argparse.ArgumentParser, *dirs: str) -> None:
    """The hidden ``--jobs-dir``/``--state-dir``/``--log-dir`` (tests point them elsewhere)."""
    defaults = {"jobs": JOBS_DIR, "state": STATE_DIR, "log": LOG_DIR}
    for name in dirs:
        parser.add_argument(f"--{name}-dir", default=str(defaults[name]), help=argparse.SUPPRESS)


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = "a training job's settings and the verl command they make"
    parser = subcommand.add(subparsers, common, "job", None, __doc__, help=summary)
    sub = parser.add_subparsers(dest="job_command", required=True)
    summary = "the profile, the plan and verl's argv for a job on this host"
    cmd = subcommand.add(sub, common, "command", run_command, help=summary)
    source = cmd.add_mutually_exclusive_group()
    source.add_argument("--name", help=f"a job under --jobs-dir (default {JOBS_DIR})")
    source.add_argument("--env-file", metavar="FILE", help="a job's env file")
    add_dir_args(cmd, "jobs")
    cmd.add_argument(
        "--print0",
        action="store_true",
        help="NUL-separated NAME=value environment, an empty item, then the argv",
    )
    cmd.add_argument(
        "--write-plan", action="store_true", help="also save the result as the job's plan.json"
    )
    detect.add_source_args(cmd)
    recorded = cmd.add_argument_group("recorded topology (replaces nvidia-smi topo and /sys)")
    recorded.add_argument("--topo-file", metavar="FILE", help="output of nvidia-smi topo -m")
    recorded.add_argument("--p2p-file", metavar="FILE", help="output of nvidia-smi topo -p2p r")
    recorded.add_argument(
        "--ib-dir", metavar="DIR", default=topology.IB_DIR, help=f"default {topology.IB_DIR}"
    )
    env = subcommand.add(sub, common, "env", run_env, help="render a job's env file from JSON")
    env.add_argument("spec", help="a JSON object with the job's settings, or - for stdin")
    subcommand.add(sub, common, "fields", run_fields, help="the settings a job has")
