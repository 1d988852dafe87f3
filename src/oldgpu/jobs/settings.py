"""A job's settings: the fields, their defaults and checks, and the env file that holds them.

``FIELDS`` is the one list of job settings; the role's argument specs and the
Nix module's options are tested against it. A value that cannot run is refused
here, with a named error and exit code 4 (``CONFIG_INVALID``), before a unit starts.
The env file format is ``KEY='value'`` per line: systemd's EnvironmentFile= and a
shell's ``.`` read it alike, so values may hold neither a quote nor a newline.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oldgpu import asset_files, paths, profile, recipe, verl_release
from oldgpu.jobs import unit
from oldgpu.output import EngineError

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
    Field("model_path", "path", "", "a local model directory (config.json, weights, tokenizer); or model"),  # noqa: E501
    Field("model", "str", "", "a model id (org/name) that oldgpu assets places in models_dir; instead of model_path"),  # noqa: E501
    Field("model_revision", "str", "main", "the model's revision: a branch, tag or commit"),
    Field("critic_model_path", "path", "", "the critic's model directory (default: model_path)"),
    Field("train_files", "path", "", "training parquet in verl's layout (oldgpu data); or dataset"),
    Field("val_files", "path", "", "validation parquet; or dataset"),
    Field("dataset", "str", "", "a data set id that oldgpu assets places and oldgpu data prepares; instead of train_files and val_files"),  # noqa: E501
    Field("dataset_revision", "str", "main", "the data set's revision: a branch, tag or commit"),
    Field("data_source", "str", "openai/gsm8k", "the data_source rows carry; picks verl's reward"),
    Field("total_steps", "int", REQUIRED, "trainer.total_training_steps"),
    Field("save_freq", "int", 10, "checkpoint every N steps (resume continues from the last)"),
    Field("test_freq", "int", -1, "validate every N steps (-1: never)"),
    # all: a job that leaves gpus out uses the box it was put on (every card of one
    # profile; FSDP over more cards plans a larger batch, so the planner would pick them
    # all anyway). A host that runs several jobs at once sets gpus or devices per job.
    Field("gpus", "count", "all", "GPUs for this job: a number, or all (the default: every card of one profile on the host)"),  # noqa: E501
    Field("devices", "indices", [], "the GPUs (nvidia-smi indices) to run on (empty: the engine chooses)"),  # noqa: E501
    Field("prompt_length", "int", recipe.DEFAULT_PROMPT_LENGTH, "data.max_prompt_length (the planner's input; its default is oldgpu plan's)"),  # noqa: E501
    Field("response_length", "int", recipe.DEFAULT_RESPONSE_LENGTH, "data.max_response_length (the planner's input)"),  # noqa: E501
    Field("train_batch_size", "int", 0, "a train batch to plan for (0: the planner chooses)"),
    Field("algorithm", "str", recipe.DEFAULT_ALGORITHM, "advantage estimator: " + ", ".join(recipe.ALGORITHMS) + " (only gae trains a critic)"),  # noqa: E501
    Field("rollout_n", "int", recipe.DEFAULT_ROLLOUT_N, "responses sampled per prompt (grpo, rloo, reinforce_plus_plus_baseline: at least 2)"),  # noqa: E501
    Field("kl_loss_coef", "float", 0.001, "KL-to-reference loss; on for the critic-free algorithms (0: off)"),  # noqa: E501
    Field("lora_rank", "int", 0, "LoRA adapters of this rank on the actor (0: full fine-tuning)"),
    Field("lora_alpha", "int", 0, "LoRA alpha (0: twice lora_rank)"),
    Field("lora_target_modules", "list", [], "modules LoRA adapts, e.g. [q_proj, v_proj] (empty: all-linear)"),  # noqa: E501
    Field("base_dtype", "str", recipe.DEFAULT_BASE_DTYPE, "how LoRA stores the frozen base, computed in fp32 either way: " + ", ".join(recipe.BASE_DTYPES) + " (auto: fp32 if it fits, else bf16)"),  # noqa: E501
    Field("profile", "str", "", "a profile to use instead of the detected one (cpu, pascal, ...)"),
    Field("rollout", "str", "", "hf or vllm instead of the profile's rollout (empty: the profile's)"),  # noqa: E501
    Field("compute_dtype", "str", "", "fp32 instead of the profile's dtype (empty: the profile's)"),
    Field("verl_version", "str", "", "the verl release to run (empty: the default, pins' verl.version; oldgpu job fields lists the choices)"),  # noqa: E501
    Field("overrides", "list", [], "extra Hydra overrides, applied last"),
    Field("cluster", "str", "", "run on this Ray cluster (ray_cluster_name) instead of a private Ray on this host"),  # noqa: E501
    Field("cluster_address", "str", "", "the cluster head's host:port (the verl_jobs role fills it in)"),  # noqa: E501
    Field("cluster_nodes", "int", 0, "the cluster's hosts in the inventory (the verl_jobs role fills it in)"),  # noqa: E501
    Field("enabled", "bool", True, "start the job at boot"),
)
# fmt: on
FIELD_BY_NAME = {f.name: f for f in FIELDS}
# ``enabled`` is systemd's business (the unit's enablement), not the job's env.
ENV_FIELDS = tuple(f for f in FIELDS if f.name != "enabled")


def choices(field: Field) -> list[str] | None:
    """The values a str setting may take (``oldgpu job fields`` lists them); None: any."""
    if field.name == "verl_version":
        return list(verl_release.releases())
    if field.name == "algorithm":
        return list(recipe.ALGORITHMS)
    if field.name == "rollout":
        return list(profile.ROLLOUTS)
    if field.name == "compute_dtype":
        return list(COMPUTE_DTYPES)
    if field.name == "profile":
        return sorted(profile.PROFILES)
    return None


COMPUTE_DTYPES = ("fp32", "fp16", "bf16")
# Keys a front-end's job carries beside the fields, never written to the env file: the
# verl_jobs role writes ``secrets`` (variable -> value) to <name>.secrets.env itself.
FRONTEND_KEYS = ("secrets",)
SECRET_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def invalid(message: str) -> EngineError:
    return EngineError("job-config-invalid", message, code=CONFIG_INVALID)


def _check_value(field: Field, value: str) -> None:
    for bad in FORBIDDEN:
        if bad in value:
            raise invalid(f"{field.name}: {value!r} holds {bad!r}, which an env file cannot")


@dataclass(frozen=True)
class Job:
    name: str
    model_path: str
    model: str
    model_revision: str
    critic_model_path: str
    train_files: str
    val_files: str
    dataset: str
    dataset_revision: str
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
    rollout: str
    compute_dtype: str
    verl_version: str
    overrides: tuple[str, ...]
    cluster: str = ""
    cluster_address: str = ""
    cluster_nodes: int = 0
    base_dtype: str = "auto"

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
        raise invalid(f"a job is a JSON object of settings, not {type(values).__name__}")
    unknown = sorted(set(values) - set(FIELD_BY_NAME) - set(FRONTEND_KEYS))
    if unknown:
        raise invalid(f"unknown job settings: {', '.join(_with_hint(k) for k in unknown)}")
    _check_secrets(values.get("secrets"))
    out: dict[str, Any] = {}
    for field in ENV_FIELDS:
        value = values.get(field.name, field.default)
        if value is REQUIRED or (value in ("", None) and field.default is REQUIRED):
            raise invalid(f"{field.name} is required ({field.help})")
        if field.kind == "int":
            value = _integer(field, value)
        elif field.kind == "count":
            value = _count(field, value)
        elif field.kind == "indices":
            value = _indices(field, value)
        elif field.kind == "float":
            value, problem = recipe.parse_float(field.name, value)
            if problem:
                raise invalid(problem)
        elif field.kind == "list":
            if not isinstance(value, list | tuple) or not all(
                isinstance(v, str | int | float) and not isinstance(v, bool) for v in value
            ):
                raise invalid(f"{field.name}: expected a list of strings, got {value!r}")
            value = tuple(str(v) for v in value)
            for item in value:
                _check_value(field, item)
                if '"' in item:  # JSON would escape it with a backslash
                    raise invalid(
                        f"{field.name}: {item!r} holds a double quote; Hydra takes unquoted values"
                    )
        else:
            value = str(value)
            _check_value(field, value)
            if field.kind == "path" and value and not value.startswith("/"):
                raise invalid(f"{field.name}: {value!r} is not an absolute path")
        out[field.name] = value
    if not NAME_RE.match(out["name"]):
        raise invalid(
            f"name: {out['name']!r} must be 1-32 of a-z 0-9 _ - (it names a unit and a directory)"
        )
    for key in ("total_steps", "prompt_length", "response_length"):
        if out[key] < 1:
            raise invalid(f"{key}: {out[key]} must be at least 1")
    if out["save_freq"] < 1:
        raise invalid(
            f"save_freq: {out['save_freq']} must be at least 1 (resume needs checkpoints)"
        )
    if out["train_batch_size"] < 0:
        raise invalid("train_batch_size: must be 0 (planner chooses) or a batch size")
    for item in out["overrides"]:
        if "=" not in item and not item.startswith("~"):
            raise invalid(f"overrides: {item!r} is not a Hydra override (key=value)")
    if out["profile"] and profile_name(out["profile"])[0] not in profile.PROFILES:
        raise invalid(f"profile: {out['profile']!r} is not one of {sorted(profile.PROFILES)}")
    if out["rollout"] not in ("", *profile.ROLLOUTS):
        raise invalid(f"rollout: {out['rollout']!r} is not one of {list(profile.ROLLOUTS)}")
    if out["verl_version"] and out["verl_version"] not in verl_release.releases():
        raise invalid(
            f"verl_version: {out['verl_version']!r} is not one of {list(verl_release.releases())}"
        )
    if out["compute_dtype"] not in ("", *COMPUTE_DTYPES):
        raise invalid(f"compute_dtype: {out['compute_dtype']!r} is not fp32, fp16 or bf16")
    if out["profile"]:
        try:  # what `job command` resolves; refused here so a unit never starts with it
            prof = profile.profile_for_arch(*profile_name(out["profile"]))
            # What the card cannot do is refused at once when the profile is known
            # (else when the job starts, against the detected one).
            profile.with_choices(prof, out["rollout"], out["compute_dtype"])
        except EngineError as exc:
            raise invalid(f"profile: {exc.message}") from None
    # What the release cannot run, where the job alone says it (a cluster; vLLM, named or
    # the forced profile's), refused here rather than when the unit starts.
    rollout = out["rollout"] or None
    if out["profile"] and rollout is None:
        rollout = profile.profile_for_arch(*profile_name(out["profile"]))["rollout"]
    try:
        version = out["verl_version"] or verl_release.default()
        verl_release.check_settings(version, rollout, out["cluster"])
        verl_release.plan_base_dtype(version, out["base_dtype"])
    except EngineError as exc:
        raise EngineError(exc.name, exc.message, code=CONFIG_INVALID) from None
    _check_cluster(out)
    _resolve_assets(out)
    for problem in recipe.problems(out):
        raise invalid(problem)
    return Job(**out)


def _with_hint(key: str) -> str:
    """An unknown setting, with the field it is closest to (``rollout_nn``: rollout_n)."""
    close = difflib.get_close_matches(str(key), [*FIELD_BY_NAME, *FRONTEND_KEYS], n=1)
    return f"{key} (did you mean {close[0]}?)" if close else str(key)


def _check_secrets(secrets: Any) -> None:
    """The role's ``secrets``: environment variable names to values an env file can hold.
    Checked, never rendered (the message names no value)."""
    if secrets is None:
        return
    if not isinstance(secrets, Mapping):
        raise invalid("secrets: a mapping of environment variable names to values")
    for key, value in secrets.items():
        if not isinstance(key, str) or not SECRET_NAME_RE.match(key):
            raise EngineError(
                "job-secrets-invalid",
                f"secrets: {key!r} is not an environment variable name",
                code=CONFIG_INVALID,
            )
        if not isinstance(value, str | int | float) or any(c in str(value) for c in "'\n\r"):
            raise EngineError(
                "job-secrets-invalid",
                f"secrets: the value of {key} holds a quote or a newline, or is not a string",
                code=CONFIG_INVALID,
            )


CLUSTER_ADDRESS_RE = re.compile(r"^[A-Za-z0-9.-]+:\d{1,5}$")


def _check_cluster(out: Mapping[str, Any]) -> None:
    """A cluster job names its cluster, its head's address and its node count; others none."""
    if not out["cluster"]:
        if out["cluster_address"] or out["cluster_nodes"]:
            raise invalid("cluster_address and cluster_nodes belong to a job with a cluster")
        return
    if not NAME_RE.match(out["cluster"]):
        raise invalid(f"cluster: {out['cluster']!r} must be 1-32 of a-z 0-9 _ -")
    if not CLUSTER_ADDRESS_RE.match(out["cluster_address"]):
        raise invalid(
            f"cluster_address: {out['cluster_address']!r} is not host:port (the verl_jobs role "
            "fills it in from the inventory's ray_head group)"
        )
    if out["cluster_nodes"] < 1:
        raise invalid("cluster_nodes: a cluster has at least one node")


