"""Which verl release a job runs, where its venv and tree are, and what its argv needs.

verl 0.5.0 is the default (``pins.verl``); newer releases are listed under
``pins.verl_releases`` with their own lock. A host may carry several: each release has
its own venv and patched tree, side by side, and a job picks one with its
``verl_version`` setting. What differs between them lives here and nowhere else:

- 0.5.0 runs its own HF rollout (``rollout.name=hf``, sync mode) and takes the profile's
  overrides as ``profile.hydra_overrides`` writes them.
- 0.9.0 accepts only asynchronous rollout servers, and vLLM/SGLang refuse CC < 7.0: a
  Pascal job rolls out through the engine's ``oldgpu-hf`` server, which verl finds
  because ``VERL_USE_EXTERNAL_MODULES`` imports ``oldgpu.verl_plugin.hook`` in every
  process (docs/newer-verl.md). The job runs the legacy trainer (``trainer.use_v1=False``):
  the v1 trainer needs TransferQueue, which verl does not declare, and nothing in it is
  needed on one host. Some keys moved (the critic's FSDP settings).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import oldgpu
from oldgpu import paths, pins
from oldgpu.output import EngineError

# The rollout server a Pascal job of a newer release uses (oldgpu.verl_plugin.registry).
ROLLOUT_NAME = "oldgpu-hf"
PLUGIN_MODULE = "oldgpu.verl_plugin.hook"
# The patch a release's logits patch set is known by (verl_0_5_0/logits.py, verl_0_9_0/logits.py).
LOGITS_PATCH = "response-logits"
# 0.5.0's keys that 0.9.0 moved; an override of the old key is rewritten. The custom reward
# function: 0.9.0 copies the top-level key over only in its fully-async trainer
# (migrate_legacy_reward_impl); the legacy trainer reads reward.custom_reward_function
# alone, so the old key would be ignored without a word.
MOVED_KEYS = {
    "0.9.0": (
        ("critic.model.fsdp_config.", "critic.fsdp."),
        ("custom_reward_function.", "reward.custom_reward_function."),
    )
}
# Keys 0.5.0's config lacks, so set with "+" (a 16-bit base's model_dtype), that a newer
# release's has: Hydra refuses "+" on a key that exists, so it is dropped there.
PRESENT_KEYS = {"0.9.0": ("actor_rollout_ref.actor.fsdp_config.model_dtype",)}
# The patch a release's base16 patch set (a LoRA base stored at 16 bits) is known by.
BASE16_PATCH = "base16-params-only"


def default() -> str:
    """The release a job runs unless it names another (pins.verl.version)."""
    return str(pins.get("verl.version"))


def releases() -> tuple[str, ...]:
    """Every release a job may name: the default, then pins.verl_releases in order."""
    newer = pins.load().get("verl_releases") or {}
    return (default(), *(v for v in newer if v != default()))


def release(version: str) -> dict[str, Any]:
    """The pins of one release (tag, commit, repo_url, lock); a named error for others."""
    if version == default():
        return dict(pins.get("verl"))
    newer = pins.load().get("verl_releases") or {}
    if version not in newer:
        raise EngineError(
            "verl-version-unknown",
            f"verl_version {version!r} is not one of {list(releases())} (files/pins.json)",
        )
    return {"version": version, **newer[version]}


def _suffix(version: str) -> str:
    return version.replace(".", "_")


def dirs(version: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The venv and the patched tree of ``version`` on this host.

    The default release keeps its paths (``VERL_VENV``/``VERL_DIR`` override them, as the
    start script honours); another lives beside it, ``/opt/verl/venv-<v>`` and
    ``/opt/verl/verl-<v>`` (``VERL_VENV_<v>``/``VERL_DIR_<v>``, dots as underscores,
    override those: the benchmark's machine has no /opt/verl).
    """
    env = {} if environ is None else environ
    if version == default():
        return {
            "venv": env.get("VERL_VENV", str(paths.VENV_DIR)),
            "tree": env.get("VERL_DIR", str(paths.VERL_DIR)),
        }
    release(version)
    s = _suffix(version)
    return {
        "venv": env.get(f"VERL_VENV_{s}", str(paths.release_venv(version))),
        "tree": env.get(f"VERL_DIR_{s}", str(paths.release_tree(version))),
    }


def check_job(version: str, prof: Mapping[str, Any], cluster: str) -> None:
    """What a newer release cannot run yet: a named error before anything starts."""
    check_settings(version, prof["rollout"], cluster)


