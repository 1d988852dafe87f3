"""`oldgpu plan` and a job share their defaults and their refusals (issue 34, item 4), a job
left without `gpus` uses the host's cards, and verl 0.9.0's plan counts its rollout as
0.5.0's HF rollout in the trainer's process and gives the server its batch (issue 32)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import QWEN05B_CONFIG
from conftest import job_spec as spec

from oldgpu import cli, jobs, plan, profile, verl_release
from oldgpu.output import EngineError
from oldgpu.plan import SHAPES, memory, recipe_fields

DETECT = Path(__file__).parent / "data" / "detect"
TOPO = Path(__file__).parent / "data" / "topology"
NEWER = "0.9.0"


def plan_cli(capsys, *argv: str) -> tuple[int, Any]:
    code = cli.main(["plan", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def plan_parser_defaults() -> dict[str, Any]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {a.dest: a.default for a in sub.choices["plan"]._actions}


def test_the_planner_defaults_are_a_jobs():
    defaults = plan_parser_defaults()
    for field in ("prompt_length", "response_length", "rollout_n", "gpus"):
        assert defaults[field] == jobs.FIELD_BY_NAME[field].default, field


def test_one_list_of_algorithms(capsys):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    algo = next(a for a in sub.choices["plan"]._actions if a.dest == "algorithm")
    from oldgpu import recipe

    for name in recipe.ALGORITHMS:
        assert name in algo.help
    # verl's estimators the engine does not offer: refused by both, pointing at overrides
    for name in ("opo", "gpg", "grpo_passk"):
        assert name not in algo.help
        with pytest.raises(EngineError) as err:
            jobs.job_from_mapping(spec(Path("/srv/j"), algorithm=name, rollout_n=4))
        assert err.value.code == jobs.CONFIG_INVALID
        assert f"algorithm.adv_estimator={name}" in err.value.message
        code, doc = plan_cli(capsys, "--arch", "pascal", "--gpu-mib", "24576",
                             "--algorithm", name, "--rollout-n", "4")  # fmt: skip
        assert (code, doc["error"]) == (2, "plan-algorithm-unknown")
        assert "--algorithm grpo" in doc["message"]


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_a_group_algorithm_with_one_response_is_refused_by_both(capsys, algorithm):
    with pytest.raises(EngineError) as err:
        jobs.job_from_mapping(spec(Path("/srv/j"), algorithm=algorithm))
    assert "rollout_n: 1 is too few" in err.value.message
    code, doc = plan_cli(capsys, "--arch", "pascal", "--gpu-mib", "24576", "--algorithm", algorithm)
    assert (code, doc["error"]) == (2, "plan-bad-input")
    assert "--rollout-n: 1 is too few" in doc["message"]
    code, doc = plan_cli(capsys, "--arch", "pascal", "--gpu-mib", "24576",
                         "--algorithm", algorithm, "--rollout-n", "2")  # fmt: skip
    assert code == 0, doc


@pytest.mark.parametrize(
    ("typed", "hint"),
    [("ppo", "PPO with a critic is gae"), ("grpoo", "did you mean grpo?"), ("RLOO", "rloo")],
)
def test_an_unknown_algorithm_gets_a_hint(capsys, typed, hint):
    with pytest.raises(EngineError) as err:
        jobs.job_from_mapping(spec(Path("/srv/j"), algorithm=typed))
    assert hint in err.value.message and err.value.message.startswith("algorithm:")
    code, doc = plan_cli(capsys, "--arch", "pascal", "--gpu-mib", "24576", "--algorithm", typed)
    assert code == 2 and hint in doc["message"] and doc["message"].startswith("--algorithm:")


def test_a_forced_profile_reads_the_memory_from_the_recorded_nvidia_smi(capsys):
    smi = str(DETECT / "a100.nvidia-smi.csv")  # 40960 MiB: not a P40's 24576
    code, doc = plan_cli(capsys, "--profile", "ampere", "--nvidia-smi-file", smi)
    assert code == 0, doc
    assert doc["inputs"]["memory_mib"] == 40960
    code, doc = plan_cli(capsys, "--profile", "pascal", "--nvidia-smi-file", smi)
    assert code == 0, doc
    assert doc["inputs"]["memory_mib"] == 40960  # no Pascal card there: the host's cards
    empty = DETECT / "empty.lspci.txt"  # no nvidia-smi lines at all
    code, doc = plan_cli(capsys, "--profile", "pascal", "--nvidia-smi-file", str(empty))
    assert (code, doc["error"]) == (2, "plan-memory-unknown")
    assert "--gpu-mib" in doc["message"]


def test_the_planner_plans_for_every_card_of_the_profile_as_a_job_does(capsys):
    two = str(DETECT / "2xp40.nvidia-smi.csv")
    code, doc = plan_cli(capsys, "--nvidia-smi-file", two)
    assert code == 0, doc
    assert doc["inputs"]["gpus"] == 2 and "trainer.n_gpus_per_node=2" in doc["hydra_overrides"]
    code, doc = plan_cli(capsys, "--nvidia-smi-file", two, "--gpus", "1")
    assert doc["inputs"]["gpus"] == 1
    code, doc = plan_cli(capsys, "--arch", "pascal", "--gpu-mib", "24576")  # no host: one card
    assert doc["inputs"]["gpus"] == 1
    code, doc = plan_cli(capsys, "--arch", "pascal", "--gpu-mib", "24576", "--gpus", "most")
    assert (code, doc["error"]) == (2, "plan-bad-input") and "--gpus" in doc["message"]


def test_the_planner_is_told_the_release(capsys):
    argv = ("--arch", "pascal", "--gpu-mib", "24576", "--algorithm", "grpo", "--rollout-n", "4")
    code, old = plan_cli(capsys, *argv)
    code2, new = plan_cli(capsys, *argv, "--verl-version", NEWER)
    assert code == code2 == 0
    batch = new["choice"]["train_batch_size"] * 4  # the GPU's whole rollout batch
    assert f"actor_rollout_ref.rollout.max_num_seqs={batch}" in new["hydra_overrides"]
    assert f"{memory.SERVER_TOKENS_KEY}={batch * (512 + 256)}" in new["hydra_overrides"]
    assert not any("max_num_seqs" in o or "oldgpu_hf" in o for o in old["hydra_overrides"])
    code, doc = plan_cli(capsys, *argv, "--verl-version", "0.6.1")
    assert (code, doc["error"]) == (2, "verl-version-unknown")
    code, doc = plan_cli(capsys, "--arch", "ampere", "--gpu-mib", "40960", "--verl-version", NEWER)
    assert (code, doc["error"]) == (2, "verl-version-unsupported")  # vLLM: a job's refusal


def job(job_dir: Path, **extra: Any) -> jobs.Job:
    return jobs.job_from_mapping(spec(job_dir, **{"profile": "pascal", **extra}))


def test_a_job_that_does_not_fit_is_told_its_own_settings(job_dir, capsys):
    """The planner's 'what to change' names job fields to a job, flags to `oldgpu plan`."""
    for extra, field, flags in (
        (
            {"train_batch_size": 4096},
            "a smaller train_batch_size",
            ["--target-train-batch", "4096"],
        ),
        ({"response_length": 7000}, "response_length: ", ["--response-length", "7000"]),
    ):
        big = job(job_dir, **extra)
        with pytest.raises(EngineError) as err:
            jobs.compose(big, jobs.resolve_profile(big, []), 24576, QWEN05B_CONFIG, environ={})
        assert err.value.name == "plan-does-not-fit"
        assert field in err.value.message, err.value.message
        assert "--" not in err.value.message, err.value.message
        code, doc = plan_cli(capsys, "--arch", "pascal", "--gpu-mib", "24576", *flags)
        assert (code, doc["error"]) == (2, "plan-does-not-fit")
        assert flags[0] in doc["message"].split("What to change")[1], doc["message"]


