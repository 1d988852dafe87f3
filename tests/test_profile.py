"""oldgpu profile: per-architecture decisions, driver selection, the JSON contract."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_runner, verl_config

from oldgpu import detect, profile
from oldgpu.output import EngineError

DATA = Path(__file__).parent / "data"
REC = DATA / "detect"
EXCERPT = DATA / "pci.ids.excerpt"

PROFILE_KEYS = {
    "name",
    "architecture",
    "architectures",
    "compute_capability",
    "compute_capability_tuple",
    "compute_capabilities",
    "device",
    "gpu_count",
    "driver",
    "torch",
    "compute_dtype",
    "attn_implementation",
    "attn_fallback",
    "rollout",
    "torch_compile",
    "flash_attn_allowed",
    "vllm_allowed",
    "hydra_overrides",
    "rollout_environment",
    "python_lock",
    "patch_options",
    "notes",
}
DRIVER_KEYS = {"required", "branches", "default", "selected", "flavours", "flavour", "distro"}
TORCH_KEYS = {
    "version",
    "variant",
    "triton",
    "cuda_arch_list",
    "kernels",
    "has_kernels",
    "min_driver",
}


@pytest.fixture
def run_cli(monkeypatch, capsys):
    return cli_runner(monkeypatch, capsys, ("oldgpu.detect", "oldgpu.profile"))


def gpus(*records: str) -> list[dict[str, Any]]:
    """Detect's GPUs from recordings (nvidia-smi ``.csv``/``.txt``, lspci ``.lspci.txt``)."""
    smi = next((r for r in records if "nvidia-smi" in r), None)
    lspci = next((r for r in records if "lspci" in r), None)
    return detect.detect(
        (REC / smi).read_text() if smi else None,
        (REC / lspci).read_text() if lspci else None,
        EXCERPT,
        run_tools=False,
    )["gpus"]


def gpu(arch: str, cc: str | None = None) -> dict[str, Any]:
    return {"architecture": arch, "compute_capability": cc or profile.PROFILES[arch].cc}


# -- the table --------------------------------------------------------------------


def test_every_detected_architecture_has_a_profile():
    archs = {a for _, a, _ in detect.CHIP_FAMILIES} | set(detect._CC_ARCH.values())
    assert archs <= set(profile.PROFILES)
    assert "cpu" in profile.PROFILES


@pytest.mark.parametrize(
    ("arch", "dtype", "attn", "fallback", "rollout", "compile_", "flash", "vllm"),
    [
        ("kepler", "fp32", "sdpa", "eager", "hf", False, False, False),
        ("maxwell", "fp32", "sdpa", "eager", "hf", False, False, False),
        ("pascal", "fp32", "sdpa", "eager", "hf", False, False, False),
        ("volta", "fp16", "sdpa", "eager", "vllm", True, False, True),
        ("turing", "fp16", "sdpa", "eager", "vllm", True, False, True),
        ("ampere", "bf16", "flash_attention_2", "sdpa", "vllm", True, True, True),
        ("ada", "bf16", "flash_attention_2", "sdpa", "vllm", True, True, True),
        ("hopper", "bf16", "flash_attention_2", "sdpa", "vllm", True, True, True),
        ("cpu", "fp32", "sdpa", "eager", "hf", False, False, False),
    ],
)
def test_decisions(arch, dtype, attn, fallback, rollout, compile_, flash, vllm):
    p = profile.profile_for_arch(arch)
    assert (
        p["compute_dtype"],
        p["attn_implementation"],
        p["attn_fallback"],
        p["rollout"],
        p["torch_compile"],
        p["flash_attn_allowed"],
        p["vllm_allowed"],
    ) == (dtype, attn, fallback, rollout, compile_, flash, vllm)
    assert p["patch_options"]["compute_dtype"] == dtype
    assert p["patch_options"]["attn_implementation"] == attn


