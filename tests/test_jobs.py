"""Jobs: the env file both front-ends write, and the verl command a job makes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import QWEN05B_CONFIG, assert_overrides_land, verl_config
from conftest import job_spec as spec

from oldgpu import detect, jobs, profile
from oldgpu.output import EngineError

ROOT = Path(__file__).resolve().parents[1]
DETECT = ROOT / "tests/data/detect"
START = ROOT / "files/bin/verl-train"
SPECS = ROOT / "roles/verl_jobs/meta/argument_specs.yml"

QWEN05B = QWEN05B_CONFIG
GPUS = {  # recorded nvidia-smi and lspci output
    "p40": ("p40.nvidia-smi.csv", "p40.lspci.txt"),
    "v100": ("v100.nvidia-smi.csv", "v100.lspci.txt"),
}


# --- settings and the env file ------------------------------------------------


def test_argument_specs_match_the_engines_fields():
    options = yaml.safe_load(SPECS.read_text())["argument_specs"]["main"]["options"]
    job_options = options["verl_jobs"]["options"]
    # `secrets` is the role's own: it never reaches the env file.
    assert set(job_options) - {"secrets"} == {f.name for f in jobs.FIELDS}
    for field in jobs.FIELDS:
        opt = job_options[field.name]
        if field.default is jobs.REQUIRED:
            assert opt.get("required") is True, field.name
        else:
            assert opt.get("default") == field.default, field.name
        kind = {
            "str": "str",
            "path": "path",
            "int": "int",
            "float": "float",
            "list": "list",
            "bool": "bool",
            "count": "raw",  # an int or "all"
            "indices": "list",
        }
        assert opt["type"] == kind[field.kind], field.name


def test_env_round_trip(job_dir):
    job = jobs.job_from_mapping(spec(job_dir, overrides=["trainer.test_freq=5", "a.b=[x,y]"]))
    text = jobs.render_env(job)
    assert 'VERL_JOB_OVERRIDES=\'["trainer.test_freq=5", "a.b=[x,y]"]\'' in text
    assert "VERL_JOB_ENABLED" not in text  # systemd's business, not the job's
    assert jobs.job_from_env(jobs.parse_env(text)) == job


def test_recipe_settings_round_trip(job_dir):
    job = jobs.job_from_mapping(
        spec(job_dir, algorithm="grpo", rollout_n="4", kl_loss_coef=5e-05, lora_rank=16.0,
             lora_alpha=32, lora_target_modules=["q_proj", "v_proj"])
    )  # fmt: skip
    assert (job.algorithm, job.rollout_n, job.lora_rank) == ("grpo", 4, 16)
    assert job.kl_loss_coef == 5e-05 and job.lora_target_modules == ("q_proj", "v_proj")
    text = jobs.render_env(job)
    # Floats as %g: what Nix's JSON writes for the same number (the module compares).
    assert "VERL_JOB_KL_LOSS_COEF='5e-05'" in text
    assert 'VERL_JOB_LORA_TARGET_MODULES=\'["q_proj", "v_proj"]\'' in text
    assert jobs.job_from_env(jobs.parse_env(text)) == job
    default = jobs.job_from_mapping(spec(job_dir))
    assert (default.algorithm, default.rollout_n, default.kl_loss_coef) == ("gae", 1, 0.001)
    assert (default.lora_rank, default.lora_alpha, default.lora_target_modules) == (0, 0, ())


def test_env_file_is_what_a_shell_reads(job_dir, tmp_path):
    job = jobs.job_from_mapping(spec(job_dir, overrides=["x.y=a b"]))
    env_file = tmp_path / "job.env"
    env_file.write_text(jobs.render_env(job))
    out = subprocess.run(
        ["bash", "-c", f'set -a; . "{env_file}"; printf %s "$VERL_JOB_OVERRIDES"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out) == ["x.y=a b"]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"name": "Bad Name"}, "name:"),
        ({"name": "x" * 33}, "name:"),
        ({"model_path": "models/m"}, "not an absolute path"),
        ({"total_steps": 0}, "total_steps"),
        ({"total_steps": "many"}, "not an integer"),
        ({"save_freq": 0}, "save_freq"),
        ({"overrides": ["trainer.logger=['console']"]}, 'holds "\'"'),
        ({"overrides": ['a="b"']}, "double quote"),
        ({"overrides": ["novalue"]}, "not a Hydra override"),
        ({"overrides": "a=b"}, "list of strings"),
        ({"profile": "kepler2"}, "profile:"),
        ({"colour": "red"}, "unknown job settings: colour"),
        ({"val_files": ""}, "val_files is required"),
        ({"total_steps": 2.5}, "not an integer"),  # refused, not truncated to 2
        ({"total_steps": True}, "not an integer"),
        # The recipe: algorithm, samples per prompt, KL loss, LoRA.
        ({"algorithm": "ppo"}, "algorithm: 'ppo' is not one of gae, grpo"),
        ({"algorithm": "grpo"}, "rollout_n: 1 is too few for algorithm grpo"),
        ({"algorithm": "rloo", "rollout_n": 1}, "at least 2 responses per prompt"),
        ({"rollout_n": 0}, "rollout_n: 0 must be at least 1"),
        ({"rollout_n": "two"}, "rollout_n: 'two' is not an integer"),
        ({"algorithm": "grpo", "rollout_n": 2, "critic_model_path": "/m"}, "trains no critic"),
        ({"kl_loss_coef": -0.001}, "kl_loss_coef: -0.001 must be 0"),
        ({"kl_loss_coef": "lots"}, "kl_loss_coef: 'lots' is not a number"),
        ({"kl_loss_coef": True}, "is not a number"),
        ({"kl_loss_coef": float("inf")}, "not a finite number"),
        ({"kl_loss_coef": 0.1234567}, "more than 6 significant digits"),
        ({"lora_rank": -8}, "lora_rank: -8 must be 0"),
        ({"lora_rank": 8.5}, "lora_rank: 8.5 is not an integer"),
        ({"lora_rank": "8x"}, "lora_rank: '8x' is not an integer"),
        ({"lora_alpha": 16}, "lora_alpha: set without lora_rank"),
        ({"lora_target_modules": ["q_proj"]}, "lora_target_modules: set without lora_rank"),
        ({"lora_rank": 8, "lora_alpha": -1}, "lora_alpha: -1 must be 0"),
        ({"lora_rank": 8, "lora_target_modules": "q_proj"}, "list of strings"),
        ({"lora_rank": 8, "lora_target_modules": ["q proj"]}, "is not a module name"),
        ({"lora_rank": 8, "lora_target_modules": ["all-linear", "q_proj"]}, "stands alone"),
    ],
)
def test_bad_settings_are_named(job_dir, change, needle):
    with pytest.raises(EngineError) as err:
        jobs.job_from_mapping({**spec(job_dir), **change})
    assert err.value.name == "job-config-invalid"
    assert err.value.code == jobs.CONFIG_INVALID
    assert needle in err.value.message


def test_missing_required_setting(job_dir):
    values = spec(job_dir)
    del values["total_steps"]
    with pytest.raises(EngineError, match="total_steps is required"):
        jobs.job_from_mapping(values)


def test_cli_env_renders_and_refuses(job_dir, tmp_path):
    good = tmp_path / "good.json"
    # under /srv: the unit hides /tmp, where job_dir is (job-path-protected)
    good.write_text(json.dumps(spec(Path("/srv/job"), enabled=False)))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-m", "oldgpu", "job", "env", "--json", str(good)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    assert json.loads(out.stdout)["env"].startswith("# verl training job gsm8k")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(spec(job_dir, name="No")))
    out = subprocess.run(
        [sys.executable, "-m", "oldgpu", "job", "env", "--json", str(bad)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert out.returncode == jobs.CONFIG_INVALID
    assert json.loads(out.stdout)["error"] == "job-config-invalid"


# --- the composed command ---------------------------------------------------


def compose_for(job_dir, arch, **extra):
    job = jobs.job_from_mapping(spec(job_dir, **extra))
    smi, lspci = GPUS[arch]
    from oldgpu import detect

    gpus = detect.detect((DETECT / smi).read_text(), (DETECT / lspci).read_text(), run_tools=False)[
        "gpus"
    ]
    prof = jobs.resolve_profile(job, gpus)
    memory = min(g["memory_mib"] for g in gpus)
    return jobs.compose(job, prof, memory, QWEN05B, environ={}), prof


def overrides_of(doc) -> dict[str, str]:
    assert doc["argv"][:2] == ["-m", "verl.trainer.main_ppo"]
    items = doc["argv"][2:]
    keys = [jobs.override_key(o) for o in items]
    assert len(keys) == len(set(keys)), "Hydra refuses a key given twice"
    return {jobs.override_key(o): o.split("=", 1)[1] for o in items}


def test_p40_command_is_the_profile_plus_the_plan_plus_the_job(job_dir):
    doc, prof = compose_for(job_dir, "p40", prompt_length=256, response_length=256)
    assert prof["name"].startswith("pascal")
    o = overrides_of(doc)
    # The profile: fp32 everywhere, no compile, HF rollout on one device.
    for item in prof["hydra_overrides"]:
        assert o[jobs.override_key(item)] == item.split("=", 1)[1]
    assert o["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"] == "fp32"
    assert o["actor_rollout_ref.rollout.name"] == "hf"
    # The planner's choice for 24 GB at 256/256 (docs/planner.md; the logits patch set's
    # response logits double the micro batch a P40 fits).
    assert o["data.train_batch_size"] == "256"
    assert o["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == "4"
    assert o["actor_rollout_ref.actor.fsdp_config.optimizer_offload"] == "True"
    assert o["actor_rollout_ref.model.enable_gradient_checkpointing"] == "True"
    assert doc["plan"]["estimate"]["peak_mib"] <= 22528
    # The job: data, model, schedule, resume, logging under its state dir.
    assert o["trainer.resume_mode"] == "auto"
    assert o["trainer.default_local_dir"] == "/var/lib/verl/jobs/gsm8k/checkpoints"
    assert o["trainer.total_training_steps"] == "100"
    assert o["trainer.total_epochs"] == "100"  # the data's epochs must not end it first
    assert o["critic.model.path"] == str(job_dir / "model")
    assert o["trainer.logger"] == "['console','tensorboard']"
    # HF rollout: the article's vLLM knobs would do nothing, so none is emitted.
    assert not any("gpu_memory_utilization" in k for k in o)
    env = doc["environment"]
    assert env["TENSORBOARD_DIR"] == "/var/lib/verl/jobs/gsm8k/tensorboard"
    assert env["HF_HUB_OFFLINE"] == env["HF_DATASETS_OFFLINE"] == env["HYDRA_FULL_ERROR"] == "1"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["OLDGPU_COMPUTE_DTYPE"] == "fp32"
    # verl's step metrics come from a Ray actor: unbuffered, a stop loses none of them.
    assert env["PYTHONUNBUFFERED"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_v100_command(job_dir):
    doc, prof = compose_for(job_dir, "v100")
    assert prof["name"].startswith("volta")
    o = overrides_of(doc)
    assert o["trainer.n_gpus_per_node"] == "1"
    # fp16 with vLLM (V0 engine, XFORMERS) and the planner's vLLM settings.
    assert o["actor_rollout_ref.rollout.name"] == "vllm"
    assert o["actor_rollout_ref.rollout.dtype"] == "float16"
    assert o["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"] == "fp32"
    assert 0 < float(o["actor_rollout_ref.rollout.gpu_memory_utilization"]) <= 0.9
    assert int(o["actor_rollout_ref.rollout.max_num_batched_tokens"]) >= 512
    assert int(o["actor_rollout_ref.rollout.max_num_seqs"]) == int(o["data.train_batch_size"])
    env = doc["environment"]
    assert env["OLDGPU_COMPUTE_DTYPE"] == "fp16"
    assert (env["VLLM_USE_V1"], env["VLLM_ATTENTION_BACKEND"]) == ("0", "XFORMERS")
    # More memory than a P40: a plan at least as large.
    p40, _ = compose_for(job_dir, "p40")
    assert int(o["data.train_batch_size"]) >= int(overrides_of(p40)["data.train_batch_size"])


def test_v100_job_may_choose_hf_and_fp32(job_dir):
    doc, prof = compose_for(job_dir, "v100", rollout="hf", compute_dtype="fp32")
    o = overrides_of(doc)
    assert (prof["rollout"], prof["compute_dtype"]) == ("hf", "fp32")
    assert o["actor_rollout_ref.rollout.name"] == "hf"
    assert not any("gpu_memory_utilization" in k or "rollout.dtype" in k for k in o)
    env = doc["environment"]
    assert env["OLDGPU_COMPUTE_DTYPE"] == "fp32" and "VLLM_USE_V1" not in env
    fp16, _ = compose_for(job_dir, "v100", rollout="hf")
    assert fp16["environment"]["OLDGPU_COMPUTE_DTYPE"] == "fp16"
    # fp16's activations are half fp32's: a plan at least as large.
    assert int(overrides_of(fp16)["data.train_batch_size"]) >= int(o["data.train_batch_size"])


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"rollout": "sglang"}, "rollout"),
        ({"compute_dtype": "fp64"}, "compute_dtype"),
        ({"profile": "pascal", "rollout": "vllm"}, "compute capability 7.0"),
        ({"profile": "volta", "compute_dtype": "bf16"}, "fp32"),
    ],
)
def test_rollout_and_dtype_choices_are_checked(job_dir, extra, words):
    with pytest.raises(EngineError) as exc:
        jobs.job_from_mapping(spec(job_dir, **extra))
    assert exc.value.name == "job-config-invalid" and exc.value.code == 4
    assert words in exc.value.message


def test_a_p40_refuses_a_vllm_job_when_it_starts(job_dir):
    with pytest.raises(EngineError) as exc:
        compose_for(job_dir, "p40", rollout="vllm")
    assert exc.value.code == 4 and "vLLM" in exc.value.message


def test_cpu_command(job_dir):
    job = jobs.job_from_mapping(
        spec(job_dir, profile="cpu", train_batch_size=4, prompt_length=128, response_length=16)
    )
    prof = jobs.resolve_profile(job, [])
    doc = jobs.compose(job, prof, 65536, QWEN05B, environ={"STATE_DIRECTORY": "/srv/state"})
    o = overrides_of(doc)
    assert o["trainer.device"] == "cpu"
    assert o["data.train_batch_size"] == "4"
    assert o["trainer.default_local_dir"] == "/srv/state/checkpoints"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in doc["environment"]


def verl_batches_divide(o: dict[str, str], gpus: int = 1) -> None:
    """verl 0.5.0's own checks of the batch sizes (ray_trainer._validate_config and
    the actor worker): per GPU, the mini batch of sequences is whole micro batches."""
    n = int(o.get("actor_rollout_ref.rollout.n", "1"))
    train, mini = (
        int(o["data.train_batch_size"]),
        int(o["actor_rollout_ref.actor.ppo_mini_batch_size"]),
    )
    micro = int(o["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"])
    assert train * n % gpus == 0 and train >= mini
    assert mini * n % gpus == 0 and (mini * n // gpus) % micro == 0


def test_gae_is_todays_ppo(job_dir):
    doc, _ = compose_for(job_dir, "p40", prompt_length=256, response_length=256)
    o = overrides_of(doc)
    assert o["algorithm.adv_estimator"] == "gae" and o["actor_rollout_ref.rollout.n"] == "1"
    # verl's PPO default: no KL loss unless the job's overrides turn it on (with this coef).
    assert "actor_rollout_ref.actor.use_kl_loss" not in o
    assert o["actor_rollout_ref.actor.kl_loss_coef"] == "0.001"
    assert o["critic.ppo_micro_batch_size_per_gpu"] and o["critic.model.path"]
    assert not any(k.startswith("actor_rollout_ref.model.lora") for k in o)
    assert doc["plan"]["inputs"]["critic"] is True and doc["plan"]["inputs"]["ref"] is True


def test_grpo_turns_the_critic_off_and_the_kl_loss_on(job_dir):
    doc, prof = compose_for(job_dir, "p40", algorithm="grpo", rollout_n=4, kl_loss_coef=0.002)
    o = overrides_of(doc)
    assert o["algorithm.adv_estimator"] == "grpo"
    assert o["actor_rollout_ref.rollout.n"] == "4"
    assert o["actor_rollout_ref.actor.use_kl_loss"] == "True"
    assert o["actor_rollout_ref.actor.kl_loss_coef"] == "0.002"
    assert o["algorithm.use_kl_in_reward"] == "False"
    # No critic: neither the plan's settings for it nor its model (the profile's dtype
    # keys stay: they are the profile's), and the planner counts none.
    profile_keys = {jobs.override_key(item) for item in prof["hydra_overrides"]}
    assert not [k for k in o if k.startswith("critic.") and k not in profile_keys]
    inputs = doc["plan"]["inputs"]
    assert (inputs["critic"], inputs["ref"], inputs["rollout_n"]) == (False, True, 4)
    assert o["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"]
    verl_batches_divide(o)


def test_grpo_without_kl_needs_no_reference(job_dir):
    doc, prof = compose_for(job_dir, "p40", algorithm="rloo", rollout_n=2, kl_loss_coef=0)
    o = overrides_of(doc)
    assert o["actor_rollout_ref.actor.use_kl_loss"] == "False"
    assert doc["plan"]["inputs"]["ref"] is False
    profile_keys = {jobs.override_key(item) for item in prof["hydra_overrides"]}
    assert not [k for k in o if k.startswith("actor_rollout_ref.ref.") and k not in profile_keys]


def test_lora_on_the_hf_rollout(job_dir):
    doc, prof = compose_for(job_dir, "p40", algorithm="grpo", rollout_n=2, lora_rank=32)
    assert prof["rollout"] == "hf"
    o = overrides_of(doc)
    assert o["actor_rollout_ref.model.lora_rank"] == "32"
    assert o["actor_rollout_ref.model.lora_alpha"] == "64"  # twice the rank unless given
    assert o["actor_rollout_ref.model.target_modules"] == "all-linear"
    # vLLM's LoRA settings mean nothing to the HF rollout; the wrap is the patch's.
    assert "actor_rollout_ref.rollout.load_format" not in o
    assert "actor_rollout_ref.rollout.layered_summon" not in o
    assert not any("use_orig_params" in k for k in o)
    verl_batches_divide(o)


def test_lora_on_vllm_loads_safetensors_layered(job_dir):
    job = jobs.job_from_mapping(
        spec(job_dir, profile="ampere", lora_rank=8, lora_alpha=8,
             lora_target_modules=["q_proj", "v_proj"])
    )  # fmt: skip
    prof = jobs.resolve_profile(job, [])
    assert prof["rollout"] == "vllm"
    o = overrides_of(jobs.compose(job, prof, 81920, QWEN05B, environ={}))
    assert o["actor_rollout_ref.model.target_modules"] == "[q_proj,v_proj]"
    assert o["actor_rollout_ref.model.lora_alpha"] == "8"
    assert o["actor_rollout_ref.rollout.load_format"] == "safetensors"
    assert o["actor_rollout_ref.rollout.layered_summon"] == "True"
    assert o["algorithm.adv_estimator"] == "gae" and o["critic.model.path"]  # PPO + LoRA


@pytest.mark.parametrize("arch", ["pascal", "ampere"])
def test_recipe_composes_with_verls_own_config(job_dir, verl_pristine, arch):
    """Hydra applies the whole argv of a GRPO + LoRA job to verl 0.5.0's ppo_trainer
    config: no key is missing and each value lands (verl decides no critic from it)."""
    pytest.importorskip("omegaconf")

    job = jobs.job_from_mapping(
        spec(job_dir, profile=arch, algorithm="grpo", rollout_n=4, lora_rank=8,
             lora_target_modules=["q_proj", "v_proj"])
    )  # fmt: skip
    doc = jobs.compose(job, jobs.resolve_profile(job, []), 24576, QWEN05B, environ={})
    overrides = doc["argv"][2:]
    cfg = verl_config(verl_pristine, overrides)
    assert_overrides_land(cfg, overrides, target_modules=["q_proj", "v_proj"])
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.actor.use_kl_loss


def test_job_overrides_win_without_repeating_a_key(job_dir):
    doc, _ = compose_for(
        job_dir, "p40", overrides=["data.train_batch_size=128", "trainer.save_freq=3", "+x.y=1"]
    )
    o = overrides_of(doc)
    assert o["data.train_batch_size"] == "128"
    assert o["trainer.save_freq"] == "3"
    assert doc["argv"][-1] == "+x.y=1"


def test_merge_keeps_first_position_for_new_keys_only():
    merged = jobs.merge_overrides(["a=1", "+b=2"], ["c=3"], ["b=4"])
    assert merged == ["a=1", "c=3", "b=4"]


def test_a_plan_that_cannot_fit_is_a_config_error(job_dir, monkeypatch):
    job = jobs.job_from_mapping(spec(job_dir, prompt_length=4096, response_length=32768))
    monkeypatch.setattr(
        detect,
        "detect_from_args",
        lambda args: {"gpus": [dict(architecture="pascal", compute_capability="6.1",
                                    memory_mib=24576, name="Tesla P40")]},
    )  # fmt: skip
    with pytest.raises(EngineError) as err:
        jobs.compose_for_host(job, environ={})
    assert err.value.code == jobs.CONFIG_INVALID


def test_profiles_known_to_the_engine_are_accepted(job_dir):
    for name in profile.PROFILES:
        assert jobs.job_from_mapping(spec(job_dir, profile=name)).profile == name


# --- the start script -----------------------------------------------------------

FAKE_OLDGPU = """#!/bin/bash
# The real engine, with recorded GPUs; a doctor whose verdict the test sets.
if [[ $1 == doctor ]]; then echo "doctor $*" >>"$FAKE_LOG"; exit "${{FAKE_DOCTOR_RC:-0}}"; fi
exec {python} -m oldgpu "$@" --nvidia-smi-file {smi} --lspci-file {lspci}
"""
FAKE_PYTHON = """#!{python}
import json, os, sys
json.dump({{"python": sys.argv[0], "argv": sys.argv[1:], "env": dict(os.environ),
           "cwd": os.getcwd()}},
          open(os.environ["FAKE_EXEC"], "w"))