def check_settings(version: str, rollout: str | None, cluster: str) -> None:
    """``check_job`` with what a job's settings alone tell (``rollout`` None: not known
    until the host's profile is), so ``oldgpu job env`` refuses it before a unit exists."""
    release(version)
    if version == default():
        return
    if rollout is not None and rollout != "hf":
        raise EngineError(
            "verl-version-unsupported",
            f"verl {version} with the {rollout} rollout is not provided: its lock has "
            "no vLLM; use verl_version "
            f"{default()} or rollout hf (the {ROLLOUT_NAME} server)",
        )
    if cluster:
        raise EngineError(
            "verl-version-unsupported",
            f"verl {version} runs on one host for now; a cluster job runs verl {default()}",
        )


def plan_base_dtype(version: str, base_dtype: str) -> str:
    """The base dtype the planner may use for ``version``: a 16-bit base (a LoRA job's
    base_dtype) needs the release's base16 patch set (parameters only cast, the embeddings
    and lm_head in units of their own; the patcher's registry says: 0.5.0's and 0.9.0's
    have it). Without one, auto plans fp32 and bf16/fp16 are refused."""
    from oldgpu.patch.registry import registry

    if any(p.name == BASE16_PATCH and version in p.versions for p in registry()):
        return base_dtype
    if base_dtype in ("auto", "fp32"):
        return "fp32"
    raise EngineError(
        "verl-version-unsupported",
        f"base_dtype {base_dtype} with verl {version} is not provided: its engine has no "
        "base16 patch set (16-bit storage with fp32 compute); a 16-bit base runs verl "
        f"{default()} (verl_version {default()})",
    )


# verl 0.9.0's agent-loop and reward-loop workers (8 each by default): one a CPU-share of
# cores, between 1 and verl's 8. Each is a process importing verl (host memory), and with
# one of each a step's 448 requests are tokenized, sent and scored one after another:
# 1.4 s of arrival spread and 1.6 s of scoring a step on the lent H100
# (bench/results/2026-12-07-h100/call2), about a tenth of the step.
CPUS_PER_LOOP_WORKER = 4
MAX_LOOP_WORKERS = 8