@pytest.mark.parametrize(
    "cc", ["3.0", "3.5", "3.7", "5.0", "5.2", "6.0", "6.1", "6.2", "7.0", "7.2", "7.5"]
)
def test_no_bf16_below_8_0(cc):
    p = profile.profile_for_cc(cc)
    # fp16 where there are tensor cores (7.x), fp32 below.
    assert p["compute_dtype"] == ("fp16" if detect.cc_tuple(cc) >= (7, 0) else "fp32")
    assert not p["flash_attn_allowed"]
    assert not any("bf16" in o for o in p["hydra_overrides"])


@pytest.mark.parametrize("cc", ["8.0", "8.6", "8.9", "9.0"])
def test_bf16_from_8_0(cc):
    assert profile.profile_for_cc(cc)["compute_dtype"] == "bf16"


@pytest.mark.parametrize(("cc", "allowed"), [("6.1", False), ("7.0", True), ("7.5", True)])
def test_vllm_and_compile_need_7_0(cc, allowed):
    p = profile.profile_for_cc(cc)
    assert p["vllm_allowed"] is p["torch_compile"] is allowed
    assert ("actor_rollout_ref.actor.use_torch_compile=False" in p["hydra_overrides"]) is (
        not allowed
    )


def test_table_only_loosens_with_generation():
    # profile_for_gpus takes the oldest GPU's row as the most restrictive one.
    rows = sorted((r for a, r in profile.PROFILES.items() if a != "cpu"), key=lambda r: r.order)
    for older, newer in itertools.pairwise(rows):
        for flag in ("torch_compile", "flash_attn_allowed", "vllm_allowed"):
            assert getattr(older, flag) <= getattr(newer, flag)
        rank = {"fp32": 0, "fp16": 1, "bf16": 2}
        assert rank[older.compute_dtype] <= rank[newer.compute_dtype]
        assert detect.cc_tuple(older.cc) < detect.cc_tuple(newer.cc)
    for row in rows:
        assert (row.compute_dtype == "bf16") is (detect.cc_tuple(row.cc) >= (8, 0))


# -- torch ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cc", "sm"),
    [
        ("6.1", "sm_60"),
        ("6.0", "sm_60"),
        ("5.2", "sm_50"),
        ("7.5", "sm_75"),
        ("8.9", "sm_86"),
        ("9.0", "sm_90"),
        ("3.7", None),
        ("12.0", None),
    ],
)
def test_torch_kernels(cc, sm):
    arch_list = ["5.0", "6.0", "7.0", "7.5", "8.0", "8.6", "9.0"]
    assert profile.torch_kernels(cc, arch_list) == sm


def test_torch_from_pins():
    t = profile.profile_for_arch("pascal")["torch"]
    assert (t["version"], t["variant"]) == ("2.6.0", "cu118")
    assert t["kernels"] == {"6.1": "sm_60"} and t["has_kernels"] is True


def test_kepler_has_no_kernels_in_the_cu118_build():
    p = profile.profile_for_arch("kepler")
    assert p["torch"]["has_kernels"] is False
    assert p["torch"]["kernels"] == {"3.7": None}
    assert any("no kernels for compute capability 3.7" in n for n in p["notes"])
    assert p["driver"]["selected"] == 470
    assert any("minor-version compatibility" in n for n in p["notes"])


# -- driver selection -------------------------------------------------------------


def test_p40_driver():
    d = profile.select_driver([gpu("pascal")])
    assert d == {
        "required": True,
        "branches": [470, 535, 550, 580],
        "default": 535,
        "selected": 535,
        "flavours": ["proprietary"],
        "flavour": "proprietary",
        "distro": None,
    }


def test_470_on_a_p40_is_allowed():
    assert profile.select_driver([gpu("pascal")], 470)["selected"] == 470


def test_open_modules_on_pascal_stop():
    with pytest.raises(EngineError) as exc:
        profile.select_driver([gpu("pascal")], requested_flavour="open")
    assert exc.value.name == "open-modules-unsupported"


