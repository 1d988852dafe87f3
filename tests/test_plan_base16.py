"""The planner and a LoRA base stored at 16 bits (base_dtype): a 7B shape on one P40."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from conftest import plan_inputs as inputs

from oldgpu import cli, plan
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
