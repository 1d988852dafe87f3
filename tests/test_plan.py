"""oldgpu plan: the memory model, its calibration, the search, the overrides and the CLI."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import pytest
from conftest import QWEN05B_CONFIG, verl_config
from conftest import plan_inputs as inputs

from oldgpu import cli, plan
from oldgpu.output import EngineError

GiB = 1024  # MiB
P40 = 24576
QWEN05 = plan.SHAPES["qwen2.5-0.5b"]


def check_divisibility(inp: plan.Inputs, c: plan.Choice) -> None:
    n = inp.gpus
    for value in (
        c.train_batch_size,
        c.ppo_mini_batch_size,
        c.actor_micro,
        c.critic_micro,
        c.log_prob_micro,
    ):
        assert isinstance(value, int)
        assert value >= 1
    assert c.train_batch_size % c.ppo_mini_batch_size == 0
    assert c.ppo_mini_batch_size % (c.actor_micro * n) == 0
    assert c.ppo_mini_batch_size % (c.critic_micro * n) == 0
    # verl normalises the mini batch per GPU (x rollout.n) and asserts the micro divides it
    assert (c.ppo_mini_batch_size * inp.rollout_n // n) % c.actor_micro == 0
    assert (c.train_batch_size * inp.rollout_n) % n == 0
    assert c.log_prob_micro <= plan.per_gpu_batch(inp, c.train_batch_size)


# -- the model ----------------------------------------------------------------------------


def test_qwen05_parameter_count():
    # Qwen2.5-0.5B: 494,032,768 parameters (tied embeddings, q/k/v biases)
    assert QWEN05.params() == 494_032_768
    assert QWEN05.dim == 64
    # the critic drops nothing (tied) and adds a 896 -> 1 value head
    assert QWEN05.critic_params() == QWEN05.params() + 896 + 1


def test_untied_model_counts_its_lm_head():
    s = plan.SHAPES["qwen2.5-7b"]
    assert 7.0e9 < s.params() < 7.8e9
    assert s.params() - s.critic_params() == s.vocab_size * s.hidden_size - s.hidden_size - 1


def test_model_dir_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN05B_CONFIG))
    assert plan.load_model_dir(tmp_path) == QWEN05


def test_model_dir_without_config_is_refused(tmp_path):
    with pytest.raises(EngineError) as err:
        plan.load_model_dir(tmp_path)
    assert err.value.name == "plan-model-config-missing"
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(EngineError) as err:
        plan.load_model_dir(tmp_path)
    assert err.value.name == "plan-model-config-invalid"
    assert "num_hidden_layers" in err.value.message


def test_kv_cache_formula():
    inp = inputs()
    c = plan.Choice(16, 16, 1, 1, 1, True, plan.Offload())
    kv = plan.estimate_phase(inp, c, "generate").moments["decode"]["kv_cache"]
    # 2 * layers * kv_heads * head_dim * 4 B * batch * (prompt + response), one layer doubled
    expect = 2 * 24 * 2 * 64 * 4 * 16 * 512 * (1 + 1 / 24) / plan.MIB
    assert kv == pytest.approx(expect)


def test_fp32_is_16_bytes_per_trained_param_and_bf16_less_in_compute():
    assert sum((plan.PRECISIONS["fp32"].master, plan.PRECISIONS["fp32"].grad)) == 8
    assert plan.PRECISIONS["fp32"].adam == 8
    c = plan.Choice(16, 16, 4, 4, 4, True, plan.Offload())
    fp32 = plan.estimate_phase(inputs(), c, "actor_update")
    bf16 = plan.estimate_phase(inputs(compute_dtype="bf16"), c, "actor_update")
    logits = [e.moments["backward"]["logits"] for e in (fp32, bf16)]
    assert logits[1] == pytest.approx(logits[0] / 2)
    assert bf16.resident["ref_weights"] == pytest.approx(fp32.resident["ref_weights"] / 2)
    assert "actor_unsharded_weights" in bf16.resident  # the bf16 compute copy
    assert fp32.resident["actor_adam"] == pytest.approx(QWEN05.params() * 8 / plan.MIB)


def test_offload_removes_state_outside_its_phase_only():
    # several GPUs: FULL_SHARD, the shards leave the GPU
    inp = inputs(gpus=2)
    off = plan.Offload(True, True, True, True)
    c = plan.Choice(16, 16, 1, 1, 1, True, off)
    gen = plan.estimate_phase(inp, c, "generate")
    assert "critic_weights" not in gen.resident and "actor_adam" not in gen.resident
    assert "ref_weights" not in gen.resident
    assert "actor_weights" in gen.resident  # generation needs the actor
    upd = plan.estimate_phase(inp, c, "actor_update")
    assert {"actor_weights", "actor_grads", "actor_adam"} <= set(upd.resident)
    assert "critic_weights" not in upd.resident
    ref = plan.estimate_phase(inp, c, "ref_log_prob")
    assert set(ref.resident) == {"ref_weights"}


def test_param_offload_frees_nothing_on_one_gpu():
    """verl 0.5.0 on one GPU (FSDP1 NO_SHARD): the module's views keep the GPU weights;
    reloading makes a second copy. Optimizer offload does free Adam's moments."""
    off = plan.Offload(True, True, True, True)
    c = plan.Choice(16, 16, 1, 1, 1, True, off)
    gen = plan.estimate_phase(inputs(), c, "generate")
    assert {"actor_weights", "critic_weights", "ref_weights"} <= set(gen.resident)
    assert "actor_adam" not in gen.resident and "critic_adam" not in gen.resident
    assert gen.peak_moment == "reload"
    assert plan.estimate_phase(inputs(), c, "critic_values").peak_moment == "reload"
    opt = plan.Offload(actor_optimizer=True, critic_optimizer=True)
    none = plan.Choice(16, 16, 1, 1, 1, True, opt)
    for phase in plan.PHASES:
        with_param = plan.estimate_phase(inputs(), c, phase)
        without = plan.estimate_phase(inputs(), none, phase)
        assert with_param.resident == without.resident


