"""oldgpu doctor: checks over recorded facts, the real probe, a real verl tree, the CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_runner, fresh_copy

from oldgpu import cli, detect, doctor, driver, pins
from oldgpu.doctor import checks as doctor_checks
from oldgpu.doctor import checks_torch, common, known_errors
from oldgpu.doctor import facts as doctor_facts

DATA = Path(__file__).parent / "data"
REC = DATA / "detect"
EXCERPT = DATA / "pci.ids.excerpt"
H200_FACTS = DATA / "doctor" / "h200-torch2.11-cu130.facts.json"

# torch.cuda.get_arch_list() of the builds the tests stand for.
CU118 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
CU128 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
TRITON_REQ = 'triton (==3.2.0) ; platform_system == "Linux" and platform_machine == "x86_64"'
NO_KERNEL = "RuntimeError: CUDA error: no kernel image is available for execution on the device"
CHECK_KEYS = {"id", "status", "seen", "fix", "details"}


# -- recorded facts -----------------------------------------------------------------


def device(index=0, name="Tesla P40", cc="6.1", total=22919, free=22700, **extra):
    return {
        "index": index,
        "name": name,
        "capability": cc,
        "total_mib": total,
        "free_mib": free,
        "kernel_ok": True,
        **extra,
    }


def probe(
    *,
    torch: str | None = "2.6.0+cu118",
    cuda: str | None = "11.8",
    arch_list=CU118,
    devices=None,
    triton: str | None = "3.2.0",
    requires=(TRITON_REQ,),
    flash_attn: str | None = None,
    verl_origin: str | None = None,
    bf16_supported: bool | None = True,
) -> dict[str, Any]:
    devices = [device()] if devices is None else devices
    t: dict[str, Any] = {"importable": torch is not None}
    if torch is None:
        t["error"] = "ModuleNotFoundError: No module named 'torch'"
    else:
        t.update(
            version=torch,
            cuda=cuda,
            cuda_available=bool(devices),
            arch_list=list(arch_list),
            device_count=len(devices),
            devices=devices,
            bf16_supported=bf16_supported if devices else None,
            warnings=[],
        )
    return {
        "python": "/opt/oldgpu/venv/bin/python",
        "machine": "x86_64",
        "system": "Linux",
        "distributions": {
            "torch": torch and torch.split("+")[0],
            "triton": triton,
            "pytorch-triton": None,
            "triton-pascal": None,
            "flash-attn": flash_attn,
            "nvidia-ml-py": "12.575.51",
            "pynvml": None,
            "verl": "0.5.0" if verl_origin else None,
        },
        "modules": {
            "flash_attn": "/opt/venv/site-packages/flash_attn/__init__.py" if flash_attn else None,
            "pynvml": "/opt/venv/site-packages/pynvml.py",
            "verl": verl_origin,
        },
        "torch_requires_triton": list(requires) if torch else [],
        "torch": t,
    }


def facts(
    smi: str | None = "p40.nvidia-smi.csv",
    lspci: str | None = None,
    *,
    probe_facts: dict[str, Any] | None = None,
    verl: dict[str, Any] | None = None,
    cc: str | None = None,
    arch: str | None = None,
    mem_available: int | None = 60000,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    report = detect.detect(
        (REC / smi).read_text() if smi else None,
        (REC / lspci).read_text() if lspci else None,
        EXCERPT,
        run_tools=False,
    )
    return {
        "schema": 1,
        "request": {"cc": cc, "arch": arch},
        "detect": report,
        "driver": doctor_facts.driver_facts(report, None),
        "probe": probe() if probe_facts is None else probe_facts,
        "host": {"mem_available_mib": mem_available, "mem_total_mib": 64000},
        "env": {k: None for k in doctor_facts.ENV_KEYS} | (env or {}),
        "verl": verl,
    }


def patched_verl(**options) -> dict[str, Any]:
    opts = {"compute_dtype": "fp32", "attn_implementation": "sdpa", "profile": "pascal-6.1"}
    opts |= {"device": "cuda", **options}
    return {
        "dir": "/opt/verl/verl",
        "manifest": {"options": opts, "verl_version": "0.5.0", "engine": {"version": "0.1.0"}},
        "modified": [],
        "check_rc": 0,
        "check": {"changed": False, "verl_version": "0.5.0", "files": []},
    }


def checks(f: dict[str, Any], **kw) -> dict[str, dict[str, Any]]:
    report = doctor_checks.evaluate(f, **kw)
    assert [c["id"] for c in report["checks"]] == list(doctor_checks.CHECK_IDS)
    for c in report["checks"]:
        assert set(c) == CHECK_KEYS
        assert c["status"] in common.STATUSES
        assert c["seen"]
        assert bool(c["fix"]) or c["status"] in ("ok", "skip"), c
    return {c["id"]: c for c in report["checks"]}


def statuses(f: dict[str, Any], **kw) -> dict[str, str]:
    return {k: c["status"] for k, c in checks(f, **kw).items()}


P40_VERL_ORIGIN = "/opt/verl/verl/verl/__init__.py"


def healthy_p40(**kw) -> dict[str, Any]:
    return facts(probe_facts=probe(verl_origin=P40_VERL_ORIGIN), verl=patched_verl(), **kw)


def _with_probe(**kw) -> dict[str, Any]:
    return facts(probe_facts=probe(verl_origin=P40_VERL_ORIGIN, **kw), verl=patched_verl())


# -- a P40 host, healthy and not -------------------------------------------------------


def test_healthy_p40_passes_every_check():
    f = healthy_p40()
    report = doctor_checks.evaluate(f)
    assert report["ok"] is True
    assert report["profile"] == "pascal-6.1"
    assert report["summary"] == "10 ok, 0 warn, 0 fail"
    c = {x["id"]: x for x in report["checks"]}
    assert "535.183.01" in c["driver"]["seen"] and "520.61.05" in c["driver"]["seen"]
    assert "CC 6.1 (pascal) -> profile pascal-6.1: fp32, sdpa" in c["gpu-capability"]["seen"]
    assert "sm_60" in c["torch-build"]["seen"]
    assert c["torch-build"]["details"]["kernels"]["6.1"] == {"kind": "sass", "code": "sm_60"}
    assert "triton 3.2.0" in c["triton"]["seen"]
    assert "patched as its manifest says" in c["verl-patch"]["seen"]
    assert "22700 MiB free" in c["gpu-memory"]["seen"]
    bf16 = c["bf16"]["seen"]
    assert bf16.startswith("fp32") and "is_bf16_supported() is not consulted" in bf16
    assert "here it says True" in bf16


def test_two_p40s_each_judged():
    f = facts(
        "2xp40.nvidia-smi.csv",
        probe_facts=probe(devices=[device(0), device(1, free=500)]),
    )
    c = checks(f)
    assert c["gpu-capability"]["seen"].count("CC 6.1") == 2
    assert c["gpu-memory"]["status"] == "fail"
    assert "cuda:1" in c["gpu-memory"]["seen"] and "cuda:1" in c["gpu-memory"]["fix"]
    assert "cuda:0 Tesla P40: 22700 MiB free" in c["gpu-memory"]["seen"]


def test_p40_driver_470_warns_under_cuda_11_8_minimum():
    c = checks(healthy_p40(smi="p40-470.nvidia-smi.csv"))
    assert c["driver"]["status"] == "warn"
    assert "470.256.02" in c["driver"]["seen"]
    assert "minor-version compatibility" in c["driver"]["seen"]
    assert "535" in c["driver"]["fix"]
    # No compute_cap column at 470: the CC comes from the chip name, and sm_60 SASS runs.
    assert c["gpu-capability"]["status"] == "ok"
    assert c["torch-build"]["status"] == "ok"


def test_p40_driver_470_fails_a_cuda_12_torch():
    p = probe(torch="2.6.0+cu124", cuda="12.4")
    c = checks(facts("p40-470.nvidia-smi.csv", probe_facts=p))
    assert c["driver"]["status"] == "fail"
    assert "525.60.13" in c["driver"]["seen"]


def test_no_driver_loaded_fails_naming_the_branch():
    p = probe(devices=[])
    c = checks(facts("nodriver.nvidia-smi.txt", "p40.lspci.txt", probe_facts=p))
    assert c["driver"]["status"] == "fail"
    assert "no NVIDIA driver loaded" in c["driver"]["seen"]
    assert "branch 535" in c["driver"]["fix"] and "proprietary" in c["driver"]["fix"]
    assert c["torch-build"]["status"] == "fail"
    assert "is_available() is False" in c["torch-build"]["seen"]
    assert c["gpu-memory"]["status"] == "skip"


def test_p40_with_torch_cu128_has_no_kernel_image():
    p = probe(
        torch="2.7.0+cu128",
        cuda="12.8",
        arch_list=CU128,
        devices=[device(kernel_ok=False, kernel_error=NO_KERNEL)],
        requires=('triton==3.3.0; platform_system == "Linux"',),
        triton="3.3.0",
    )
    report = doctor_checks.evaluate(facts(probe_facts=p))
    assert report["ok"] is False
    c = {x["id"]: x for x in report["checks"]}
    tb = c["torch-build"]
    assert tb["status"] == "fail"
    assert "no kernels for CC 6.1" in tb["seen"]
    assert "no kernel image is available" in tb["seen"]
    assert "2.6.0+cu118" in tb["fix"] and "cu118 wheel index" in tb["fix"]
    assert tb["details"]["kernels"]["6.1"] is None
    # The triton that torch 2.7 requires is there: that check has nothing to say.
    assert c["triton"]["status"] == "ok"


def test_triton_2_3_1_fails_naming_both_versions():
    c = checks(_with_probe(triton="2.3.1"))
    t = c["triton"]
    assert t["status"] == "fail"
    assert "triton 2.3.1 installed" in t["seen"] and "triton==3.2.0" in t["seen"]
    assert "seed article" in t["seen"]
    assert "pip install 'triton==3.2.0'" in t["fix"]


def test_triton_missing_fails():
    t = checks(_with_probe(triton=None))["triton"]
    assert t["status"] == "fail" and "not installed" in t["seen"]


def test_triton_requirement_for_another_machine_is_ignored():
    req = ('triton==3.2.0; platform_system == "Linux" and platform_machine == "x86_64"',)
    p = probe(triton=None, requires=req)
    p["machine"] = "aarch64"
    # Not what torch asks for on aarch64: the pinned triton stands in (torch is the pin).
    t = checks(facts(probe_facts=p))["triton"]
    assert t["status"] == "fail" and "triton==3.2.0" in t["seen"]


def test_flash_attn_present_on_p40_fails():
    f = _with_probe(flash_attn="2.7.4.post1")
    report = doctor_checks.evaluate(f)
    fa = {x["id"]: x for x in report["checks"]}["flash-attn"]
    assert fa["status"] == "fail"
    assert "2.7.4.post1" in fa["seen"]
    assert "Triton cross-entropy" in fa["fix"] and "pip uninstall flash-attn" in fa["fix"]
    assert report["ok"] is False


def test_flash_attention_2_forced_by_environment_fails():
    f = _with_probe()
    f["env"]["OLDGPU_ATTN_IMPLEMENTATION"] = "flash_attention_2"
    assert checks(f)["flash-attn"]["status"] == "fail"


def test_bf16_forced_by_environment_fails_on_p40():
    f = _with_probe()
    f["env"]["OLDGPU_COMPUTE_DTYPE"] = "bf16"
    b = checks(f)["bf16"]
    assert b["status"] == "fail" and "OLDGPU_COMPUTE_DTYPE" in b["fix"]


def test_verl_tree_patched_for_bf16_fails_on_p40():
    f = facts(
        probe_facts=probe(verl_origin=P40_VERL_ORIGIN),
        verl=patched_verl(compute_dtype="bf16", attn_implementation="sdpa", profile=None),
    )
    c = checks(f)
    assert c["verl-patch"]["status"] == "warn"  # patched as recorded, for other options
    assert "compute_dtype bf16 (profile wants fp32)" in c["verl-patch"]["seen"]
    assert c["bf16"]["status"] == "fail"
    assert "--profile pascal-6.1" in c["bf16"]["fix"]


def test_ampere_profile_asked_for_on_a_p40_fails():
    f = facts(probe_facts=probe(verl_origin=P40_VERL_ORIGIN), verl=patched_verl(), arch="ampere")
    c = checks(f)
    assert c["gpu-capability"]["status"] == "fail"
    assert "older than profile ampere-8.0 assumes" in c["gpu-capability"]["seen"]
    assert c["bf16"]["status"] == "fail"
    assert "CC 6.1 (< 8.0)" in c["bf16"]["seen"]


# -- other hosts ------------------------------------------------------------------------


def a100_probe(**kw):
    dev = device(name="NVIDIA A100-PCIE-40GB", cc="8.0", total=40337, free=40000)
    return probe(devices=[dev], **kw)


def test_a100_computes_in_bf16():
    c = checks(facts("a100.nvidia-smi.csv", probe_facts=a100_probe(flash_attn="2.7.4.post1")))
    assert c["bf16"]["status"] == "ok" and c["bf16"]["seen"].startswith("bf16")
    assert "CC >= 8.0" in c["bf16"]["seen"]
    assert c["flash-attn"]["status"] == "ok"
    assert c["torch-build"]["details"]["kernels"]["8.0"]["code"] == "sm_80"
    assert "flash_attention_2" in c["gpu-capability"]["seen"]


def test_a100_without_flash_attn_warns():
    fa = checks(facts("a100.nvidia-smi.csv", probe_facts=a100_probe()))["flash-attn"]
    assert fa["status"] == "warn" and "pip install flash-attn" in fa["fix"]


def test_cpu_profile_skips_the_device_checks():
    p = probe(torch="2.6.0+cpu", cuda=None, arch_list=[], devices=[], requires=(), triton=None)
    report = doctor_checks.evaluate(facts("nogpu.nvidia-smi.txt", "nogpu.lspci.txt", probe_facts=p))
    c = {x["id"]: x for x in report["checks"]}
    assert report["profile"] == "cpu" and report["ok"] is True
    for check_id in ("driver", "gpu-capability", "gpu-memory", "verl-patch"):
        assert c[check_id]["status"] == "skip", check_id
    assert "no device" in c["driver"]["seen"]
    assert c["torch-build"]["status"] == "ok"
    assert c["triton"]["status"] == "ok"  # a CPU torch requires no triton
    assert c["bf16"]["status"] == "ok"
    assert report["counts"] == {"ok": 6, "warn": 0, "fail": 0, "skip": 4}


def test_kepler_next_to_an_a100_has_no_kernel_image():
    p = probe(devices=[device(name="NVIDIA A100-PCIE-40GB", cc="8.0")])
    c = checks(facts("k80-a100-535.nvidia-smi.csv", "k80-a100.lspci.txt", probe_facts=p))
    gc = c["gpu-capability"]
    assert gc["status"] == "fail"
    assert "CC 3.7 (kepler)" in gc["seen"] and "no kernel image is available" in gc["seen"]
    # Driver 535 drives the A100 only: the K80s need 470.
    assert c["driver"]["status"] == "fail" and "does not drive" in c["driver"]["seen"]
    assert "branch 470" in c["driver"]["fix"]


def test_cpu_only_torch_on_a_gpu_host_fails():
    p = probe(torch="2.6.0+cpu", cuda=None, arch_list=[], devices=[], requires=())
    tb = checks(facts(probe_facts=p))["torch-build"]
    assert tb["status"] == "fail" and "CPU-only build" in tb["seen"]


def test_unrunnable_probe_fails_torch_build_and_skips_the_rest():
    p = {"python": "/nope/bin/python", "error": "/nope/bin/python: no such interpreter"}
    c = checks(facts(probe_facts=p))
    assert c["torch-build"]["status"] == "fail" and "--python" in c["torch-build"]["fix"]
    assert c["triton"]["status"] == c["flash-attn"]["status"] == "skip"


def test_unknown_gpu_gives_no_profile_but_a_report():
    f = facts(None, "p40.lspci.txt", probe_facts=probe(devices=[]))
    f["detect"]["gpus"][0].update(architecture=None, compute_capability=None, chip=None)
    report = doctor_checks.evaluate(f)
    c = {x["id"]: x for x in report["checks"]}
    assert report["profile"] is None and report["ok"] is False
    assert c["gpu-capability"]["status"] == "fail"
    assert "unknown-gpu-architecture" in c["gpu-capability"]["seen"]
    assert "--cc X.Y" in c["gpu-capability"]["fix"]
    assert c["bf16"]["status"] == c["flash-attn"]["status"] == "skip"
    text = doctor.render(report, f)
    assert text.startswith("oldgpu doctor: profile (none)") and "✗ gpu-capability" in text


def test_memory_thresholds():
    f = healthy_p40(mem_available=1500)
    c = checks(f)
    assert c["host-memory"]["status"] == "fail" and "needs >= 2048" in c["host-memory"]["seen"]
    assert checks(f, min_free_host_mib=1024)["host-memory"]["status"] == "ok"
    assert checks(f, min_free_gpu_mib=30000)["gpu-memory"]["status"] == "fail"
    assert checks(healthy_p40(mem_available=None))["host-memory"]["status"] == "warn"


def test_recorded_h200_host():
    f = json.loads(H200_FACTS.read_text())
    report = doctor_checks.evaluate(f)
    c = {x["id"]: x for x in report["checks"]}
    assert report["profile"] == "hopper-9.0" and report["ok"] is True
    assert {k: x["status"] for k, x in c.items()} == {
        "driver": "ok",
        "gpu-capability": "ok",
        "torch-build": "warn",  # torch 2.11.0+cu130 is not the pin
        "triton": "ok",
        "flash-attn": "warn",  # the hopper profile would use flash_attention_2
        "vllm": "warn",  # the hopper profile's rollout is vllm; none installed
        "verl-patch": "skip",
        "gpu-memory": "ok",
        "host-memory": "ok",
        "bf16": "ok",
    }
    assert "not the pinned torch 2.6.0" in c["torch-build"]["seen"]
    assert "triton 3.6.0" in c["triton"]["seen"]
    assert "here it says True" in c["bf16"]["seen"]


def test_recorded_cu130_torch_in_front_of_a_p40():
    p = json.loads(H200_FACTS.read_text())["probe"]
    p["torch"]["devices"] = [device(kernel_ok=False, kernel_error=NO_KERNEL)]
    tb = checks(facts(probe_facts=p))["torch-build"]
    assert tb["status"] == "fail"
    assert "no kernels for CC 6.1 (built for sm_75 sm_80" in tb["seen"]
    assert "a test kernel on cuda:0 failed" in tb["seen"]


# -- the verl check over recorded patcher answers ------------------------------------


def test_no_verl_dir_skips():
    v = checks(facts())["verl-patch"]
    assert v["status"] == "skip" and "no --verl-dir" in v["seen"]


def test_unpatched_verl_fails_with_the_patch_command():
    verl = {
        "dir": "/opt/verl/verl",
        "manifest": None,
        "modified": [],
        "check_rc": 1,
        "check": {"changed": True, "verl_version": "0.5.0", "files": []},
    }
    v = checks(facts(probe_facts=probe(verl_origin=P40_VERL_ORIGIN), verl=verl))["verl-patch"]
    assert v["status"] == "fail" and "not patched" in v["seen"]
    assert "oldgpu patch /opt/verl/verl --profile pascal-6.1" in v["fix"]


def test_verl_imported_from_elsewhere_warns():
    p = probe(verl_origin="/opt/venv/lib/python3.11/site-packages/verl/__init__.py")
    v = checks(facts(probe_facts=p, verl=patched_verl()))["verl-patch"]
    assert v["status"] == "warn" and "pip install --no-deps -e /opt/verl/verl" in v["fix"]


# -- pieces ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cc", "arch_list", "expected"),
    [
        ("6.1", CU118, {"kind": "sass", "code": "sm_60"}),
        ("6.0", CU118, {"kind": "sass", "code": "sm_60"}),
        ("8.9", CU118, {"kind": "sass", "code": "sm_86"}),
        ("6.1", CU128, None),
        ("3.7", CU118, None),
        # A GPU newer than the build: the compute_ PTX entry JIT-compiles for it.
        ("12.1", CU128, {"kind": "sass", "code": "sm_120"}),
        ("10.3", ["sm_90", "compute_90"], {"kind": "ptx", "code": "compute_90"}),
        ("9.0", ["sm_80", "sm_90a"], {"kind": "sass", "code": "sm_90"}),
        ("10.0", ["sm_90a", "compute_90a"], None),
    ],
)
def test_kernel_coverage(cc, arch_list, expected):
    assert checks_torch.kernel_coverage(cc, arch_list) == expected


def test_ptx_only_gpu_warns():
    p = probe(arch_list=["sm_50", "compute_50"], devices=[device()])
    tb = checks(facts(probe_facts=p))["torch-build"]
    assert tb["status"] == "warn" and "compute_50 PTX" in tb["seen"]


@pytest.mark.parametrize(
    ("version", "spec", "ok"),
    [
        ("3.2.0", "==3.2.0", True),
        ("2.3.1", "==3.2.0", False),
        ("3.2.0", ">=3.1,<3.3", True),
        ("3.3.0", ">=3.1,<3.3", False),
        ("3.2.1", "==3.2.*", True),
        ("3.2.0", "~=3.1", True),
        ("4.0", "~=3.1", False),
        ("3.2.0", "", True),
    ],
)
def test_satisfies(version, spec, ok):
    assert checks_torch.satisfies(version, spec) is ok


def test_parse_requirement_both_metadata_spellings():
    assert checks_torch.parse_requirement(TRITON_REQ)["specifier"] == "==3.2.0"
    r = checks_torch.parse_requirement('triton==3.2.0; platform_system == "Linux"')
    assert (r["name"], r["specifier"], r["marker"]) == (
        "triton",
        "==3.2.0",
        'platform_system == "Linux"',
    )


def test_driver_version_from_proc():
    text = (
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )
    assert driver.parse_proc_version(text) == "535.183.01"
    open_modules = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release"
    assert driver.parse_proc_version(open_modules) == "580.65.06"
    report = detect.detect("No devices were found\n", None, EXCERPT, run_tools=False)
    assert doctor_facts.driver_facts(report, text) == {
        "version": "535.183.01",
        "source": doctor_facts.PROC_DRIVER_VERSION,
        "nvidia_smi": "failed",
        "proc_version": "535.183.01",
    }


def test_meminfo():
    text = "MemTotal:       65855364 kB\nMemFree:  1000 kB\nMemAvailable:   60123456 kB\n"
    assert doctor_facts.parse_meminfo(text) == {"mem_available_mib": 58714, "mem_total_mib": 64311}


@pytest.mark.parametrize(
    ("message", "check_id"),
    [
        (NO_KERNEL, "torch-build"),
        (
            "ValueError: Bfloat16 is only supported on GPUs with compute capability of at "
            "least 8.0. Your Tesla P40 GPU has compute capability 6.1.",
            "bf16",
        ),
        (
            "OutOfResources: out of resource: shared memory, Required: 81920, "
            "Hardware limit: 49152",
            "flash-attn",
        ),
        ("RuntimeError: FlashAttention only supports Ampere GPUs or newer.", "flash-attn"),
        (
            "torch._inductor.exc.GPUTooOldForTriton: Found Tesla P40 which is too old to be "
            "supported by the triton GPU compiler, which is used as the backend. Triton only "
            "supports devices of CUDA Capability >= 7.0, but your device is of CUDA capability 6.1",
            "triton",
        ),
        ("triton.compiler.errors.CompilationError: Triton compiler error", "triton"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "gpu-memory"),
        ("ModuleNotFoundError: No module named 'flash_attn'", "verl-patch"),
        ("Expects tensor to be on the compute device cuda:0, was on cpu", "verl-patch"),
        ("RuntimeError: Found no NVIDIA driver on your system.", "driver"),
        ("RuntimeError: \"addmm_cuda\" not implemented for 'BFloat16'", "bf16"),
    ],
)
def test_explain_known_errors(message, check_id):
    found = known_errors.explain(message)
    assert found is not None and found["check"] == check_id
    assert found["check"] in doctor_checks.CHECK_IDS
    assert found["cause"] and found["fix"]


def test_explain_article_errors_name_the_project_fixes():
    assert "2.6.0+cu118" in known_errors.explain("no kernel image is available")["fix"]
    assert (
        "rollout.name=hf"
        in known_errors.explain(
            "Bfloat16 is only supported on GPUs with compute capability of at least 8.0"
        )["fix"]
    )
    assert "3.2.0" in known_errors.explain("Triton compiler error")["fix"]
    assert known_errors.explain("everything is fine") is None


# -- the real probe, with the engine venv's interpreter --------------------------------


def test_real_probe_with_this_interpreter():
    p = doctor_facts.run_probe(sys.executable)
    assert "error" not in p, p
    assert p["python"] == sys.executable
    assert set(p) >= {"distributions", "modules", "torch_requires_triton", "torch", "machine"}
    t = p["torch"]
    if not t["importable"]:
        pytest.skip("this interpreter has no torch (run with the engine test venv)")
    # torch.__version__ carries the local build tag (+cu118); the wheel's metadata may not.
    assert t["version"].split("+")[0] == p["distributions"]["torch"].split("+")[0]
    assert isinstance(t["cuda_available"], bool)
    assert t["device_count"] == len(t["devices"])
    if not t["cuda_available"]:
        assert t["devices"] == [] and t["bf16_supported"] is None
        # Without a device get_arch_list() is empty; the build's flags still say.
        assert t["arch_list_source"] == "torch._C._cuda_getArchFlags()"
    if t["cuda"]:
        assert t["arch_list"] and all(a.startswith(("sm_", "compute_")) for a in t["arch_list"])
    for d in t["devices"]:
        assert {"capability", "free_mib", "total_mib", "kernel_ok"} <= set(d)
    assert p["modules"]["flash_attn"] is None or isinstance(p["modules"]["flash_attn"], str)
    if p["distributions"]["triton"]:
        reqs = [checks_torch.parse_requirement(r) for r in p["torch_requires_triton"]]
        assert any(r["name"] == "triton" for r in reqs)
    # The facts judge cleanly as a CPU host (the torch-build check needs no CUDA there).
    f = facts("nogpu.nvidia-smi.txt", "nogpu.lspci.txt", probe_facts=p)
    c = checks(f)
    assert c["torch-build"]["status"] in ("ok", "warn")


def test_probe_of_a_missing_interpreter():
    p = doctor_facts.run_probe("/nonexistent/bin/python")
    assert "no such interpreter" in p["error"]


# -- a real verl tree --------------------------------------------------------------------


def _gather_on(tree: Path, monkeypatch) -> dict[str, Any]:
    # The probe's interpreter imports verl from the tree, as an editable install would.
    monkeypatch.setenv("PYTHONPATH", str(tree))
    args = type(
        "A",
        (),
        {
            "nvidia_smi_file": str(REC / "nogpu.nvidia-smi.txt"),
            "lspci_file": str(REC / "nogpu.lspci.txt"),
            "pci_ids": str(EXCERPT),
        },
    )()
    return doctor_facts.gather_facts(
        python=sys.executable, verl_dir=str(tree), arch="cpu", detect_args=args
    )


@pytest.mark.slow
def test_real_patched_verl_tree_is_ok(verl_tree: Path, monkeypatch, capsys):
    assert cli.main(["patch", str(verl_tree), "--profile", "cpu", "--json"]) == 0
    capsys.readouterr()
    f = _gather_on(verl_tree, monkeypatch)
    assert f["verl"]["check_rc"] == 0
    v = checks(f)["verl-patch"]
    assert v["status"] == "ok", v
    assert "patched as its manifest says (fp32, sdpa, profile cpu;" in v["seen"]
    # Which patch set the tree carries, by name (a host may carry two releases).
    assert v["details"]["verl_version"] == "0.5.0"
    assert "response-logits" in v["details"]["patch_set"] and "response-logits" in v["seen"]


@pytest.mark.slow
def test_the_doctor_names_a_newer_releases_patch_set(verl09_pristine, tmp_path, monkeypatch,
                                                     capsys):  # fmt: skip
    tree = fresh_copy(verl09_pristine, tmp_path)
    assert cli.main(["patch", str(tree), "--profile", "pascal", "--json"]) == 0
    capsys.readouterr()
    f = _gather_on(tree, monkeypatch)
    assert f["verl"]["check_rc"] == 0
    v = checks(f)["verl-patch"]
    assert "verl 0.9.0 patched as its manifest says (fp32, sdpa, profile pascal" in v["seen"]
    assert v["details"]["verl_version"] == "0.9.0"
    assert {"fsdp-param-dtype-default", "flash-attn-import-guard"} <= set(v["details"]["patch_set"])


def test_a_newer_releases_venv_is_judged_against_that_releases_torch():
    # The tree's manifest says which release the venv serves (a host carries several).
    release = pins.load()["verl_releases"]["0.9.0"]["torch"]
    tree = patched_verl(compute_dtype="fp32", profile="cpu", device="cpu")
    tree["manifest"]["verl_version"] = "0.9.0"
    mine = probe(torch=release["version"], triton=release["triton"], requires=[])
    tb = checks(facts(smi=None, probe_facts=mine, verl=tree, arch="cpu"))["torch-build"]
    assert tb["status"] == "ok" and "not the pinned" not in tb["seen"], tb
    # The default release's torch in that venv is named against 0.9.0's pin.
    old = probe(torch=pins.get("torch.version"), requires=[])
    tb = checks(facts(smi=None, probe_facts=old, verl=tree, arch="cpu"))["torch-build"]
    assert f"is not the pinned torch {release['version']} of verl 0.9.0" in tb["seen"]
    # Without a tree (or the default's) the default's pin.
    tb = checks(facts(smi=None, probe_facts=mine, arch="cpu"))["torch-build"]
    assert f"is not the pinned torch {pins.get('torch.version')}" in tb["seen"]


@pytest.mark.slow
def test_real_unpatched_verl_tree_fails(verl_tree: Path, monkeypatch):
    f = _gather_on(verl_tree, monkeypatch)
    assert f["verl"]["check_rc"] == 1 and f["verl"]["manifest"] is None
    v = checks(f)["verl-patch"]
    assert v["status"] == "fail"
    assert "not patched" in v["seen"]
    assert f"oldgpu patch {verl_tree} --profile cpu" in v["fix"]


@pytest.mark.slow
def test_real_hand_modified_verl_tree_names_the_file(verl_tree: Path, monkeypatch, capsys):
    assert cli.main(["patch", str(verl_tree), "--profile", "cpu", "--json"]) == 0
    capsys.readouterr()
    edited = verl_tree / "verl/workers/actor/dp_actor.py"
    edited.write_text(edited.read_text() + "# a hand edit\n")
    f = _gather_on(verl_tree, monkeypatch)
    assert f["verl"]["error"]["error"] == "tree-modified"
    v = checks(f)["verl-patch"]
    assert v["status"] == "fail"
    assert "verl/workers/actor/dp_actor.py" in v["seen"]
    assert "undo the edit to verl/workers/actor/dp_actor.py" in v["fix"]


# -- the CLI -----------------------------------------------------------------------------


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """``oldgpu.cli.main`` with only the doctor (other commands may be half-built)."""
    return cli_runner(monkeypatch, capsys, ("oldgpu.doctor",))


NOGPU = (
    "--nvidia-smi-file",
    str(REC / "nogpu.nvidia-smi.txt"),
    "--lspci-file",
    str(REC / "nogpu.lspci.txt"),
    "--pci-ids",
    str(EXCERPT),
)


def test_cli_cpu_host_exits_0(run_cli):
    code, out, _ = run_cli("doctor", "--json", "--min-free-host-mib", "1", *NOGPU)
    assert code == 0, out["checks"]
    assert set(out) == {"ok", "profile", "checks", "counts", "summary", "facts"}
    assert out["ok"] is True and out["profile"] == "cpu"
    assert out["summary"].endswith("0 fail")
    assert [c["id"] for c in out["checks"]] == list(doctor_checks.CHECK_IDS)
    assert out["facts"]["probe"]["python"] == sys.executable


def test_cli_p40_host_without_a_venv_exits_3(run_cli):
    code, text, _ = run_cli(
        "doctor",
        "--nvidia-smi-file",
        str(REC / "p40.nvidia-smi.csv"),
        "--pci-ids",
        str(EXCERPT),
        "--min-free-host-mib",
        "1",
        "--python",
        "/nonexistent/bin/python",
    )
    assert code == doctor.DOCTOR_FAILED == 3
    lines = text.splitlines()
    assert lines[0].startswith("oldgpu doctor: profile pascal-6.1")
    torch_line = next(i for i, line in enumerate(lines) if "torch-build" in line)
    assert lines[torch_line].startswith("✗ torch-build")
    assert lines[torch_line + 1].startswith("    fix: ")
    assert any(line.startswith("✓ driver") for line in lines)
    assert lines[-1].endswith("NOT ready")


def test_cli_recorded_facts(run_cli, tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(healthy_p40()))
    code, out, _ = run_cli("doctor", "--facts", str(good), "--json")
    assert code == 0 and out["summary"] == "10 ok, 0 warn, 0 fail"
    code, text, _ = run_cli("doctor", "--facts", str(good))
    assert code == 0 and text.rstrip().endswith(": ready")
    assert sum(line[:1] == "✓" for line in text.splitlines()) == 10
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_with_probe(triton="2.3.1")))
    code, out, _ = run_cli("doctor", "--facts", str(bad), "--json")
    assert code == 3 and out["ok"] is False
    assert [c["id"] for c in out["checks"] if c["status"] == "fail"] == ["triton"]
    # Judged against another profile by flag.
    code, out, _ = run_cli("doctor", "--facts", str(good), "--arch", "ampere", "--json")
    assert code == 3 and out["profile"] == "ampere-8.0"


def test_cli_explain(run_cli):
    code, text, _ = run_cli("doctor", "--explain", "CUDA error: no kernel image is available")
    assert code == 0
    assert "check torch-build" in text and "fix: " in text
    code, out, _ = run_cli(
        "doctor", "--json", "--explain", "FlashAttention only supports Ampere GPUs or newer."
    )
    assert code == 0 and out["explanation"]["check"] == "flash-attn"
    code, out, _ = run_cli("doctor", "--json", "--explain", "nothing known")
    assert code == doctor.EXPLAIN_UNKNOWN and out["known"] is False


def test_cli_bad_cc_is_a_usage_error(run_cli):
    code, out, _ = run_cli("doctor", "--cc", "1.0", "--json")
    assert code == 2 and out["error"] == "unknown-compute-capability"


def test_cli_verl_dir_missing(run_cli, tmp_path):
    code, out, _ = run_cli(
        "doctor", "--json", "--arch", "cpu", "--verl-dir", str(tmp_path / "nope"), *NOGPU
    )
    assert code == 3
    v = next(c for c in out["checks"] if c["id"] == "verl-patch")
    assert v["status"] == "fail" and "verl/" in v["fix"]


# -- vLLM: on the vllm rollout's profiles, and why not on a P40 -------------------------


def _with_vllm(f: dict[str, Any], version: str | None) -> dict[str, Any]:
    f["probe"]["distributions"]["vllm"] = version
    return f


def test_vllm_absent_on_a_p40_is_explained():
    c = checks(healthy_p40())["vllm"]
    assert c["status"] == "ok"
    assert "compute capability 7.0 and this is 6.1" in c["seen"] and "HF rollout" in c["seen"]
    c = checks(_with_vllm(healthy_p40(), "0.8.5"))["vllm"]
    assert c["status"] == "warn" and "cannot run here" in c["seen"]


def test_vllm_on_a_v100():
    v100 = device(name="Tesla V100-PCIE-32GB", cc="7.0", total=32510, free=32000)

    def v100_facts(version, **kw):
        f = facts("v100.nvidia-smi.csv", probe_facts=probe(devices=[v100]), **kw)
        return _with_vllm(f, version)

    c = checks(v100_facts("0.8.5"))["vllm"]
    assert c["status"] == "ok" and "vLLM 0.8.5 (vllm rollout on profile volta-7.0)" in c["seen"]
    c = checks(v100_facts("0.9.2"))["vllm"]
    assert c["status"] == "fail" and "verl 0.5.0 takes 0.8.5" in c["seen"]
    c = checks(v100_facts(None))["vllm"]
    assert c["status"] == "warn" and "rollout: hf" in c["fix"]
