"""A job's verl release: the field, the composed argv and environment per release, and the
start script running the release's venv and tree (oldgpu.verl_release)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import assert_overrides_land, plan_inputs, verl_config
from test_jobs import QWEN05B, fake_venv, overrides_of, spec, start_script

from oldgpu import jobs, plan, verl_release
from oldgpu.output import EngineError
from oldgpu.plan import memory

NEWER = "0.9.0"


def test_the_default_release_is_the_pinned_one_and_newer_ones_are_listed():
    assert verl_release.default() == "0.5.0"
    assert verl_release.releases()[0] == "0.5.0"
    assert NEWER in verl_release.releases()
    assert verl_release.release(NEWER)["lock"] == f"verl-{NEWER}"
    with pytest.raises(EngineError) as exc:
        verl_release.release("0.7.0")
    assert exc.value.name == "verl-version-unknown"


def test_an_unknown_release_is_refused_before_a_unit_starts(job_dir):
    with pytest.raises(EngineError) as exc:
        jobs.job_from_mapping(spec(job_dir, verl_version="0.6.1"))
    assert exc.value.code == jobs.CONFIG_INVALID
    assert "0.6.1" in exc.value.message and NEWER in exc.value.message


def compose(job_dir, profile="pascal", **extra):
    job = jobs.job_from_mapping(spec(job_dir, profile=profile, **extra))
    return jobs.compose(job, jobs.resolve_profile(job, []), 24576, QWEN05B, environ={})


def test_the_default_release_composes_as_before(job_dir):
    doc = compose(job_dir)
    assert doc["verl_version"] == "0.5.0"
    o = overrides_of(doc)
    assert o["actor_rollout_ref.rollout.name"] == "hf"
    assert "trainer.use_v1" not in o
    env = doc["environment"]
    assert (env["VERL_VENV"], env["VERL_DIR"]) == ("/opt/verl/venv", "/opt/verl/verl")
    assert "VERL_USE_EXTERNAL_MODULES" not in env and "OLDGPU_PLUGIN_PATH" not in env


def test_a_pascal_job_on_the_newer_release_rolls_out_through_the_engines_server(job_dir):
    doc = compose(job_dir, algorithm="gae", verl_version=NEWER)
    assert doc["verl_version"] == NEWER
    o = overrides_of(doc)
    assert o["actor_rollout_ref.rollout.name"] == "oldgpu-hf"
    assert o["trainer.use_v1"] == "False"
    # The patch set makes fp32 the default: none of 0.5.0's "+" dtype keys.
    assert not [k for k in o if "mixed_precision" in k or k.endswith("model_dtype")]
    # 0.5.0's critic keys, renamed where 0.9.0 moved them; each engine's compile off.
    assert not [k for k in o if k.startswith("critic.model.fsdp_config.")]
    assert o["critic.fsdp.param_offload"] in ("True", "False")
    for role in ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config",
                 "critic.fsdp"):  # fmt: skip
        assert o[f"{role}.use_torch_compile"] == "False"
    env = doc["environment"]
    assert env["VERL_VENV"] == f"/opt/verl/venv-{NEWER}"
    assert env["VERL_DIR"] == f"/opt/verl/verl-{NEWER}"
    assert env["VERL_USE_EXTERNAL_MODULES"] == "oldgpu.verl_plugin.hook"
    # The workers import the hook from the engine that composed the job.
    assert (Path(env["OLDGPU_PLUGIN_PATH"]) / "oldgpu/verl_plugin/hook.py").is_file()
    assert "VERL_PLATFORM" not in env


def test_the_cpu_profile_on_the_newer_release_runs_on_the_engines_cpu_platform(job_dir):
    doc = compose(job_dir, profile="cpu", algorithm="grpo", rollout_n=2, train_batch_size=4,
                  verl_version=NEWER)  # fmt: skip
    o = overrides_of(doc)
    assert o["trainer.device"] == "cpu" and o["ray_kwargs.ray_init.num_gpus"] == "1"
    env = doc["environment"]
    assert (env["VERL_PLATFORM"], env["VERL_ENGINE_DEVICE"]) == ("cpu", "cuda")


def test_the_bench_machine_names_its_own_release_dirs(job_dir):
    job = jobs.job_from_mapping(spec(job_dir, profile="pascal", verl_version=NEWER))
    environ = {"VERL_VENV_0_9_0": "/b/venv09", "VERL_DIR_0_9_0": "/b/tree09",
               "VERL_VENV": "/b/venv"}  # fmt: skip
    doc = jobs.compose(job, jobs.resolve_profile(job, []), 24576, QWEN05B, environ=environ)
    assert (doc["environment"]["VERL_VENV"], doc["environment"]["VERL_DIR"]) == (
        "/b/venv09",
        "/b/tree09",
    )


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"profile": "ampere", "rollout": "vllm"}, "no vLLM"),
        ({"cluster": "lab", "cluster_address": "head:6379", "cluster_nodes": 2}, "one host"),
    ],
)
def test_what_the_newer_release_cannot_run_is_a_config_error(job_dir, extra, why):
    # Knowable from the job alone: refused with its settings (oldgpu job env, the role's
    # preflight), before a unit exists; compose refuses it too (a hand-written env file).
    values = spec(job_dir, **{"profile": "pascal", **extra}, verl_version=NEWER)
    with pytest.raises(EngineError) as exc:
        jobs.job_from_mapping(values)
    assert exc.value.name == "verl-version-unsupported"
    assert exc.value.code == jobs.CONFIG_INVALID
    assert why in exc.value.message
    job = jobs.job_from_mapping({**values, "verl_version": ""})
    job = dataclasses.replace(job, verl_version=NEWER)
    cluster = {"nnodes": 2, "n_gpus_per_node": 1} if job.cluster else None
    with pytest.raises(EngineError) as exc:
        jobs.compose(
            job, jobs.resolve_profile(job, []), 24576, QWEN05B, environ={}, cluster=cluster
        )
    assert exc.value.name == "verl-version-unsupported"
    assert exc.value.code == jobs.CONFIG_INVALID
    assert why in exc.value.message


@pytest.mark.parametrize(
    "extra",
    [
        {"profile": "pascal", "algorithm": "gae"},
        {"profile": "pascal", "algorithm": "grpo", "rollout_n": 4, "lora_rank": 8,
         "lora_target_modules": ["q_proj", "v_proj"]},
        {"profile": "cpu", "algorithm": "grpo", "rollout_n": 2, "train_batch_size": 4},
        {"profile": "pascal", "algorithm": "grpo", "rollout_n": 4, "lora_rank": 8,
         "lora_target_modules": ["q_proj", "v_proj"], "base_dtype": "bf16"},
    ],
    ids=["pascal-gae", "pascal-grpo-lora", "cpu-grpo", "pascal-grpo-lora-bf16"],
)  # fmt: skip
def test_the_whole_argv_lands_in_the_newer_releases_own_config(job_dir, verl09_pristine, extra):
    """Hydra applies every override to verl 0.9.0's ppo_trainer config: no key is missing
    (Hydra refuses one without "+") and each value lands; a job's own override of a key
    0.9.0 moved lands where 0.9.0's legacy trainer reads it."""
    pytest.importorskip("omegaconf")
    reward = ["custom_reward_function.path=/srv/reward.py", "custom_reward_function.name=score"]
    doc = compose(job_dir, **extra, verl_version=NEWER, overrides=reward)
    overrides = doc["argv"][2:]
    cfg = verl_config(verl09_pristine, overrides)
    assert_overrides_land(cfg, overrides, target_modules=["q_proj", "v_proj"])
    assert cfg.actor_rollout_ref.rollout.name == "oldgpu-hf"
    assert cfg.algorithm.adv_estimator == extra["algorithm"]
    assert cfg.reward.custom_reward_function.path == "/srv/reward.py"
    assert cfg.reward.custom_reward_function.name == "score"