def test_checkpointing_shrinks_activations():
    on = plan.Choice(16, 16, 4, 4, 4, True, plan.Offload())
    est_on = plan.estimate_phase(inputs(), on, "actor_update")
    est_off = plan.estimate_phase(
        inputs(), replace(on, gradient_checkpointing=False), "actor_update"
    )
    on_act, off_act = (e.moments["backward"]["activations"] for e in (est_on, est_off))
    assert on_act * 5 < off_act


# -- calibration against the lent GPU's measurements --------------------------------------
# verl 0.5.0 PPO, Qwen2.5-0.5B-shaped, fp32, sdpa, HF rollout, one process (actor, critic,
# ref), prompts ~200 (max 256) / responses 256; peak reserved as torch reports it (GiB).
MEASURED = {
    # batch 1, micro 1, offload on (actor, ref and critic): 12.95 allocated / 17.75 reserved
    "article": (
        plan.Choice(1, 1, 1, 1, 1, True, plan.Offload(True, True, True, True)),
        12.95,
        17.75,
    ),
    # batch 16, micro 4, no offload: 22.35 allocated / 33.65 reserved. Gradient
    # checkpointing was off in that run: the replication below gives 22882 MiB allocated
    # with it off (the run: 22886) and 18922 with it on.
    "batch16": (plan.Choice(16, 16, 4, 4, 4, False, plan.Offload()), 22.35, 33.65),
}


def test_the_measured_batch16_setting_does_not_fit_a_p40():
    choice = MEASURED["batch16"][0]
    phases = plan.estimate(inputs(), choice)
    assert max(p.peak for p in phases.values()) > plan.cap_mib(inputs())