def test_open_modules_on_turing():
    d = profile.select_driver([gpu("turing")], requested_flavour="open")
    assert (d["flavour"], d["flavours"]) == ("open", ["proprietary", "open"])
    with pytest.raises(EngineError) as exc:  # 470 has no open modules
        profile.select_driver([gpu("turing")], 470, "open")
    assert exc.value.name == "open-modules-unsupported"


def test_blackwell_needs_open_modules():
    assert profile.select_driver([gpu("blackwell")])["flavour"] == "open"
    with pytest.raises(EngineError) as exc:
        profile.select_driver([gpu("blackwell")], requested_flavour="proprietary")
    assert exc.value.name == "proprietary-modules-unsupported"
    with pytest.raises(EngineError) as exc:
        profile.select_driver([gpu("pascal"), gpu("blackwell")])
    assert exc.value.name == "no-common-driver-flavour"


@pytest.mark.parametrize(
    ("arch", "branch", "error"),
    [
        ("hopper", 470, "driver-branch-unsupported"),
        ("kepler", 535, "driver-branch-unsupported"),
        ("kepler", 580, "driver-branch-unsupported"),
        ("pascal", 545, "driver-branch-unknown"),
    ],
)
def test_invalid_branches(arch, branch, error):
    with pytest.raises(EngineError) as exc:
        profile.select_driver([gpu(arch)], branch)
    assert exc.value.name == error


def test_no_gpu_driver():
    d = profile.select_driver([])
    assert d["required"] is False
    assert d["selected"] == profile.NO_GPU_BRANCH == 535
    assert d["flavour"] == "proprietary"
    assert profile.select_driver([], 470)["selected"] == 470


def test_unknown_architecture_is_named():
    # Driver 470 and no pci.ids: nothing tells what the card is.
    bare = detect.parse_nvidia_smi((REC / "p40-470.nvidia-smi.csv").read_text(), {})
    with pytest.raises(EngineError) as exc:
        profile.profile_for_gpus(bare)
    assert exc.value.name == "unknown-gpu-architecture"
    assert "Tesla P40" in exc.value.message


# -- hosts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("records", "name", "dtype", "rollout"),
    [
        (["p40.nvidia-smi.csv"], "pascal-6.1", "fp32", "hf"),
        (["p40-470.nvidia-smi.csv"], "pascal-6.1", "fp32", "hf"),
        (["p100.nvidia-smi.csv"], "pascal-6.0", "fp32", "hf"),
        (["2xp40.nvidia-smi.csv"], "pascal-6.1", "fp32", "hf"),
        (["v100.nvidia-smi.csv"], "volta-7.0", "fp16", "vllm"),
        (["t4.nvidia-smi.csv"], "turing-7.5", "fp16", "vllm"),
        (["a100.nvidia-smi.csv"], "ampere-8.0", "bf16", "vllm"),
        (["p40-unnamed.lspci.txt"], "pascal-6.1", "fp32", "hf"),
        (["h100.lspci.txt"], "hopper-9.0", "bf16", "vllm"),
    ],
)
def test_host_profiles(records, name, dtype, rollout):
    p = profile.profile_for_gpus(gpus(*records))
    assert (p["name"], p["compute_dtype"], p["rollout"]) == (name, dtype, rollout)


def test_mixed_p40_v100_takes_the_p40():
    p = profile.profile_for_gpus(gpus("p40-v100.nvidia-smi.csv", "p40-v100.lspci.txt"))
    assert p["name"] == "pascal-6.1"
    assert p["architectures"] == ["pascal", "volta"]
    assert p["compute_capabilities"] == ["6.1", "7.0"]
    assert p["gpu_count"] == 2
    assert (p["torch_compile"], p["vllm_allowed"]) == (False, False)
    assert p["torch"]["kernels"] == {"6.1": "sm_60", "7.0": "sm_70"}
    assert p["driver"]["selected"] == 535