def test_the_start_script_runs_the_releases_venv_and_tree(tmp_path, job_dir):
    venv = tmp_path / "venv-newer"
    fake_venv(venv)
    environ = {"VERL_VENV_0_9_0": str(venv), "VERL_DIR_0_9_0": "/srv/verl-newer"}
    proc, tmp = start_script(tmp_path, job_dir, "p40", environ=environ, verl_version=NEWER)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads((tmp / "exec.json").read_text())
    plan = json.loads((tmp / "state/plan.json").read_text())
    assert plan["verl_version"] == NEWER
    assert seen["python"] == f"{venv}/bin/python"
    pythonpath = seen["env"]["PYTHONPATH"].split(":")
    assert pythonpath[0] == "/srv/verl-newer"
    assert pythonpath[-1] == plan["environment"]["OLDGPU_PLUGIN_PATH"]
    doctor = (tmp / "fake.log").read_text()
    assert f"--python {venv}/bin/python" in doctor
    assert "--verl-dir /srv/verl-newer" in doctor


def test_the_field_round_trips_through_the_env_file(job_dir):
    job = jobs.job_from_mapping(spec(job_dir, verl_version=NEWER))
    text = jobs.render_env(job)
    assert f"VERL_JOB_VERL_VERSION='{NEWER}'" in text
    assert jobs.job_from_env(jobs.parse_env(text)).verl_version == NEWER


