"""The batch-size rules verl 0.5.0 asserts late (in its workers), checked at compose time."""

from __future__ import annotations

import pytest
from conftest import QWEN05B_CONFIG
from conftest import job_spec as spec

from oldgpu import jobs
from oldgpu.jobs import batches
from oldgpu.output import EngineError

BASE = [
    "trainer.n_gpus_per_node=4",
    "trainer.nnodes=1",
    "actor_rollout_ref.rollout.n=1",
    "data.train_batch_size=64",
    "actor_rollout_ref.actor.ppo_mini_batch_size=32",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "critic.ppo_mini_batch_size=32",
    "critic.ppo_micro_batch_size_per_gpu=8",
]


def with_(*items: str) -> list[str]:
    keys = {i.split("=", 1)[0] for i in items}
    kept = [b for b in BASE if b.split("=")[0] not in keys]
    return ["-m", "verl.trainer.main_ppo", *kept, *items]


def refused(argv: list[str]) -> str:
    with pytest.raises(EngineError) as err:
        batches.check("gsm8k", argv)
    assert err.value.code == jobs.CONFIG_INVALID and err.value.name == "job-config-invalid"
    assert "job gsm8k" in err.value.message
    return err.value.message


def test_a_consistent_run_passes():
    batches.check("gsm8k", with_())  # 32 / 4 workers = 8 a worker: micro 4 and 8 divide it


def test_an_actor_micro_batch_that_does_not_divide_a_workers_mini_batch():
    msg = refused(with_("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"))
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3" in msg
    assert "= 8" in msg and "divisor of 8" in msg


def test_the_critic_is_checked_with_gae_only():
    bad = "critic.ppo_micro_batch_size_per_gpu=5"
    assert "critic.ppo_micro_batch_size_per_gpu=5" in refused(with_(bad))
    batches.check("gsm8k", with_(bad, "algorithm.adv_estimator=grpo"))  # GRPO has no critic


def test_rollout_n_multiplies_the_mini_batch_over_the_workers():
    # 32 x 5 / 4 = 40 a worker: micro 8 divides it, micro 16 does not.
    n5 = "actor_rollout_ref.rollout.n=5"
    batches.check("gsm8k", with_(n5, "critic.ppo_micro_batch_size_per_gpu=8"))
    assert "= 40" in refused(with_(n5, "critic.ppo_micro_batch_size_per_gpu=16"))


def test_a_step_that_does_not_divide_over_the_workers():
    msg = refused(with_("data.train_batch_size=66", "trainer.nnodes=2"))
    assert "66" in msg and "8 workers" in msg


def test_a_mini_batch_larger_than_the_step():
    assert "smaller than" in refused(with_("data.train_batch_size=16"))


def test_a_mini_batch_too_small_for_the_workers():
    assert "no sequence" in refused(with_("actor_rollout_ref.actor.ppo_mini_batch_size=2"))


def test_values_verl_resolves_itself_are_left_to_it():
    batches.check("gsm8k", with_("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"))


def test_a_job_whose_overrides_break_the_rule_is_refused_when_composed(job_dir):
    job = jobs.job_from_mapping(
        spec(
            job_dir,
            profile="pascal-6.1",
            overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7"],
        )
    )
    with pytest.raises(EngineError) as err:
        jobs.compose(job, jobs.resolve_profile(job, []), 24576, QWEN05B_CONFIG, environ={})
    assert err.value.code == jobs.CONFIG_INVALID
    assert "ppo_micro_batch_size_per_gpu=7" in err.value.message


def test_the_planners_own_choices_always_pass(job_dir):
    for gpus in (1, 2, 4, 8):
        for n in (1, 4):
            job = jobs.job_from_mapping(
                spec(job_dir, profile="pascal-6.1", gpus=gpus, algorithm="grpo" if n > 1 else "gae",
                     rollout_n=n)
            )  # fmt: skip
            jobs.compose(job, jobs.resolve_profile(job, []), 24576, QWEN05B_CONFIG, environ={})
