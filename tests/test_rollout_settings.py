"""The oldgpu-hf server's engine settings: every value checked by name, at the server and
already at `oldgpu job` compose time (before a unit starts)."""

from __future__ import annotations

import pytest
from conftest import QWEN05B_CONFIG
from conftest import job_spec as spec

from oldgpu import jobs
from oldgpu.output import EngineError
from oldgpu.rollout import settings

KEY = "+actor_rollout_ref.rollout.engine_kwargs.oldgpu_hf"


def test_numbers_come_back_converted_and_null_means_the_default():
    got = settings.from_engine_kwargs(
        {
            "oldgpu-hf": {
                "max_batch_tokens": "4096",
                "max_batch_size": 16,
                "batch_window_ms": "50",
                "batch_max_wait_ms": 0,
                "request_timeout_s": 600,
                "sleep_wait_s": None,
                "weights": "copy",
            }
        }
    )
    assert got == {
        "max_batch_tokens": 4096,
        "max_batch_size": 16,
        "batch_window_ms": 50.0,
        "batch_max_wait_ms": 0.0,
        "request_timeout_s": 600.0,
        "weights": "copy",
    }
    assert isinstance(got["max_batch_tokens"], int) and isinstance(got["batch_window_ms"], float)
    assert settings.from_engine_kwargs(None) == {}
    # Hydra's spelling of the engine name reads the same.
    assert settings.from_engine_kwargs({"oldgpu_hf": {"max_batch_size": 2}}) == {
        "max_batch_size": 2
    }


@pytest.mark.parametrize(
    ("name", "raw", "says"),
    [
        ("max_batch_tokens", "lots", "not an integer"),
        ("max_batch_tokens", 40.5, "not an integer"),
        ("max_batch_tokens", 0, "expected >= 1"),
        ("max_batch_size", True, "not an integer"),
        ("max_batch_size", -3, "expected >= 1"),
        ("batch_window_ms", "fast", "not a number"),
        ("batch_window_ms", -1, "expected >= 0"),
        ("batch_max_wait_ms", "nan", "not a number"),
        ("request_timeout_s", "inf", "not a number"),
        ("request_timeout_s", 0, "expected >= 1"),
        ("sleep_wait_s", [3], "not a number"),
        ("weights", "shared", "expected one of trainer, copy"),
    ],
)
def test_a_bad_value_is_refused_by_name(name, raw, says):
    with pytest.raises(settings.RolloutSettingInvalid) as err:
        settings.parse({name: raw})
    assert f"{name}=" in str(err.value) and says in str(err.value)


def test_a_misspelt_setting_is_refused_not_dropped():
    with pytest.raises(settings.RolloutSettingInvalid) as err:
        settings.parse({"batch_windows_ms": 50})
    assert "unknown engine setting 'batch_windows_ms'" in str(err.value)
    assert "batch_window_ms" in str(err.value)


def test_overrides_are_checked_and_other_engines_left_alone():
    settings.check_overrides(
        [
            f"{KEY}.max_batch_tokens=8192",
            f"{KEY}.batch_window_ms=null",
            "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=oops",
            "actor_rollout_ref.rollout.n=4",
        ]
    )
    with pytest.raises(settings.RolloutSettingInvalid, match="max_batch_tokens='8k'"):
        settings.check_overrides([f"{KEY}.max_batch_tokens=8k"])


@pytest.mark.parametrize(
    ("override", "says"),
    [
        (f"{KEY}.batch_max_wait_ms=soon", "batch_max_wait_ms='soon' is not a number"),
        (f"{KEY}.max_batch_token=4096", "unknown engine setting 'max_batch_token'"),
    ],
)
def test_a_job_with_a_bad_setting_stops_at_compose(job_dir, override, says):
    job = jobs.job_from_mapping(
        spec(job_dir, profile="pascal-6.1", verl_version="0.9.0", algorithm="grpo",
             rollout_n=4, overrides=[override])
    )  # fmt: skip
    with pytest.raises(EngineError) as err:
        jobs.compose(job, jobs.resolve_profile(job, []), 24576, QWEN05B_CONFIG, environ={})
    assert err.value.code == jobs.CONFIG_INVALID and err.value.name == "job-config-invalid"
    assert "job gsm8k" in err.value.message and says in err.value.message


def test_the_planners_own_token_budget_passes(job_dir):
    job = jobs.job_from_mapping(
        spec(job_dir, profile="pascal-6.1", verl_version="0.9.0", algorithm="grpo", rollout_n=4)
    )
    doc = jobs.compose(job, jobs.resolve_profile(job, []), 24576, QWEN05B_CONFIG, environ={})
    assert any(a.startswith(f"{KEY}.max_batch_tokens=") for a in doc["argv"])
