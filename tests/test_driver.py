"""oldgpu driver: what the roles read instead of parsing dkms, /proc and dpkg themselves.

Recorded inputs (tests/data/driver) in the forms the tools print: ``dkms status`` of
dkms 3 (Debian 12) and dkms 2 (Ubuntu 20.04), /proc/driver/nvidia/version of the
proprietary and open modules, /proc/modules, and dpkg-query's lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import cli_runner

from oldgpu import driver, pins

DATA = Path(__file__).parent / "data" / "driver"
MIN_DRIVER = pins.get("cuda.min_driver")


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """``oldgpu.cli.main`` with only the driver command."""
    return cli_runner(monkeypatch, capsys, ("oldgpu.driver",), "driver")


def lib_modules(tmp_path: Path, *kernels: str, without_headers: tuple[str, ...] = ()) -> str:
    """A /lib/modules where ``kernels`` have headers (KERNEL/build) and the others do not."""
    root = tmp_path / "lib-modules"
    for kernel in kernels:
        (root / kernel / "build").mkdir(parents=True)
    for kernel in without_headers:
        (root / kernel / "kernel").mkdir(parents=True)
    # Headers removed, the link left behind: no headers.
    (root / "6.1.0-1-amd64").mkdir(parents=True)
    (root / "6.1.0-1-amd64" / "build").symlink_to(tmp_path / "gone")
    return str(root)


def recorded(run_cli, *args: str, **files: str) -> dict[str, Any]:
    argv = [a for key, name in files.items() for a in (f"--{key}", str(DATA / name))]
    code, out, err = run_cli("--json", *argv, *args)
    assert code == 0, (out, err)
    return out


def recorded_debian12(
    run_cli, tmp_path: Path, dkms_status: str, *kernels: str, **more: Any
) -> dict[str, Any]:
    """A Debian 12 host with the 535 packages: ``dkms status`` from ``dkms_status``, headers
    for ``kernels`` (``without_headers``: kernels without), ``more`` recorded files."""
    without = more.pop("without_headers", ())
    return recorded(
        run_cli,
        "--lib-modules-dir",
        lib_modules(tmp_path, *kernels, without_headers=without),
        **{"dkms-status-file": dkms_status, "dpkg-file": "dpkg.debian12-535.txt", **more},
    )


# -- DKMS per kernel ---------------------------------------------------------------------


def test_the_molecule_nvidia_host(run_cli, tmp_path):
    # What molecule/nvidia's Debian 12 container said (its dkms status line, printed by
    # test_nvidia.py): the module is built for the one kernel with headers, so the role
    # builds nothing, and the reboot that would load it is pending (nothing is loaded).
    r = recorded_debian12(run_cli, tmp_path, "dkms-status.debian12-molecule.txt", "6.1.0-57-amd64")
    assert r["dkms"]["built_for"] == ["6.1.0-57-amd64"] and r["dkms"]["missing"] == []
    assert (r["installed"]["version"], r["loaded"]["version"]) == ("535.309.01", None)
    assert r["reboot"]["driver"] is True
    # The cuda role's line in that run's log, word for word.
    assert r["cuda"]["message"] == (
        "driver 535.309.01 (installed libcuda package) meets CUDA 11.8's minimum 520.61.05"
    )


def test_three_kernels_one_installed_one_only_built_one_failed(run_cli, tmp_path):
    kernels = ("6.1.0-57-amd64", "6.1.0-58-amd64", "6.1.0-59-amd64")
    r = recorded_debian12(
        run_cli,
        tmp_path,
        "dkms-status.debian12-three-kernels.txt",
        *kernels,
        without_headers=("6.1.0-56-amd64",),
        **{"modules-file": "modules.none.txt"},
    )
    inst = r["installed"]
    assert (inst["module_package"], inst["version"], inst["branch"], inst["flavour"]) == (
        "nvidia-kernel-dkms",
        "535.309.01",
        535,
        "proprietary",
    )
    # The purged-but-configured 470 module package is not installed.
    assert inst["branches"] == [535] and inst["libcuda_version"] == "535.309.01"
    dkms = r["dkms"]
    assert [(k["kernel"], k["headers"], k["state"]) for k in dkms["kernels"]] == [
        ("6.1.0-57-amd64", True, "installed"),
        ("6.1.0-58-amd64", True, "built"),  # built, never installed
        ("6.1.0-59-amd64", True, "missing"),  # its build failed: dkms lists nothing
    ]
    assert dkms["built_for"] == ["6.1.0-57-amd64"]
    assert dkms["missing"] == ["6.1.0-58-amd64", "6.1.0-59-amd64"]
    assert r["loaded"] == {"version": None, "module": False, "modules": [], "nouveau": False}
    assert r["reboot"]["needed"] is r["reboot"]["driver"] is True
    assert r["reboot"]["reasons"] == ["nvidia 535.309.01 is installed, no NVIDIA module is loaded"]
    assert r["cuda"]["fit"] == "ok"
    assert r["cuda"]["message"] == (
        f"driver 535.309.01 (installed libcuda package) meets CUDA 11.8's minimum {MIN_DRIVER}"
    )


def test_a_build_that_failed_for_every_kernel(run_cli, tmp_path):
    r = recorded_debian12(
        run_cli, tmp_path, "dkms-status.debian12-build-failed.txt", "6.1.0-57-amd64"
    )
    assert r["dkms"]["unbuilt"] == [
        {"module": "nvidia-current", "version": "535.309.01", "state": "added"}
    ]
    assert r["dkms"]["missing"] == ["6.1.0-57-amd64"] and r["dkms"]["built_for"] == []


def test_dkms_status_lines_of_both_dkms_versions():
    # Moved from test_gpu_roles_render (the role parsed them with a regex then).
    entries, unparsed = driver.parse_dkms_status((DATA / "dkms-status.mixed.txt").read_text())
    assert unparsed == []
    d = driver.dkms_state(entries, [], None)
    assert [(e["module"], e["version"], e["kernel"]) for e in d["installed"]] == [
        ("nvidia-current", "535.309.01", "6.1.0-57-amd64"),  # dkms 3 (Debian 12)
        ("nvidia", "535.183.01", "5.4.0-150-generic"),  # dkms 2 (Ubuntu 20.04)
        ("nvidia-srv", "535.183.01", "5.15.0-91-generic"),  # Ubuntu's -server module
    ]
    assert d["unbuilt"] == [
        {"module": "nvidia-tesla-470", "version": "470.256.02", "state": "broken"}
    ]
    # No driver installed: nothing can be missing, no kernel has a state for it.
    assert d["missing"] == [] and {k["state"] for k in d["kernels"]} == {None}


def test_dkms_2_on_ubuntu_20_04(run_cli, tmp_path):
    dpkg = tmp_path / "dpkg.txt"
    dpkg.write_text("nvidia-dkms-535\t535.183.01-0ubuntu0.20.04.1\tinstalled\n")
    kernels = ("5.4.0-150-generic", "5.4.0-169-generic")
    code, r, _ = run_cli(
        "--json",
        "--dpkg-file",
        str(dpkg),
        "--dkms-status-file",
        str(DATA / "dkms-status.focal-dkms2.txt"),
        "--lib-modules-dir",
        lib_modules(tmp_path, *kernels),
    )
    assert code == 0
    assert r["dkms"]["built_for"] == list(kernels) and r["dkms"]["missing"] == []
    assert r["installed"]["libcuda_version"] is None
    assert r["cuda"]["driver_source"] == "installed kernel module (package)"


# -- what is installed and loaded; reboot ----------------------------------------------------


def test_ubuntu_server_open_modules(run_cli):
    r = recorded(run_cli, **{"dpkg-file": "dpkg.jammy-535-server-open.txt"})
    inst = r["installed"]
    assert inst["module_package"] == "nvidia-dkms-535-server-open"
    assert (inst["version"], inst["branch"], inst["flavour"]) == ("535.183.06", 535, "open")
    assert inst["libcuda_version"] == "535.183.06"


def test_two_branches_installed_are_both_named(run_cli):
    inst = recorded(run_cli, **{"dpkg-file": "dpkg.two-branches.txt"})["installed"]
    assert inst["branches"] == [470, 535]
    assert inst["version"] == "535.309.01" and inst["module_package"] == "nvidia-kernel-dkms"


@pytest.mark.parametrize(
    ("name", "version"),
    [("535", "535.309.01"), ("580-open", "580.65.06"), ("470", "470.256.02")],
)
def test_loaded_version_from_proc(name, version):
    assert driver.parse_proc_version((DATA / f"proc-version.{name}.txt").read_text()) == version


def test_loaded_module_matches_the_installed_one(run_cli):
    r = recorded(
        run_cli,
        **{
            "dpkg-file": "dpkg.debian12-535.txt",
            "proc-version-file": "proc-version.535.txt",
            "modules-file": "modules.nvidia.txt",
        },
    )
    assert r["loaded"] == {
        "version": "535.309.01",
        "module": True,
        "modules": ["nvidia_uvm", "nvidia_drm", "nvidia_modeset", "nvidia"],
        "nouveau": False,
    }
    assert r["reboot"] == {
        "needed": False,
        "driver": False,
        "reasons": [],
        "required_file": False,
        "required_by": [],
    }
    assert r["cuda"]["driver_source"] == "loaded module"


def test_an_older_module_loaded_needs_a_reboot(run_cli):
    r = recorded(
        run_cli,
        **{
            "dpkg-file": "dpkg.debian12-535.txt",
            "proc-version-file": "proc-version.470.txt",
        },
    )
    assert r["reboot"]["driver"] is True
    assert r["reboot"]["reasons"] == ["nvidia 470.256.02 is loaded, 535.309.01 installed"]
    # The fit is the loaded driver's: 470 runs CUDA 11.8 only through minor-version compatibility.
    assert r["cuda"]["fit"] == "compat" and r["cuda"]["driver"] == "470.256.02"


def test_nouveau_loaded_needs_a_reboot(run_cli):
    r = recorded(
        run_cli, **{"dpkg-file": "dpkg.debian12-535.txt", "modules-file": "modules.nouveau.txt"}
    )
    assert r["loaded"]["nouveau"] is True
    assert r["reboot"]["reasons"][-1] == "nouveau is loaded"


def test_no_driver_installed_needs_no_reboot(run_cli, tmp_path):
    flag = tmp_path / "reboot-required"
    code, r, _ = run_cli(
        "--json", "--modules-file", str(DATA / "modules.nouveau.txt"),
        "--reboot-required-file", str(flag),
    )  # fmt: skip
    assert code == 0 and r["reboot"]["needed"] is False and r["installed"]["version"] is None


def test_reboot_required_file(run_cli, tmp_path):
    flag = tmp_path / "reboot-required"
    flag.write_text("*** System restart required ***\n")
    (tmp_path / "reboot-required.pkgs").write_text("linux-image-6.1.0-58-amd64\nlibc6\nlibc6\n")
    code, r, _ = run_cli("--json", "--reboot-required-file", str(flag))
    assert code == 0
    assert (r["reboot"]["needed"], r["reboot"]["driver"]) == (True, False)
    assert r["reboot"]["required_by"] == ["libc6", "linux-image-6.1.0-58-amd64"]


# -- the driver/CUDA fit ------------------------------------------------------------------


def test_cuda_says_whether_the_driver_meets_its_minimum():
    # Moved from test_gpu_roles_render (the cuda role derived this in its vars then).
    fits = [
        driver.cuda_fit(v, source="installed libcuda package")
        for v in ("535.309.01", "520.61.05", "470.256.02", "440.33.01", "")
    ]
    assert [f["fit"] for f in fits] == ["ok", "ok", "compat", "too-old", "none"]
    assert fits[0]["message"].endswith(f"meets CUDA 11.8's minimum {MIN_DRIVER}")
    # 470: said plainly, not a failure.
    assert "WARNING: driver 470.256.02" in fits[2]["message"]
    assert "minor-version compatibility" in fits[2]["message"]
    assert "cannot run CUDA 11.8" in fits[3]["message"]
    assert fits[4]["message"].startswith("no NVIDIA driver is installed")
    assert {f["min_driver"] for f in fits} == {MIN_DRIVER}  # the pins' own
    assert {f["minor_compat_driver"] for f in fits} == {driver.MINOR_COMPAT_DRIVER[11]}


@pytest.mark.parametrize(
    ("version", "cuda", "fit", "minimum"),
    [
        ("470.256.02", "12.4", "too-old", "550.54.14"),  # below 525.60.13, CUDA 12's floor
        # CUDA 12.4 (vLLM's torch): 535 only through minor-version compatibility.
        ("535.309.01", "12.4", "compat", "550.54.14"),
        ("550.54.14", "12.4", "ok", "550.54.14"),
        ("580.65.06", "12.4", "ok", "550.54.14"),
        ("580.65.06", "13.0", "unknown", None),
        ("450.80.02", "11.2", "compat", None),
    ],
)
def test_cuda_fit_of_other_cudas(version, cuda, fit, minimum):
    f = driver.cuda_fit(version, cuda, "loaded module")
    assert f["fit"] == fit and f["is_pinned"] is False and f["min_driver"] == minimum


def test_report_says_how_the_driver_fits_vllms_cuda(run_cli):
    r = recorded(run_cli, **{"proc-version-file": "proc-version.470.txt"})
    assert r["vllm_cuda"]["version"] == "12.4" and r["vllm_cuda"]["fit"] == "too-old"


def test_cli_cuda_flag(run_cli):
    r = recorded(run_cli, "--cuda", "12.4", **{"proc-version-file": "proc-version.470.txt"})
    assert r["cuda"]["version"] == "12.4" and r["cuda"]["fit"] == "too-old"
    assert (
        "needs >= 550.54.14, or >= 525.60.13 through minor-version compatibility"
        in r["cuda"]["message"]
    )


# -- bad input: a named error, never a traceback -------------------------------------------


@pytest.mark.parametrize(
    "flag", ["--dpkg-file", "--proc-version-file", "--modules-file", "--dkms-status-file"]
)
@pytest.mark.parametrize(
    "content",
    [
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00",
        "Kernel Module  535.309.01 \xe9t\xe9".encode("latin-1"),
    ],
    ids=["binary", "latin-1"],
)
def test_binary_or_non_utf8_input(run_cli, tmp_path, flag, content):
    path = tmp_path / "input"
    path.write_bytes(content)
    code, out, err = run_cli("--json", flag, str(path))
    assert code == 2 and out["error"] == "driver-input-not-text", out
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("flag", "error"),
    [
        ("--dpkg-file", "dpkg-query-unparsable"),
        ("--proc-version-file", "proc-version-unparsable"),
        ("--modules-file", "proc-modules-unparsable"),
        ("--dkms-status-file", "dkms-status-unparsable"),
    ],
)
def test_garbage_text_input(run_cli, flag, error):
    code, out, err = run_cli("--json", flag, str(DATA / "garbage.txt"))
    assert code == 2 and out["error"] == error, out
    assert str(DATA / "garbage.txt") in out["message"]
    assert "Traceback" not in err


def test_missing_inputs_and_bad_flags(run_cli, tmp_path):
    code, out, _ = run_cli("--json", "--dkms-status-file", str(tmp_path / "nope"))
    assert code == 2 and out["error"] == "driver-input-unreadable"
    code, out, _ = run_cli("--json", "--dkms-status-file", str(tmp_path))
    assert code == 2 and out["error"] == "driver-input-unreadable"
    code, out, _ = run_cli("--json", "--lib-modules-dir", str(tmp_path / "nope"))
    assert code == 2 and out["error"] == "lib-modules-missing"
    code, out, _ = run_cli("--json", "--cuda", "eleven")
    assert code == 2 and out["error"] == "cuda-version-invalid"


def test_empty_inputs_mean_nothing_there(run_cli, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("")
    code, r, _ = run_cli(
        "--json", *(a for f in ("--dpkg-file", "--proc-version-file", "--modules-file",
                                "--dkms-status-file") for a in (f, str(empty))),
    )  # fmt: skip
    assert code == 0
    assert r["installed"]["version"] is None and r["loaded"]["version"] is None
    assert r["dkms"]["available"] is True and r["dkms"]["kernels"] == []
    assert r["cuda"]["fit"] == "none"


# -- the text and this host -----------------------------------------------------------------


def test_text_report(run_cli, tmp_path):
    code, text, _ = run_cli(
        "--dpkg-file", str(DATA / "dpkg.debian12-535.txt"),
        "--dkms-status-file", str(DATA / "dkms-status.debian12-three-kernels.txt"),
        "--lib-modules-dir", lib_modules(tmp_path, "6.1.0-57-amd64", "6.1.0-59-amd64"),
    )  # fmt: skip
    assert code == 0
    assert text.splitlines() == [
        "installed: nvidia-kernel-dkms 535.309.01 (branch 535, proprietary modules)",
        "loaded: no NVIDIA module",
        "dkms: 6.1.0-57-amd64 installed; 6.1.0-59-amd64 missing; 6.1.0-58-amd64 built",
        "reboot: needed: nvidia 535.309.01 is installed, no NVIDIA module is loaded",
        "cuda: driver 535.309.01 (installed libcuda package) meets CUDA 11.8's minimum "
        + MIN_DRIVER,
    ]


def test_this_host_answers(run_cli):
    # Whatever this host has (often no driver at all), the answer is whole and says where from.
    code, r, err = run_cli("--json")
    assert code == 0, err
    assert r["schema"] == 1
    assert set(r) == {
        "schema", "installed", "loaded", "dkms", "kernels", "reboot", "cuda", "vllm_cuda",
        "sources",
    }  # fmt: skip
    assert r["sources"]["lib_modules"] == driver.LIB_MODULES
    assert r["cuda"]["fit"] in ("ok", "compat", "too-old", "unknown", "none")