# Per-phase peak allocated MiB of oldgpu's replication of verl 0.5.0's memory path on the
# lent H200 (torch 2.11, transformers 4.51.3; real FSDP1 with verl's wrapping and offload
# functions, HF generate, verl's log-prob/entropy code, foreach AdamW; Qwen2.5-0.5B shape,
# fp32, sdpa, prompt 256 + response 256; the second of two steps). The last three ran
# with the allocator capped at a P40's 22528 MiB cap less the CUDA context (22028 MiB).
# ((batch, micro, log-prob micro, checkpointing, offload flags), MiB per phase of PHASES)
REPLICATION = {
    "B16m4gc1": ((16, 4, 4, True, (0, 0, 0, 0)), (13645, 15635, 15144, 13406, 17029, 18922)),
    "B16m4gc0": ((16, 4, 4, False, (0, 0, 0, 0)), (13644, 15634, 15143, 13405, 20581, 22882)),
    "B1m1gc1all": ((1, 1, 1, True, (1, 1, 1, 1)), (7604, 7604, 7604, 7604, 13260, 13263)),
    "B1m1gc1act": ((1, 1, 1, True, (1, 1, 0, 0)), (11374, 11374, 11374, 9526, 13260, 17035)),
    "B16m4lp16gc1": ((16, 4, 16, True, (0, 0, 0, 0)), (13645, 22755, 18155, 13406, 17029, 18920)),
    "B1m1gc0all": ((1, 1, 1, False, (1, 1, 1, 1)), (7603, 7603, 7603, 7603, 13259, 13265)),
    "capped-B256m2lp16": (
        (256, 2, 16, True, (0, 1, 0, 1)),
        (11901, 15220, 10621, 5798, 13264, 15165),
    ),
    "capped-B64m1lp4": ((64, 1, 4, True, (0, 0, 0, 0)), (14805, 15636, 15144, 13297, 17030, 18922)),
    "capped-B256m4lp16": (
        (256, 4, 16, True, (0, 1, 0, 1)),
        (11901, 15220, 10621, 5871, 13264, 15157),
    ),
}


@pytest.mark.usefixtures("verls_own_logits")  # measured before the logits patch set
@pytest.mark.parametrize("name", sorted(REPLICATION))
def test_each_phase_matches_the_replication(name):
    (batch, micro, lp_micro, gc, flags), measured = REPLICATION[name]
    off = plan.Offload(*(bool(f) for f in flags))
    choice = plan.Choice(batch, batch, micro, micro, lp_micro, gc, off)
    phases = plan.estimate(inputs(memory_mib=143771), choice)
    for phase, mib in zip(plan.PHASES, measured, strict=True):
        # within 2% below (the allocator's rounding) and 8% above (conservative)
        assert 0.98 * mib <= phases[phase].allocated <= 1.08 * mib, (phase, mib)


@pytest.mark.usefixtures("verls_own_logits")  # measured before the logits patch set
@pytest.mark.parametrize("name", sorted(MEASURED))
def test_calibration_reproduces_the_measured_reserved_peak(name):
    choice, allocated, reserved = MEASURED[name]
    inp = inputs(memory_mib=143771, profile_name="hopper (measured as fp32)")
    phases = plan.estimate(inp, choice)
    est_reserved = max(p.reserved for p in phases.values()) / GiB
    est_allocated = max(p.allocated for p in phases.values()) / GiB
    assert est_reserved == pytest.approx(reserved, rel=0.15), phases
    assert est_allocated == pytest.approx(allocated, rel=0.10), phases


# -- fits / does not fit ------------------------------------------------------------------


def test_cap_is_22_gib_on_a_24_gib_card():
    assert plan.cap_mib(inputs()) == 22 * GiB
    assert plan.cap_mib(inputs(memory_mib=16384)) == 16384 - 2048
    assert plan.cap_mib(inputs(memory_mib=40960)) == int(0.92 * 40960)
    assert plan.cap_mib(inputs(headroom_mib=4096)) == P40 - 4096


def test_qwen05_fits_a_p40():
    found = plan.plan(inputs())
    c = found.choice
    assert found.peak <= plan.cap_mib(found.inputs)
    check_divisibility(found.inputs, c)
    assert c.train_batch_size >= 16  # far past the article's batch 1
    assert c.gradient_checkpointing
    assert c.log_prob_micro >= c.actor_micro
    assert not c.offload.actor_param  # param offload is the last resort
    for est in found.phases.values():
        assert est.peak <= plan.cap_mib(found.inputs)


def test_7b_fp32_on_24_gb_is_refused_with_what_to_change():
    inp = inputs(shape=plan.SHAPES["qwen2.5-7b"], model_name="qwen2.5-7b")
    with pytest.raises(EngineError) as err:
        plan.plan(inp)
    assert err.value.name == "plan-does-not-fit"
    msg = err.value.message
    assert msg.startswith("qwen2.5-7b (7.62B params, fp32) does not fit 1 x 24576 MiB")
    assert "actor_update" in msg
    assert "smaller model (qwen2.5-0.5b fits)" in msg
    assert "GPUs" in msg