def _resolve_assets(out: dict[str, Any]) -> None:
    """``model``/``dataset`` by id and revision name the paths oldgpu.assets places them at."""
    for kind, path_fields in (
        ("model", ("model_path",)),
        ("dataset", ("train_files", "val_files")),
    ):
        if not out[kind]:
            for key in path_fields:
                if not out[key]:
                    raise invalid(f"{key} is required, or {kind} ({FIELD_BY_NAME[key].help})")
            continue
        try:
            wanted = dict(
                zip(
                    path_fields,
                    asset_files.job_paths(kind, out[kind], out[f"{kind}_revision"]),
                    strict=True,
                )
            )
        except EngineError as exc:
            raise invalid(f"{kind}: {exc.message}") from None
        for key, path in wanted.items():
            # The env file carries both; a different path is a second answer.
            if out[key] and out[key] != path:
                raise EngineError(
                    "job-asset-twice",
                    f"{key}: {out[key]!r} and {kind}: {out[kind]!r} name two places ({path}); "
                    f"give one of them",
                    code=CONFIG_INVALID,
                )
            out[key] = path


# systemd's ProtectHome= hides these from the unit (unit.py reads what the unit hides).
PROTECTED_HOME = unit.HOME_DIRS


def check_for_unit(job: Job) -> None:
    """What a job's unit would refuse at its start, knowable from the job alone: a model or
    data path its sandbox hides (``oldgpu job env``, where a unit's env file is made)."""
    given = {f.name: getattr(job, f.name) for f in ENV_FIELDS if f.kind == "path"}
    for problem in unit.unit_path_problems(given):
        raise EngineError("job-path-protected", problem, code=CONFIG_INVALID)


def _integer(field: Field, value: Any) -> int:
    """An int, or a string or float that is exactly one (8.5 is refused, not truncated)."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise invalid(f"{field.name}: {value!r} is not an integer")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise invalid(f"{field.name}: {value!r} is not an integer") from None


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


def profile_name(name: str) -> tuple[str, str | None]:
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
            raise invalid(f"{source}:{number}: not KEY=value: {raw!r}")
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
                raise invalid(f"{field.env}: not a JSON list of strings ({exc})") from None
            if not isinstance(values[field.name], list):
                raise invalid(f"{field.env}: not a JSON list of strings")
        else:
            values[field.name] = raw
    return job_from_mapping(values)


def load_job(name: str, jobs_dir: Path = JOBS_DIR) -> Job:
    return load_env_file(jobs_dir / f"{name}.env")


def load_env_file(path: Path) -> Job:
    """The job an env file declares; an unreadable or non-UTF-8 file is a named error."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise invalid(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise invalid(f"{path}: not UTF-8 text ({exc.reason})") from None
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