def test_the_newer_release_gets_the_same_micro_batches_and_an_in_process_rollout(job_dir):
    """0.9.0's tree has the logits patch set too (verl_0_9_0/logits.py: the response's
    logits only, log-probs and entropy by rows), so the planner counts its logits as
    0.5.0's: a GRPO job of Qwen2.5-0.5B on a P40 gets the same micro batches from both;
    its rollout runs in the trainer's process (one weight copy, one context) and the plan
    sets the server's batch and token budget."""
    grpo = {"algorithm": "grpo", "rollout_n": 4, "train_batch_size": 32}
    old, new = (overrides_of(compose(job_dir, **grpo, verl_version=v)) for v in ("", NEWER))
    for key in (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    ):
        assert int(new[key]) == int(old[key]), key
    assert new["actor_rollout_ref.rollout.max_num_seqs"] == str(32 * 4)
    assert new[memory.SERVER_TOKENS_KEY.lstrip("+")] == str(32 * 4 * (512 + 256))
    assert verl_release.plan_fields(NEWER) == {"logits_patch": True, "rollout_server": True}
    assert verl_release.plan_fields(verl_release.default()) == {
        "logits_patch": True,
        "rollout_server": False,
    }
    # a release without the patch set computes verl's own logits (every position)
    assert verl_release.plan_fields("0.8.0")["logits_patch"] is False


def test_the_plan_says_what_it_counts_from_0_5_0s_measurements(job_dir):
    """The offload reasons describe 0.5.0's workers; on 0.9.0 they say they were not
    measured apart, rather than passing 0.5.0's mechanism off as the release's."""
    grpo = {"algorithm": "grpo", "rollout_n": 4, "train_batch_size": 32}
    for version, said in (("", False), (NEWER, True)):
        reasons = compose(job_dir, **grpo, verl_version=version)["plan"]["reasons"]
        offload = [r for r in reasons if "fsdp_config.param_offload" in r]
        assert len(offload) == 2, reasons  # the actor's and the ref's
        assert all(("not measured apart" in r) is said for r in offload), (version, offload)


def test_without_the_logits_patch_set_the_micro_batches_shrink():
    """What the logits patch set is worth to the plan: verl's own logits (every position,
    log-probs and entropy over whole micro batches) leave less room for the micro batch."""
    base = plan_inputs(critic=False, rollout_n=4, rollout_server=True, target_train_batch=32)
    patched = plan.plan(base)
    own = plan.plan(dataclasses.replace(base, logits_patch=False))
    assert own.choice.actor_micro < patched.choice.actor_micro
    assert own.choice.log_prob_micro < patched.choice.log_prob_micro


def test_the_in_process_rollout_adds_no_weights_or_context():
    base = plan_inputs(critic=False, rollout_n=4)
    choice = plan.Choice(train_batch_size=32, ppo_mini_batch_size=8, actor_micro=4,
                         critic_micro=4, log_prob_micro=8, gradient_checkpointing=True,
                         offload=plan.Offload())  # fmt: skip
    newer = dataclasses.replace(base, rollout_server=True)
    for phase in ("generate", "actor_update"):
        one, two = (memory.estimate_phase(i, choice, phase) for i in (base, newer))
        assert two.as_dict() == one.as_dict(), phase


def test_the_server_holds_the_batch_the_planner_sets():
    # The plan sets rollout.max_num_seqs to the GPU's rollout batch (and the token budget
    # under engine_kwargs.oldgpu_hf); the server takes max_num_seqs as its row cap and
    # max_num_seqs x (prompt + response) as its default token budget, so it holds no more
    # than planned. Read from the source: the server module imports verl, which the
    # engine venv lacks.
    import oldgpu.rollout

    source = " ".join((Path(oldgpu.rollout.__file__).parent / "server.py").read_text().split())
    assert 'settings.get("max_batch_size", int(self.config.max_num_seqs))' in source
    # The planner's budget key is one the server's settings table takes.
    from oldgpu.rollout import settings

    engine, name = memory.SERVER_TOKENS_KEY.rsplit(".", 2)[-2:]
    assert engine in settings.SPELLINGS and name in settings.SETTINGS
    assert "self.max_batch_size * (self.config.prompt_length + self.config.response_length)" in (
        source
    )