def test_tiny_cap_is_refused():
    with pytest.raises(EngineError) as err:
        plan.plan(inputs(memory_mib=4096))
    assert err.value.name == "plan-does-not-fit"
    assert "What to change" in err.value.message


def test_long_responses_name_a_length_that_fits():
    with pytest.raises(EngineError) as err:
        plan.plan(inputs(response_length=16384))
    msg = err.value.message
    length = int(msg.split("--response-length ")[1].split()[0])
    assert 256 <= length < 16384
    assert plan.plan(inputs(response_length=length)).peak <= plan.cap_mib(inputs())
    with pytest.raises(EngineError):
        plan.plan(inputs(response_length=length + 1))


def test_more_gpus_are_suggested_when_sharding_fits():
    inp = inputs(memory_mib=16384)
    with pytest.raises(EngineError) as err:
        plan.plan(inp)
    assert "--gpus 2 fits" in err.value.message
    wider = plan.plan(replace(inp, gpus=2))
    check_divisibility(wider.inputs, wider.choice)


def test_no_critic_is_suggested_when_it_fits():
    inp = inputs(shape=plan.SHAPES["qwen2.5-1.5b"], memory_mib=61440, model_name="qwen2.5-1.5b")
    with pytest.raises(EngineError) as err:
        plan.plan(inp)
    assert "--no-critic fits" in err.value.message
    assert plan.plan(replace(inp, critic=False)).choice.train_batch_size >= 1


def test_target_train_batch_is_kept_or_refused():
    found = plan.plan(inputs(target_train_batch=64))
    assert found.choice.train_batch_size == 64
    check_divisibility(found.inputs, found.choice)
    with pytest.raises(EngineError) as err:
        plan.plan(inputs(target_train_batch=100000))
    assert "--target-train-batch" in err.value.message


def test_no_offload_allowed_refuses_what_only_offload_fits():
    inp = inputs()
    found = plan.plan(inp)
    assert found.choice.offload == plan.Offload(actor_optimizer=True, critic_optimizer=True)
    with pytest.raises(EngineError) as err:
        plan.plan(replace(inp, max_offload="none"))
    assert "--max-offload all" in err.value.message


@pytest.mark.parametrize("bad", [{"prompt_length": 0}, {"gpus": 0}, {"memory_mib": -1}])
def test_bad_inputs_are_refused(bad):
    with pytest.raises(EngineError) as err:
        plan.plan(inputs(**bad))
    assert err.value.name == "plan-bad-input"


# -- the search's invariants --------------------------------------------------------------


def random_inputs(rng: random.Random) -> plan.Inputs:
    return inputs(
        memory_mib=rng.choice([8192, 12288, 16384, 24576, 32768, 40960, 81920, 143771]),
        gpus=rng.choice([1, 1, 2, 3, 4, 8]),
        shape=rng.choice(list(plan.SHAPES.values())),
        prompt_length=rng.choice([64, 200, 256, 512, 1024]),
        response_length=rng.choice([32, 128, 256, 500, 1024]),
        compute_dtype=rng.choice(["fp32", "bf16"]),
        critic=rng.random() < 0.6,
        ref=rng.random() < 0.7,
        rollout_n=rng.choice([1, 1, 2, 5]),
        ppo_mini_batches=rng.choice([1, 2, 4, 8]),
    )


def test_batch_sizes_divide_over_many_random_inputs():
    rng = random.Random(20260)
    planned = 0
    for _ in range(150):
        inp = random_inputs(rng)
        try:
            found = plan.plan(inp)
        except EngineError as err:
            assert err.name == "plan-does-not-fit"
            continue
        planned += 1
        check_divisibility(inp, found.choice)
        assert found.peak <= plan.cap_mib(inp)
    assert planned > 40


def test_more_memory_never_gives_a_smaller_batch():
    rng = random.Random(7)
    for _ in range(12):
        inp = random_inputs(rng)
        last = 0
        for memory in range(6144, 90000, 3072):
            found = plan.search(replace(inp, memory_mib=memory))
            batch = found.choice.train_batch_size if found else 0
            assert batch >= last, (inp, memory)
            last = batch