def test_mixed_k80_a100_shares_470():
    # 470 is Kepler's last branch and drives Ampere too.
    for records in (
        ["k80-a100-470.nvidia-smi.csv", "k80-a100.lspci.txt"],
        ["k80-a100-535.nvidia-smi.csv", "k80-a100.lspci.txt"],  # 535 cannot see the K80s
    ):
        p = profile.profile_for_gpus(gpus(*records))
        assert (p["name"], p["gpu_count"], p["driver"]["branches"]) == ("kepler-3.7", 3, [470])
        assert p["driver"]["selected"] == 470


def test_mixed_k80_h100_has_no_common_branch():
    with pytest.raises(EngineError) as exc:
        profile.profile_for_gpus(gpus("k80-h100.lspci.txt"))
    assert exc.value.name == "no-common-driver-branch"


def test_cpu_profile():
    p = profile.profile_for_gpus([])
    assert p == profile.profile_for_arch("cpu")
    assert (p["name"], p["device"], p["architecture"], p["gpu_count"]) == ("cpu", "cpu", "cpu", 0)
    assert (p["compute_dtype"], p["rollout"], p["torch_compile"]) == ("fp32", "hf", False)
    assert p["compute_capability"] is None and p["architectures"] == []
    assert p["patch_options"]["device"] == "cpu"
    assert "trainer.device=cpu" in p["hydra_overrides"]
    assert p["driver"]["required"] is False


def test_cc_and_arch_agree():
    assert profile.profile_for_cc("6.1") == profile.profile_for_arch("pascal", "6.1")
    assert profile.profile_for_cc("06.1")["compute_capability"] == "6.1"


@pytest.mark.parametrize(
    ("cc", "error"), [("six", "bad-compute-capability"), ("2.0", "unknown-compute-capability")]
)
def test_bad_cc(cc, error):
    with pytest.raises(EngineError) as exc:
        profile.profile_for_cc(cc)
    assert exc.value.name == error


# -- the CLI ----------------------------------------------------------------------


def test_cli_json_shape_p40(run_cli):
    code, p, _ = run_cli(
        "profile",
        "--json",
        "--nvidia-smi-file",
        str(REC / "p40.nvidia-smi.csv"),
        "--pci-ids",
        str(EXCERPT),
    )
    assert code == 0
    assert set(p) == PROFILE_KEYS
    assert set(p["driver"]) == DRIVER_KEYS
    assert set(p["torch"]) == TORCH_KEYS
    assert set(p["patch_options"]) == {"compute_dtype", "attn_implementation", "device"}
    assert p["name"] == "pascal-6.1"
    assert p["compute_capability_tuple"] == [6, 1]
    assert all(isinstance(o, str) for o in p["hydra_overrides"])
    assert p == json.loads(json.dumps(profile.profile_for_arch("pascal")))


@pytest.mark.parametrize(
    "argv",
    [
        ["--arch", "pascal"],
        ["--cc", "6.1"],
        ["--gpus-from-detect", "--lspci-file", str(REC / "p40.lspci.txt")],
    ],
)
def test_cli_sources_agree(run_cli, argv):
    code, p, _ = run_cli("profile", "--json", "--pci-ids", str(EXCERPT), *argv)
    assert code == 0 and p["name"] == "pascal-6.1"


def test_cli_no_gpu_is_cpu(run_cli):
    code, p, _ = run_cli("profile", "--json", "--lspci-file", str(REC / "nogpu.lspci.txt"))
    assert code == 0 and p["name"] == "cpu"


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--arch", "pascal", "--driver-flavour", "open"], "open-modules-unsupported"),
        (["--lspci-file", str(REC / "k80-h100.lspci.txt")], "no-common-driver-branch"),
        (["--arch", "hopper", "--driver-branch", "470"], "driver-branch-unsupported"),
    ],
)
def test_cli_errors(run_cli, argv, error):
    code, p, err = run_cli("profile", "--json", "--pci-ids", str(EXCERPT), *argv)
    assert code == EngineError.code
    assert p["error"] == error
    assert error in err