def loop_workers(cpus: int | None) -> int:
    """Agent-loop (and reward-loop) workers for a job on a host with ``cpus`` usable CPUs
    (None: unknown, one)."""
    if not cpus:
        return 1
    return max(1, min(MAX_LOOP_WORKERS, cpus // CPUS_PER_LOOP_WORKER))


def host_cpus() -> int:
    """The CPUs this process may run on (a unit's AllowedCPUs= and a container's cpuset
    count; the machine's total does not)."""
    return len(os.sched_getaffinity(0))


def profile_overrides(version: str, prof: Mapping[str, Any], cpus: int | None = None) -> list[str]:
    """The profile's settings in ``version``'s keys (0.5.0: the profile's own list).
    ``cpus``: the host's usable CPUs, which size 0.9.0's agent and reward loops."""
    if version == default():
        return list(prof["hydra_overrides"])
    out: list[str] = []
    if not prof["torch_compile"]:
        # Each role's engine reads its own key; 0.5.0's actor key reaches none of them.
        out += [
            "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
            "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
            "critic.fsdp.use_torch_compile=False",
        ]
    if not prof["flash_attn_allowed"]:
        # Remove-padding defaults to true in 0.9.0; liger and the fused kernels are Triton.
        out += [
            "actor_rollout_ref.model.use_remove_padding=False",
            "critic.model.use_remove_padding=False",
            "actor_rollout_ref.model.use_liger=False",
            "actor_rollout_ref.model.use_fused_kernels=False",
        ]
    out += [
        f"actor_rollout_ref.rollout.name={ROLLOUT_NAME}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "trainer.use_v1=False",
    ]
    # The cpu profile's Ray has 8 logical CPUs for the trainer's actors: one of each.
    workers = 1 if prof["device"] == "cpu" else loop_workers(cpus)
    out += [
        f"actor_rollout_ref.rollout.agent.num_workers={workers}",
        f"reward.num_workers={workers}",
    ]
    if prof["device"] == "cpu":
        # Ray schedules the workers on a GPU resource: the cpu platform runs them on one
        # it announces; and enough logical CPUs for the trainer's actors on a small host.
        out += [
            "trainer.device=cpu",
            "+ray_kwargs.ray_init.num_gpus=1",
            "ray_kwargs.ray_init.num_cpus=8",
        ]
    return out


# verl 0.9.0's bypass mode: the old policy's log-probs are the rollout's own, so the
# actor's log-prob pass over the whole batch (a tenth of a GRPO step on the lent H100,
# bench/results/2026-12-07-h100/call2) is not run. It is exact here, not an
# approximation as with vLLM: oldgpu-hf samples from the trainer's own parameters, in the
# same fp32, before any update, so the rollout's policy is the old policy. On the CPU the
# two agreed to 3.7e-9 in probability (the smoke's training/rollout_probs_diff_max).
# It holds while the rollout's distribution is the actor's log_softmax(logits / T):
# top-p, top-k or raw log-probs change what the rollout reports, and another policy
# loss would be replaced by bypass mode's PPO clip; then the actor recomputes, as verl's
# default. A job that sets bypass_mode itself keeps its choice.
BYPASS_KEY = "algorithm.rollout_correction.bypass_mode"
ROLLOUT_LOG_PROBS_KEY = "actor_rollout_ref.rollout.calculate_log_probs"
_SAME_POLICY = {
    "actor_rollout_ref.rollout.top_p": lambda v: float(v) == 1.0,
    "actor_rollout_ref.rollout.top_k": lambda v: int(v) <= 0,
    "actor_rollout_ref.rollout.logprobs_mode": lambda v: v in ("null", "processed_logprobs"),
    "actor_rollout_ref.actor.policy_loss.loss_mode": lambda v: v == "vanilla",
    ROLLOUT_LOG_PROBS_KEY: lambda v: v.lower() == "true",
}


def old_log_probs(version: str, prof: Mapping[str, Any], overrides: Sequence[str]) -> list[str]:
    """What a job's merged overrides need added for verl 0.9.0's bypass mode where the
    rollout's log-probs are the old policy's (see above); nothing otherwise."""
    if version == default() or prof["compute_dtype"] != "fp32":
        return []
    values = {}
    for item in overrides:
        key, _, value = item.lstrip("~+").partition("=")
        values[key] = None if item.startswith("~") else value.strip().strip("'\"")
    if BYPASS_KEY in values:
        return []
    for key, same in _SAME_POLICY.items():
        value = values.get(key)
        try:
            if value is not None and not same(value):
                return []
        except ValueError:
            return []  # not a number: verl's own config check names it
    return [f"{ROLLOUT_LOG_PROBS_KEY}=True", f"{BYPASS_KEY}=True"]


def plan_fields(version: str) -> dict[str, bool]:
    """What the planner counts differently for ``version``: whether its tree has the
    logits patch set (the response's logits only, log-probs and entropy by rows: the
    patcher's registry says; 0.5.0's and 0.9.0's have it), and whether it generates
    through the ``oldgpu-hf`` server in the trainer's process, from the trainer's own
    parameters (a newer release's: its memory counted as 0.5.0's HF rollout; the plan
    sets the server's batch)."""
    from oldgpu.patch.registry import registry

    logits = any(p.name == LOGITS_PATCH and version in p.versions for p in registry())
    return {"logits_patch": logits, "rollout_server": version != default()}


def translate(version: str, overrides: Sequence[str]) -> list[str]:
    """0.5.0's keys (the planner's, the recipe's, a job's own) as ``version`` names them."""
    moved = MOVED_KEYS.get(version, ())
    out = []
    for item in overrides:
        prefix = item[: len(item) - len(item.lstrip("~+"))]
        body = item[len(prefix) :]
        for old, new in moved:
            if body.startswith(old):
                body = new + body[len(old) :]
        if prefix == "+" and body.split("=", 1)[0] in PRESENT_KEYS.get(version, ()):
            prefix = ""
        out.append(prefix + body)
    return out


def engine_root() -> str:
    """The directory this engine is imported from (the release dir, src/ or the store
    path): the workers of a newer release import the rollout server from it."""
    return str(Path(oldgpu.__file__).resolve().parent.parent)


def environment(
    version: str, prof: Mapping[str, Any], environ: Mapping[str, str]
) -> dict[str, str]:
    """What the start script exports for ``version``: its venv and tree, and for a newer
    release the plugin hook and where the engine is (``OLDGPU_PLUGIN_PATH``, appended to
    PYTHONPATH by the start script)."""
    where = dirs(version, environ)
    env = {"VERL_VERSION": version, "VERL_VENV": where["venv"], "VERL_DIR": where["tree"]}
    if version != default():
        env["VERL_USE_EXTERNAL_MODULES"] = PLUGIN_MODULE
        env["OLDGPU_PLUGIN_PATH"] = engine_root()
        if prof["device"] == "cpu":
            # verl's platforms are cuda and npu; the engine's cpu platform stands in, and
            # verl registers its FSDP engines under "cuda" only.
            env["VERL_PLATFORM"] = "cpu"
            env["VERL_ENGINE_DEVICE"] = "cuda"
    return env