def test_the_agent_and_reward_loops_grow_with_the_hosts_cpus(job_dir, monkeypatch):
    """One agent-loop and one reward-loop worker tokenize, send and score a step's
    requests one after another; a host with the cores gets more of each, up to verl's 8."""
    assert [verl_release.loop_workers(c) for c in (None, 1, 2, 7, 8, 16, 32, 64, 256)] == [
        1, 1, 1, 1, 2, 4, 8, 8, 8,
    ]  # fmt: skip
    monkeypatch.setattr(verl_release, "host_cpus", lambda: 16)
    grpo = {"algorithm": "grpo", "rollout_n": 4, "verl_version": NEWER}
    on_gpu = overrides_of(compose(job_dir, **grpo))
    assert on_gpu["actor_rollout_ref.rollout.agent.num_workers"] == "4"
    assert on_gpu["reward.num_workers"] == "4"
    on_cpu = overrides_of(compose(job_dir, profile="cpu", **grpo))
    assert on_cpu["actor_rollout_ref.rollout.agent.num_workers"] == "1"
    # a job's own override still wins
    mine = overrides_of(compose(job_dir, **grpo, overrides=["reward.num_workers=2"]))
    assert mine["reward.num_workers"] == "2"
    # what the process may run on, not the machine's total
    monkeypatch.undo()
    import os

    assert verl_release.host_cpus() == len(os.sched_getaffinity(0)) <= (os.cpu_count() or 1)


BYPASS = verl_release.BYPASS_KEY
LOG_PROBS = verl_release.ROLLOUT_LOG_PROBS_KEY


def test_the_newer_release_takes_the_old_log_probs_from_its_rollout(job_dir):
    """oldgpu-hf samples from the trainer's own fp32 parameters before any update: its
    log-probs are the old policy's, and verl 0.9.0's bypass mode skips the actor's pass."""
    grpo = {"algorithm": "grpo", "rollout_n": 4}
    new = overrides_of(compose(job_dir, **grpo, verl_version=NEWER))
    assert (new[BYPASS], new[LOG_PROBS]) == ("True", "True")
    old = overrides_of(compose(job_dir, **grpo))
    assert BYPASS not in old and LOG_PROBS not in old
    # a job's own choice stays
    mine = overrides_of(compose(job_dir, **grpo, verl_version=NEWER, overrides=[f"{BYPASS}=False"]))
    assert mine[BYPASS] == "False" and LOG_PROBS not in mine


@pytest.mark.parametrize(
    "override",
    [
        "actor_rollout_ref.rollout.top_p=0.9",
        "actor_rollout_ref.rollout.top_k=50",
        "actor_rollout_ref.rollout.top_p=null",
        "actor_rollout_ref.rollout.logprobs_mode=raw_logprobs",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        f"{LOG_PROBS}=False",
    ],
)
def test_a_rollout_whose_distribution_is_not_the_actors_keeps_the_recompute(job_dir, override):
    """Top-p, top-k and raw log-probs change what the rollout reports; bypass mode would
    replace another policy loss by its PPO clip: the actor recomputes, verl's default."""
    o = overrides_of(compose(job_dir, algorithm="grpo", rollout_n=4, verl_version=NEWER,
                             overrides=[override]))  # fmt: skip
    assert BYPASS not in o
    key, value = override.split("=")
    assert o[key] == value


def test_the_bypass_rule_reads_the_merged_overrides():
    prof = {"compute_dtype": "fp32"}
    same = ["actor_rollout_ref.rollout.top_p=1.0", "actor_rollout_ref.rollout.top_k=-1",
            "~actor_rollout_ref.actor.policy_loss.loss_mode", f"{LOG_PROBS}=false"]  # fmt: skip
    bypass = [f"{LOG_PROBS}=True", f"{BYPASS}=True"]
    assert verl_release.old_log_probs(NEWER, prof, same[:3]) == bypass
    assert verl_release.old_log_probs(NEWER, prof, [*same[:3], f"{LOG_PROBS}=true"]) == bypass
    # an explicit false is the job's: the recompute stays
    assert verl_release.old_log_probs(NEWER, prof, same) == []
    # a 16-bit compute dtype's rollout is not the actor's fp32 log-softmax; 0.5.0 has no bypass
    assert verl_release.old_log_probs(NEWER, {"compute_dtype": "fp16"}, []) == []
    assert verl_release.old_log_probs(verl_release.default(), prof, []) == []