"""


def fake_venv(venv: Path) -> None:
    """A venv whose python records how the start script ran it (FAKE_EXEC)."""
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/python").write_text(FAKE_PYTHON.format(python=sys.executable))
    (venv / "bin/python").chmod(0o755)


def start_script(tmp_path, job_dir, arch, doctor_rc=0, environ=None, **extra):
    smi, lspci = GPUS.get(arch, GPUS["p40"])
    fake = tmp_path / "oldgpu"
    fake.write_text(
        FAKE_OLDGPU.format(python=sys.executable, smi=DETECT / smi, lspci=DETECT / lspci)
    )
    fake.chmod(0o755)
    fake_venv(tmp_path / "venv")
    job = jobs.job_from_mapping(spec(job_dir, **extra))
    env_file = tmp_path / f"{job.name}.env"
    env_file.write_text(jobs.render_env(job))
    state = tmp_path / "state"
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(ROOT / "src"),
        "OLDGPU_BIN": str(fake),
        "VERL_VENV": str(tmp_path / "venv"),
        "VERL_DIR": "/opt/verl/verl",
        "VERL_JOB_ENV_FILE": str(env_file),
        "STATE_DIRECTORY": str(state),
        "LOGS_DIRECTORY": str(tmp_path / "logs"),
        "FAKE_EXEC": str(tmp_path / "exec.json"),
        "FAKE_LOG": str(tmp_path / "fake.log"),
        "FAKE_DOCTOR_RC": str(doctor_rc),
    }
    env.update(environ or {})
    (tmp_path / "logs").mkdir()
    proc = subprocess.run([str(START)], env=env, capture_output=True, text=True, check=False)
    return proc, tmp_path


@pytest.mark.parametrize("arch", ["p40", "v100", "cpu"])
def test_start_script_execs_the_composed_command(tmp_path, job_dir, arch):
    extra = {"profile": "cpu", "train_batch_size": 4} if arch == "cpu" else {}
    if arch == "cpu":  # the smoke job's tiny model: fits any host's memory
        tiny = {**QWEN05B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "intermediate_size": 128, "vocab_size": 2048}  # fmt: skip
        (job_dir / "model/config.json").write_text(json.dumps(tiny))
    proc, tmp = start_script(tmp_path, job_dir, arch, **extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads((tmp / "exec.json").read_text())
    plan = json.loads((tmp / "state/plan.json").read_text())
    # Exactly the engine's argv, the engine's environment exported before Python starts.
    assert seen["argv"] == plan["argv"]
    for key, value in plan["environment"].items():
        assert seen["env"][key] == value, key
    assert seen["env"]["PYTHONPATH"].split(":")[0] == "/opt/verl/verl"
    assert seen["cwd"] == str(tmp / "state")
    want = {"p40": "pascal", "v100": "volta", "cpu": "cpu"}[arch]
    assert plan["profile"].startswith(want)
    doctor = (tmp / "fake.log").read_text()
    assert "--verl-dir /opt/verl/verl" in doctor
    assert ("--arch cpu" in doctor) == (arch == "cpu")
    # The journal's lines also land in the job's log file.
    assert "starting as user" in (tmp / "logs/gsm8k.log").read_text()


def test_start_script_stops_with_3_when_the_doctor_fails(tmp_path, job_dir):
    proc, tmp = start_script(tmp_path, job_dir, "p40", doctor_rc=3)
    assert proc.returncode == 3
    assert not (tmp / "exec.json").exists()


def test_start_script_stops_with_4_on_a_bad_job(tmp_path, job_dir):
    proc, tmp = start_script(tmp_path, job_dir, "p40", response_length=65536)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert not (tmp / "exec.json").exists()


def tees_of(log: Path) -> list[str]:
    """The running (not zombie) processes whose command line names ``log``."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(log) in cmd and state != "Z":
            found.append(f"{proc.name} {cmd}")
    return found