def test_a_jobs_bad_input_to_the_planner_names_the_field(job_dir):
    one = job(job_dir, gpus=2, profile="cpu")
    with pytest.raises(EngineError) as err:
        jobs.compose(one, jobs.resolve_profile(one, []), 65536, QWEN05B_CONFIG, environ={})
    assert "gpus: 1" in err.value.message and "--gpus" not in err.value.message


# -- gpus: all by default ----------------------------------------------------------------


def test_a_job_without_gpus_uses_every_card_of_the_host(job_dir, capsys, tmp_path):
    values = spec(job_dir)
    del values["gpus"]  # the helper names one card; a user's job leaves it out
    assert jobs.job_from_mapping(values).gpus == "all"
    path = job_dir / "gsm8k.env"
    path.write_text(jobs.render_env(jobs.job_from_mapping(values)))
    (tmp_path / "ib").mkdir()
    code = cli.main([
        "job", "command", "--env-file", str(path), "--json",
        "--nvidia-smi-file", str(TOPO / "4xp40.nvidia-smi.csv"),
        "--topo-file", str(TOPO / "4xp40-switch.topo-m.txt"),
        "--p2p-file", str(TOPO / "4xp40-switch.topo-p2p-r.txt"),
        "--ib-dir", str(tmp_path / "ib"),
    ])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc
    assert doc["devices"] == [0, 1, 2, 3]
    assert "trainer.n_gpus_per_node=4" in doc["argv"]