def test_more_gpus_never_lower_the_per_gpu_fit():
    one = plan.search(inputs(memory_mib=16384))
    two = plan.search(inputs(memory_mib=16384, gpus=2))
    assert two is not None
    assert one is None or two.choice.train_batch_size >= one.choice.train_batch_size


# -- profiles -----------------------------------------------------------------------------


def run_cli(capsys, *argv: str) -> tuple[int, Any, str]:
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if "--json" in argv and out else out, err


@pytest.mark.parametrize(
    ("flags", "dtype", "rollout"),
    [
        (["--arch", "pascal"], "fp32", "hf"),
        (["--profile", "volta-7.0"], "fp16", "vllm"),
        (["--cc", "8.0"], "bf16", "vllm"),
        (["--profile", "cpu", "--host-mib", "65536"], "fp32", "hf"),
    ],
)
def test_each_profile_plans(capsys, monkeypatch, flags, dtype, rollout):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("oldgpu.plan",))
    memory = [] if "cpu" in flags else ["--gpu-mib", "24576"]
    code, doc, _ = run_cli(capsys, *flags, *memory, "--prompt-length", "256", "--json")
    assert code == 0
    assert doc["inputs"]["compute_dtype"] == dtype
    assert doc["inputs"]["rollout"] == rollout
    keys = [o.split("=", 1)[0] for o in doc["hydra_overrides"]]
    vllm_keys = [k for k in keys if "gpu_memory_utilization" in k or "max_num" in k]
    if rollout == "hf":
        assert vllm_keys == []
    else:
        assert vllm_keys == [
            "actor_rollout_ref.rollout.gpu_memory_utilization",
            "actor_rollout_ref.rollout.max_num_seqs",
            "actor_rollout_ref.rollout.max_num_batched_tokens",
        ]
        value = {k: o.split("=", 1)[1] for k, o in zip(keys, doc["hydra_overrides"], strict=True)}
        util = float(value[vllm_keys[0]])
        assert 0 < util <= plan.VLLM_MAX_UTILIZATION
        # The whole rollout batch at once; a step schedules at least one whole sequence.
        assert int(value[vllm_keys[1]]) == doc["choice"]["train_batch_size"]
        seq = doc["inputs"]["prompt_length"] + doc["inputs"]["response_length"]
        assert int(value[vllm_keys[2]]) >= seq
        assert value["actor_rollout_ref.rollout.enforce_eager"] in ("True", "False")
    if "cpu" in flags:
        assert doc["inputs"]["memory_source"] == "host"
        assert not any(v for k, v in doc["choice"]["offload"].items() if k != "level")
        assert "trainer.n_gpus_per_node" not in keys
    assert doc["estimate"]["peak_mib"] <= doc["estimate"]["cap_mib"]


def test_bf16_needs_no_more_than_fp32():
    fp32 = plan.plan(inputs())
    bf16 = plan.plan(inputs(compute_dtype="bf16"))
    assert bf16.choice.train_batch_size >= fp32.choice.train_batch_size
    assert bf16.choice.log_prob_micro >= fp32.choice.log_prob_micro


def test_no_critic_drops_its_keys_and_phases():
    found = plan.plan(inputs(critic=False))
    assert "critic_update" not in found.phases
    overrides = plan.hydra_overrides(found.inputs, found.choice, found.phases)
    assert not any(o.startswith("critic.") for o in overrides)
    with_critic = plan.plan(inputs())
    assert found.choice.train_batch_size >= with_critic.choice.train_batch_size


# -- the CLI ------------------------------------------------------------------------------


@pytest.fixture
def plan_cli(monkeypatch, capsys):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("oldgpu.plan",))

    def _run(*argv: str) -> tuple[int, Any, str]:
        return run_cli(capsys, *argv)

    return _run


P40_ARGS = (
    "--gpu-mib",
    "24576",
    "--arch",
    "pascal",
    "--model-shape",
    "qwen2.5-0.5b",
    "--prompt-length",
    "256",
    "--response-length",
    "256",
)