def test_start_script_leaves_no_tee_behind_when_it_exits(tmp_path, job_dir):
    """systemd on cgroup v1 (containers, older hosts) waits out TimeoutStopSec when a
    unit's cgroup still holds a process as its main process exits: the log's tee must be
    gone by then, on every exit (here the refusal of a bad job, exit 4)."""
    start_script(tmp_path, job_dir, "p40", response_length=65536)  # writes the env file
    env_file = tmp_path / "gsm8k.env"
    log = tmp_path / "logs/gsm8k.log"
    # A log writer that takes its time after the end of its input (a slow disk): the
    # script must wait for it, not leave it to systemd.
    slow = tmp_path / "slow-bin"
    slow.mkdir()
    (slow / "tee").write_text('#!/bin/sh\n[ "$1" = -a ] && shift\ncat >> "$1"\nsleep 1\n')
    (slow / "tee").chmod(0o755)
    env = {
        "PATH": f"{slow}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT / "src"),
        "OLDGPU_BIN": str(tmp_path / "oldgpu"),
        "VERL_VENV": str(tmp_path / "venv"),
        "VERL_JOB_ENV_FILE": str(env_file),
        "STATE_DIRECTORY": str(tmp_path / "state"),
        "LOGS_DIRECTORY": str(tmp_path / "logs"),
        "FAKE_LOG": str(tmp_path / "fake.log"),
        "FAKE_DOCTOR_RC": "0",
    }
    for _ in range(2):
        with open(tmp_path / "out.txt", "w") as out:
            proc = subprocess.Popen([str(START)], env=env, stdout=out, stderr=out)
            assert proc.wait(timeout=60) == 4
            left = tees_of(log)
        assert not left, left
    assert "its settings are invalid" in log.read_text()


def test_start_script_without_a_job_is_a_config_error(tmp_path):
    proc = subprocess.run(
        [str(START)], env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 4
    assert "VERL_JOB_NAME" in proc.stderr


def test_recipe_doc_names_every_setting_and_algorithm():
    from oldgpu import recipe

    doc = (ROOT / "docs/recipes.md").read_text()
    settings = ("algorithm", "rollout_n", "kl_loss_coef", "lora_rank", "lora_alpha")
    for name in (*settings, "lora_target_modules", *recipe.ALGORITHMS):
        assert f"| `{name}` |" in doc, name
    for name in settings:
        default = jobs.FIELD_BY_NAME[name].default
        assert f"| `{name}` | `{default}`" in doc, name