def test_the_cpu_profile_counts_all_as_one_worker(job_dir):
    values = {**spec(job_dir, profile="cpu", train_batch_size=4)}
    del values["gpus"]
    cpu = jobs.job_from_mapping(values)
    tiny = {**QWEN05B_CONFIG, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 2048}  # fmt: skip
    doc = jobs.compose(cpu, jobs.resolve_profile(cpu, []), 65536, tiny, environ={})
    assert "trainer.n_gpus_per_node=1" in doc["argv"]


# -- verl 0.9.0's plan: the rollout in the trainer's process, as 0.5.0's HF rollout ------


def issue_inputs(version: str) -> plan.Inputs:
    """Issue 34's job: GRPO x 4 + LoRA 32 on Qwen2.5-1.5B, a P40, a job's 256 + 256."""
    prof = profile.profile_for_arch("pascal")
    return plan.Inputs(
        memory_mib=24576, gpus=1, shape=SHAPES["qwen2.5-1.5b"], prompt_length=256,
        response_length=256, compute_dtype=prof["compute_dtype"], rollout=prof["rollout"],
        **verl_release.plan_fields(version),
        **recipe_fields(algorithm="grpo", rollout_n=4, lora_rank=32),
    )  # fmt: skip


def reason(doc: dict[str, Any], key: str) -> str:
    return next(r for r in doc["reasons"] if r.startswith(key + "="))


def test_the_newer_release_counts_its_rollout_as_the_hf_rollout():
    """0.9.0 generates in the trainer's process from its own parameters: its generate
    phase is 0.5.0's to the MiB (the KV cache and sampling of the GPU's whole rollout
    batch), with no second weight copy and no second CUDA context in any phase."""
    old_inp, new_inp = issue_inputs(verl_release.default()), issue_inputs(NEWER)
    found = plan.plan(new_inp)
    choice = found.choice
    for phase in found.phases:
        old, new = (memory.estimate_phase(i, choice, phase) for i in (old_inp, new_inp))
        assert new.context == old.context == memory.CUDA_CONTEXT_MIB, phase
        assert new.resident == old.resident, phase
    old, new = (memory.estimate_phase(i, choice, "generate") for i in (old_inp, new_inp))
    assert new.as_dict() == old.as_dict()
    assert "rollout_server" not in json.dumps(new.as_dict())


def test_the_newer_releases_plan_gives_the_server_its_batch_and_tokens():
    found = plan.plan(issue_inputs(NEWER))
    doc = plan.payload(found)
    rows = found.choice.train_batch_size * 4
    assert rows > 64  # no fixed cap of 64 requests: the whole rollout batch in one pass
    assert f"actor_rollout_ref.rollout.max_num_seqs={rows}" in doc["hydra_overrides"]
    key = memory.SERVER_TOKENS_KEY
    assert f"{key}={rows * 512}" in doc["hydra_overrides"]
    kv = found.phases["generate"].moments["decode"]["kv_cache"]
    assert f"KV cache {kv:.0f} MiB for {rows} x 512 tokens per GPU" in reason(
        doc, "data.train_batch_size"
    )
    assert f"{rows} sequences x 512 tokens" in reason(doc, key)
    # the 0.5.0 plan of the same job is as it was: no server keys
    old = plan.payload(plan.plan(issue_inputs(verl_release.default())))
    assert "data.train_batch_size=48" in old["hydra_overrides"]
    assert not any(k in o for o in old["hydra_overrides"] for k in ("max_num_seqs", "oldgpu_hf"))


