"""The planner and a LoRA base stored at 16 bits (base_dtype): a 7B shape on one P40."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from conftest import plan_inputs as inputs
from test_verl_release import NEWER, compose

from oldgpu import cli, plan, verl_release
from oldgpu.output import EngineError
from oldgpu.plan import memory

P40 = 24576
QWEN7 = plan.SHAPES["qwen2.5-7b"]


def lora7b(**kw: Any) -> plan.Inputs:
    base = dict(
        shape=QWEN7, model_name="qwen2.5-7b", algorithm="grpo", critic=False, rollout_n=4,
        lora_rank=32, memory_mib=P40, prompt_length=256, response_length=256,
    )  # fmt: skip
    return inputs(**{**base, **kw})


def test_a_7b_base_does_not_fit_a_p40_in_fp32_and_fits_at_16_bits() -> None:
    with pytest.raises(EngineError) as exc:
        plan.plan(lora7b(base_dtype="fp32"))
    assert exc.value.name == "plan-does-not-fit"
    assert "--base-dtype bf16 fits" in exc.value.message  # the fix is named
    found = plan.plan(lora7b(base_dtype="auto"))
    assert (found.inputs.base_dtype, found.inputs.base_auto) == ("bf16", True)
    assert found.peak <= plan.cap_mib(found.inputs)
    # The base at 2 bytes a weight, the adapters at 4; FSDP's fp32 copy of its largest unit.
    update = found.phases["actor_update"]
    want = (QWEN7.params() * 2 + found.inputs.adapter_params * 4) / plan.MIB
    assert update.resident["actor_weights"] == pytest.approx(want)
    largest_unit = max(2 * QWEN7.layer_params(), QWEN7.embedding_params()) * 4 / plan.MIB
    assert update.resident["actor_fp32_units"] == pytest.approx(largest_unit)
    # Counted in every phase the actor computes in (the HF rollout generates with it too).
    for phase in ("generate", "actor_log_prob", "ref_log_prob", "actor_update"):
        assert "actor_fp32_units" in found.phases[phase].resident, phase
    # The frozen base is reserved as allocated; the rest at LoRA's factor.
    assert update.frozen == pytest.approx(QWEN7.params() * 2 / plan.MIB)
    rest = update.allocated - update.frozen
    assert update.reserved == pytest.approx(update.frozen + memory.LORA_RESERVE_FACTOR * rest)
    # The override that stores it, with its reason.
    overrides = plan.hydra_overrides(found.inputs, found.choice, found.phases)
    assert "+actor_rollout_ref.actor.fsdp_config.model_dtype=bf16" in overrides


def test_auto_keeps_fp32_where_it_fits_and_16_bits_need_lora() -> None:
    small = plan.plan(lora7b(shape=plan.SHAPES["qwen2.5-1.5b"], base_dtype="auto"))
    assert small.inputs.base_dtype == "fp32"
    assert not any("model_dtype" in o for o in plan.hydra_overrides(
        small.inputs, small.choice, small.phases))  # fmt: skip
    with pytest.raises(EngineError, match="needs LoRA"):
        plan.plan(lora7b(lora_rank=0, algorithm="grpo", base_dtype="bf16"))
    # bf16 halves the base: never a smaller batch than fp32 at the same inputs
    fp32 = plan.plan(lora7b(shape=plan.SHAPES["qwen2.5-3b"], base_dtype="fp32"))
    bf16 = plan.plan(replace(fp32.inputs, base_dtype="bf16"))
    assert bf16.choice.train_batch_size >= fp32.choice.train_batch_size
    # a tied base (3B) is untied at 16 bits: the lm_head's frozen copy is counted too
    s3 = plan.SHAPES["qwen2.5-3b"]
    want = ((s3.params() + s3.embedding_params()) * 2 + bf16.inputs.adapter_params * 4) / plan.MIB
    assert bf16.phases["actor_update"].resident["actor_weights"] == pytest.approx(want)


def test_largest_on_a_p40_names_the_7b_shape_for_grpo_lora(capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("oldgpu.plan",))
    argv = ["plan", "--largest", "--gpu-mib", str(P40), "--arch", "pascal", "--algorithm",
            "grpo", "--rollout-n", "4", "--lora-rank", "32", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["largest"] == "qwen2.5-7b"
    row = next(r for r in doc["shapes"] if r["model"] == "qwen2.5-7b")
    assert row["base_dtype"] == "bf16"
    assert doc["plan"]["inputs"]["lora"]["base_dtype"] == "bf16"
    # Without LoRA nothing is stored at 16 bits, and the 7B shape does not fit.
    without = [a if a != "32" else "0" for a in argv]
    assert cli.main(without) == 0
    assert json.loads(capsys.readouterr().out)["largest"] != "qwen2.5-7b"


def test_checkpointing_is_off_where_the_micro_batches_fit_without_it() -> None:
    found = plan.plan(lora7b(shape=plan.SHAPES["qwen2.5-0.5b"], target_train_batch=8))
    assert found.choice.gradient_checkpointing is False
    on = replace(found.choice, gradient_checkpointing=True)
    # off costs memory (the activations of every layer), and it still fits
    assert (
        plan.estimate(found.inputs, on)["actor_update"].peak
        < found.phases["actor_update"].peak
        <= plan.cap_mib(found.inputs)
    )
    big = plan.plan(lora7b(base_dtype="auto"))
    assert big.choice.gradient_checkpointing is True  # 7B: no room for its activations


def test_a_16bit_base_is_planned_on_the_newer_release_as_on_the_default(job_dir):
    """0.9.0 has a base16 patch set (verl_0_9_0/base16.py): a LoRA job's bf16 base is its
    actor's model_dtype (a key 0.9.0's config has: no "+"), the planner counts it as it
    does 0.5.0's, and the guard lets the job store bf16."""
    lora = {"algorithm": "grpo", "rollout_n": 4, "lora_rank": 8, "train_batch_size": 32}
    doc = compose(job_dir, **lora, base_dtype="bf16", verl_version=NEWER)
    assert "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16" in doc["argv"]
    assert doc["environment"]["OLDGPU_GUARD_STORAGE_DTYPES"] == "bf16"
    pinned = compose(job_dir, **lora, base_dtype="bf16")  # 0.5.0's config lacks the key
    assert "+actor_rollout_ref.actor.fsdp_config.model_dtype=bf16" in pinned["argv"]
    for version in (NEWER, verl_release.default()):
        assert verl_release.plan_base_dtype(version, "bf16") == "bf16"
        assert verl_release.plan_base_dtype(version, "auto") == "auto"  # the search decides
    # The base and FSDP's fp32 units as 0.5.0 counts them, in every phase the actor computes.
    kw = dict(critic=False, rollout_n=4, lora_rank=32, base_dtype="bf16",
              shape=plan.SHAPES["qwen2.5-7b"], model_name="qwen2.5-7b")  # fmt: skip
    choice = plan.Choice(train_batch_size=8, ppo_mini_batch_size=8, actor_micro=1,
                         critic_micro=1, log_prob_micro=1, gradient_checkpointing=True,
                         offload=plan.Offload())  # fmt: skip
    by_version = {
        v: inputs(**kw, **verl_release.plan_fields(v)) for v in (NEWER, verl_release.default())
    }
    for phase in ("generate", "actor_log_prob", "ref_log_prob", "actor_update"):
        new, old = (memory.estimate_phase(by_version[v], choice, phase) for v in by_version)
        for key in ("actor_weights", "actor_fp32_units"):
            assert new.resident[key] == old.resident[key] > 0, (phase, key)
        assert new.frozen == old.frozen > 0


def test_a_release_without_a_base16_set_plans_fp32_and_refuses_16_bits(monkeypatch):
    from oldgpu.patch import registry

    kept = tuple(
        p
        for p in registry.registry()
        if not (p.name == verl_release.BASE16_PATCH and NEWER in p.versions)
    )
    monkeypatch.setattr(registry, "registry", lambda: kept)
    assert verl_release.plan_base_dtype(NEWER, "auto") == "fp32"
    assert verl_release.plan_base_dtype(NEWER, "fp32") == "fp32"
    with pytest.raises(EngineError) as exc:
        verl_release.plan_base_dtype(NEWER, "bf16")
    assert exc.value.name == "verl-version-unsupported"
    assert "no base16 patch set" in exc.value.message
    assert verl_release.plan_base_dtype(verl_release.default(), "bf16") == "bf16"