def test_cli_json_shape(plan_cli):
    code, doc, _ = plan_cli(*P40_ARGS, "--json")
    assert code == 0
    assert set(doc) == {
        "inputs",
        "model",
        "choice",
        "estimate",
        "hydra_overrides",
        "reasons",
        "notes",
    }
    assert doc["model"]["params"] == 494_032_768
    choice = doc["choice"]
    assert set(choice) == {
        "train_batch_size",
        "ppo_mini_batch_size",
        "micro_batches",
        "gradient_checkpointing",
        "offload",
    }
    assert set(choice["micro_batches"]) == {"actor", "critic", "rollout_log_prob", "ref_log_prob"}
    assert set(choice["offload"]) == {
        "level",
        "actor_param",
        "actor_optimizer",
        "ref_param",
        "critic_param",
        "critic_optimizer",
    }
    est = doc["estimate"]
    assert est["peak_mib"] <= est["cap_mib"] == 22528
    assert set(est["per_phase"]) == set(plan.PHASES)
    for phase in est["per_phase"].values():
        assert {"peak_mib", "allocated_mib", "reserved_mib", "breakdown"} <= set(phase)
        assert {"resident", "transient", "allocator_reserve", "context"} <= set(phase["breakdown"])
        assert phase["peak_mib"] >= phase["reserved_mib"] >= phase["allocated_mib"]
    assert len(doc["reasons"]) == len(doc["hydra_overrides"])
    for override, reason in zip(doc["hydra_overrides"], doc["reasons"], strict=True):
        assert reason.startswith(override + ": ") and len(reason) > len(override) + 5
    assert f"data.train_batch_size={choice['train_batch_size']}" in doc["hydra_overrides"]


def test_cli_text_prints_each_override_with_its_estimate(plan_cli):
    code, out, _ = plan_cli(*P40_ARGS)
    assert code == 0
    assert "peak" in out and "cap 22528 MiB" in out
    lines = out.splitlines()
    i = lines.index(
        "  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="
        + out.split("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=")[1].split()[0]
    )
    assert "MiB" in lines[i + 1] and lines[i + 1].lstrip().startswith("#")


def test_cli_refusal_is_an_engine_error(plan_cli):
    code, doc, err = plan_cli(
        "--gpu-mib", "24576", "--arch", "pascal", "--model-shape", "qwen2.5-7b", "--json"
    )
    assert code == 2
    assert doc["error"] == "plan-does-not-fit"
    assert "plan-does-not-fit" in err


def test_cli_reads_a_model_dir(plan_cli, tmp_path):
    config = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, doc, _ = plan_cli(
        "--gpu-mib", "8192", "--arch", "pascal", "--model", str(tmp_path), "--json"
    )
    assert code == 0
    assert doc["model"]["hidden_size"] == 64
    assert doc["choice"]["train_batch_size"] == plan.MAX_TRAIN_BATCH


def test_cli_memory_from_detect(plan_cli, monkeypatch):
    smi = "0, Tesla P40, 00000000:03:00.0, 0x1B3810DE, 24576, 6.1, 535.183.01\n"
    monkeypatch.setattr(plan.detect, "run_nvidia_smi", lambda: smi)
    monkeypatch.setattr(plan.detect, "run_lspci", lambda: None)
    code, doc, _ = plan_cli("--prompt-length", "256", "--json")
    assert code == 0, doc
    assert doc["inputs"]["memory_mib"] == 24576
    assert doc["inputs"]["profile"].startswith("pascal")


def test_cli_without_a_gpu_refuses_rather_than_planning_for_the_cpu(plan_cli, monkeypatch):
    monkeypatch.setattr(plan.detect, "run_nvidia_smi", lambda: None)
    monkeypatch.setattr(plan.detect, "run_lspci", lambda: None)
    for argv in (("--gpu-mib", "24576"), ("--host-mib", "65536"), ()):
        code, doc, _ = plan_cli(*argv, "--json")
        assert code == 2, argv
        assert doc["error"] == "plan-no-gpu", argv
        assert "--profile" in doc["message"] and "--gpu-mib" in doc["message"]


# -- the overrides against verl 0.5.0's own config ----------------------------------------


PLANS_TO_COMPOSE = {
    "p40": inputs(),
    "p40-no-critic-no-ref": inputs(critic=False, ref=False),
    "two-gpus-param-offload": inputs(gpus=2, memory_mib=16384),
    "two-gpus-grpo": inputs(gpus=2, critic=False, rollout_n=4, memory_mib=32768),
    "ampere-vllm": inputs(compute_dtype="bf16", rollout="vllm", memory_mib=40960),
}