def test_the_servers_token_budget_is_bounded_by_the_memory_left():
    found = plan.plan(issue_inputs(NEWER))
    inp, gen, batch = found.inputs, found.phases["generate"], found.choice.train_batch_size
    want = batch * 4 * inp.seq
    assert memory.rollout_tokens(inp, gen, batch, 10**6) == want  # room to spare
    # a cap that leaves the KV cache half its room: about half the tokens
    kv = gen.moments["decode"]["kv_cache"]
    tight = int(gen.peak - kv * gen.reserve_factor / 2)
    half = memory.rollout_tokens(inp, gen, batch, tight)
    assert want * 0.45 < half < want * 0.55
    # never less than one whole sequence
    assert memory.rollout_tokens(inp, gen, batch, 0) == inp.seq


def test_a_plan_over_the_card_is_refused_by_name(capsys):
    """The per-process cap may allow what the card cannot hold (a small headroom): the
    card-wide sum of the job's processes on one GPU, contexts counted, is refused."""
    argv = ("--arch", "pascal", "--gpu-mib", "24576", "--algorithm", "grpo", "--rollout-n", "4")
    code, doc = plan_cli(capsys, *argv, "--verl-version", NEWER)
    assert code == 0
    card = doc["estimate"]["card"]
    assert card["usable_mib"] == 24576 - memory.CARD_RESERVED_MIB
    assert [p["process"] for p in card["processes"]] == ["trainer"]  # one process, one context
    assert card["processes"][0]["peak_mib"] == doc["estimate"]["peak_mib"] <= card["usable_mib"]
    for version in (verl_release.default(), NEWER):
        code, doc = plan_cli(capsys, *argv, "--headroom-mib", "0", "--verl-version", version)
        assert (code, doc["error"]) == (2, "plan-over-card"), doc
        assert "over the card's usable 23040 MiB" in doc["message"]
        assert "--headroom-mib" in doc["message"]


def test_the_card_reserve_is_the_guards():
    from oldgpu import guard

    for cc, cap in guard.DEFAULT_MEMORY_MIB.items():
        total = {"3.7": 12, "5.2": 24, "6.0": 16, "6.1": 24, "7.0": 32, "7.5": 16}[cc] * 1024
        assert total - memory.CARD_RESERVED_MIB == cap, cc


def test_a_job_over_the_card_is_refused_by_name(job_dir, monkeypatch):
    """``oldgpu job`` plans through the same check: a card that keeps more for its driver
    (here 4 GiB) than the planner's margin leaves a plan over the card."""
    monkeypatch.setattr(memory, "CARD_RESERVED_MIB", 4096)
    with pytest.raises(EngineError) as exc:
        jobs.compose(job(job_dir), jobs.resolve_profile(job(job_dir), []), 24576,
                     QWEN05B_CONFIG, environ={})  # fmt: skip
    assert exc.value.name == "plan-over-card"
    assert "train_batch_size" in exc.value.message  # the job's own setting, not a flag


def test_a_jobs_plan_explains_itself_in_the_jobs_terms(job_dir):
    """The reasons and notes of a job's plan (its plan.json) name job settings, not flags."""
    import re

    for extra in ({}, {"train_batch_size": 8}, {"algorithm": "grpo", "rollout_n": 2}):
        one = job(job_dir, **extra)
        doc = jobs.compose(one, jobs.resolve_profile(one, []), 24576, QWEN05B_CONFIG, environ={})
        said = " ".join([*doc["plan"]["reasons"], *doc["plan"]["notes"]])
        assert not re.search(r"--[a-z]", said), said
    assert "kl_loss_coef: 0" in said  # the job's way to drop the ref


def test_a_job_without_a_profile_on_a_host_without_gpus_is_refused(job_dir, capsys):
    """As `oldgpu plan`: no quiet fall-back to the CPU; `profile: cpu` says it."""
    empty = DETECT / "empty.lspci.txt"
    tiny = {**QWEN05B_CONFIG, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 2048}  # fmt: skip
    (job_dir / "model/config.json").write_text(json.dumps(tiny))
    for profile_name, expected in (("", 4), ("cpu", 0)):
        values = spec(job_dir, profile=profile_name, train_batch_size=4)
        path = job_dir / "gsm8k.env"
        path.write_text(jobs.render_env(jobs.job_from_mapping(values)))
        code = cli.main(["job", "command", "--env-file", str(path), "--json",
                         "--nvidia-smi-file", str(empty), "--lspci-file", str(empty)])  # fmt: skip
        doc = json.loads(capsys.readouterr().out)
        assert code == expected, doc
        if expected:
            assert doc["error"] == "job-no-gpu" and "profile: cpu" in doc["message"]