def test_cli_text(run_cli):
    code, out, _ = run_cli("profile", "--arch", "pascal", "--driver-branch", "470")
    assert code == 0
    assert "driver: 470 proprietary" in out
    assert "actor_rollout_ref.rollout.name=hf" in out


def test_cli_arch_and_cc_exclusive(run_cli):
    with pytest.raises(SystemExit):
        run_cli("profile", "--arch", "pascal", "--cc", "6.1")


# -- the overrides against verl 0.5.0's config --------------------------------------


@pytest.mark.parametrize("arch", sorted(profile.PROFILES))
def test_overrides_compose_with_verls_own_config(verl_pristine, arch):
    """Hydra itself applies the overrides to verl 0.5.0's ppo_trainer config.

    Hydra refuses a key without ``+`` that the config lacks, and a ``+key`` that
    it already has, so this is the same check verl's trainer makes at start.
    """
    OmegaConf = pytest.importorskip("omegaconf").OmegaConf

    overrides = profile.profile_for_arch(arch)["hydra_overrides"]
    cfg = verl_config(verl_pristine, overrides)
    for override in overrides:
        key, value = override.lstrip("+").split("=", 1)
        assert str(OmegaConf.select(cfg, key)) == value, override


# -- volta and turing: fp16, vLLM, and a job's choices -----------------------------


@pytest.mark.parametrize("arch", ["volta", "turing"])
def test_fp16_profiles_compose_vllm_in_fp16(arch):
    p = profile.profile_for_arch(arch)
    o = p["hydra_overrides"]
    # Weights stay fp32 (the scaler needs fp32 grads); only autocast is fp16.
    assert "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32" in o
    assert "+actor_rollout_ref.ref.fsdp_config.model_dtype=fp32" in o
    assert "actor_rollout_ref.rollout.name=vllm" in o
    assert "actor_rollout_ref.rollout.dtype=float16" in o
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=1" in o
    assert p["rollout_environment"] == {"VLLM_USE_V1": "0", "VLLM_ATTENTION_BACKEND": "XFORMERS"}
    assert p["patch_options"]["compute_dtype"] == "fp16"
    assert any("fp16-loss-scaler" in n for n in p["notes"])
    assert p["python_lock"] == "vllm"  # python_env installs files/requirements/vllm.lock


def test_pascal_profile_unchanged_by_the_fp16_rows():
    p = profile.profile_for_arch("pascal")
    assert p["rollout_environment"] == {} and p["python_lock"] is None
    assert not any("vllm" in o or "float16" in o for o in p["hydra_overrides"])


def test_a_job_may_choose_hf_and_fp32_on_volta():
    p = profile.profile_for_arch("volta")
    hf = profile.with_choices(p, rollout="hf")
    assert hf["rollout"] == "hf" and hf["compute_dtype"] == "fp16"
    assert "actor_rollout_ref.rollout.name=hf" in hf["hydra_overrides"]
    assert not any("rollout.dtype" in o for o in hf["hydra_overrides"])
    assert hf["rollout_environment"] == {}
    fp32 = profile.with_choices(p, rollout="hf", compute_dtype="fp32")
    assert fp32["compute_dtype"] == "fp32" and fp32["name"] == "volta-7.0"
    # The same patched tree: the fp16 set passes through at fp32 at run time.
    assert fp32["patch_options"]["compute_dtype"] == "fp16"
    assert profile.with_choices(p) == p


@pytest.mark.parametrize(
    ("arch", "choices", "error"),
    [
        ("pascal", {"rollout": "vllm"}, "rollout-unsupported"),
        ("volta", {"rollout": "sglang"}, "rollout-unknown"),
        ("volta", {"compute_dtype": "bf16"}, "compute-dtype-unsupported"),
        ("pascal", {"compute_dtype": "fp16"}, "compute-dtype-unsupported"),
    ],
)
def test_choices_the_card_cannot_take_are_refused(arch, choices, error):
    with pytest.raises(EngineError) as exc:
        profile.with_choices(profile.profile_for_arch(arch), **choices)
    assert exc.value.name == error