@pytest.mark.parametrize("name", sorted(PLANS_TO_COMPOSE))
def test_overrides_compose_with_verls_own_config(verl_pristine, name):
    """Hydra applies every override to verl 0.5.0's ppo_trainer config: no key is
    missing (Hydra refuses those without ``+``) and each value lands where it should."""
    OmegaConf = pytest.importorskip("omegaconf").OmegaConf

    from oldgpu import profile

    found = plan.plan(PLANS_TO_COMPOSE[name])
    overrides = plan.hydra_overrides(found.inputs, found.choice, found.phases)
    assert not any(o.startswith("+") for o in overrides)
    arch = "ampere" if found.inputs.rollout == "vllm" else "pascal"
    together = profile.profile_for_arch(arch)["hydra_overrides"] + overrides
    cfg = verl_config(verl_pristine, together)
    for override in overrides:
        key, value = override.split("=", 1)
        assert str(OmegaConf.select(cfg, key)) == value, override
    # what verl derives from them (interpolations) agrees
    c = found.choice
    assert cfg.actor_rollout_ref.rollout.response_length == found.inputs.response_length
    if found.inputs.critic:
        assert cfg.critic.forward_micro_batch_size_per_gpu == c.critic_micro


def test_vllm_settings_follow_the_generate_phase():
    from oldgpu.plan.memory import VLLM_CUDA_GRAPH_MIB, PhaseEstimate, vllm_settings

    inp = plan.Inputs(
        memory_mib=16384, gpus=1, shape=plan.SHAPES["qwen2.5-0.5b"], prompt_length=1024,
        response_length=8000, compute_dtype="fp16", rollout="vllm", rollout_n=2,
    )  # fmt: skip

    def phase(resident: float) -> PhaseEstimate:
        return PhaseEstimate({"w": resident}, {"decode": {"kv": 1000.0}}, context=500.0)

    roomy = vllm_settings(inp, 64, phase(1000.0))
    assert roomy["max_num_seqs"] == 128  # 64 prompts x rollout.n 2 on one GPU
    assert roomy["max_num_batched_tokens"] == 9024  # a whole sequence, above 8192
    assert roomy["enforce_eager"] is False
    # Less than the graphs' budget left beside the generate phase: eager.
    tight = vllm_settings(inp, 64, phase(16384.0 - 1500.0 - VLLM_CUDA_GRAPH_MIB + 1))
    assert tight["enforce_eager"] is True
    assert 0 < tight["gpu_memory_utilization"] <= plan.VLLM_MAX_UTILIZATION


# -- the logits patch set on the P40's fp32 path -------------------------------------------


def test_p40_plan_at_batch_256_grows_with_the_logits_patch_set():
    """The P40's PPO plan at batch 256 (KL loss, so a ref): actor and critic micro 4 and
    log-prob micro 32 with the response's logits only; 2, 2 and 16 without them."""
    inp = inputs(target_train_batch=256, ref=True)
    c = plan.plan(inp).choice
    assert (c.train_batch_size, c.actor_micro, c.critic_micro, c.log_prob_micro) == (
        256,
        4,
        4,
        32,
    )


@pytest.mark.usefixtures("verls_own_logits")
def test_p40_plan_at_batch_256_without_the_logits_patch_set():
    c = plan.plan(inputs(target_train_batch=256, ref=True)).choice
    assert (c.actor_micro, c.critic_micro, c.log_prob_micro) == (2, 2, 16)


def test_p40_plan_measured_on_the_safe_side():
    """The plan above ran on the lent H100 under the P40 guard (bench/results/2026-12-06-h100,
    setting b): 14.79 GiB allocated, 20.69 GiB reserved at the peak. The planner's
    reserved peak must not be under the measured one, nor more than 10% over."""
    inp = inputs(target_train_batch=256, ref=True)
    found = plan.plan(inp)
    reserved = max(p.reserved for p in plan.estimate(inp, found.choice).values()) / GiB
    assert 20.69 <= reserved <= 1.10 * 20.69, reserved
