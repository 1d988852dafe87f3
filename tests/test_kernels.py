"""Kernel upgrades that would leave the GPU without a driver: ``oldgpu driver``'s ``kernels``.

Recorded ``dkms status`` and dpkg-query lines (tests/data/driver) of a Debian 12 host
with a kernel upgrade waiting for its reboot and no headers for it, a Debian 13 host
whose new kernel's build failed, and an Ubuntu 22.04 HWE host; the doctor's check on
the same answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import cli_runner

from oldgpu import kernels
from oldgpu.doctor.checks import evaluate
from oldgpu.doctor.checks_kernels import check_kernels

DATA = Path(__file__).parent / "data" / "driver"


@pytest.fixture
def run_cli(monkeypatch, capsys):
    return cli_runner(monkeypatch, capsys, ("oldgpu.driver",), "driver")


def lib_modules(tmp_path: Path, *with_headers: str) -> str:
    root = tmp_path / "lib-modules"
    root.mkdir()
    for kernel in with_headers:
        (root / kernel / "build").mkdir(parents=True)
    return str(root)


def driver_json(run_cli, tmp_path, dpkg, dkms, running, *headers, text=False) -> Any:
    argv = ["--dpkg-file", str(DATA / dpkg), "--dkms-status-file", str(DATA / dkms)]
    argv += ["--lib-modules-dir", lib_modules(tmp_path, *headers), "--running-kernel", running]
    code, out, err = run_cli(*([] if text else ["--json"]), *argv)
    assert code == 0, (out, err)
    return out


def test_a_pending_kernel_without_headers_is_named_before_the_reboot(run_cli, tmp_path):
    r = driver_json(
        run_cli,
        tmp_path,
        "dpkg.debian12-kernel-upgrade.txt",
        "dkms-status.debian12-three-kernels.txt",
        "6.1.0-57-amd64",
        "6.1.0-57-amd64",
    )
    k = r["kernels"]
    assert k["running"] == "6.1.0-57-amd64"
    # 56 is purged (config-files), the -dbg image is no kernel of its own.
    assert [(x["kernel"], x["image"], x["headers"], x["module"]) for x in k["installed"]] == [
        ("6.1.0-57-amd64", True, True, "built"),
        ("6.1.0-59-amd64", True, False, "missing"),
    ]
    assert k["next_boot"] == k["pending"] == "6.1.0-59-amd64"
    assert k["next_boot_without_module"] is True
    assert [(x["kernel"], x["why"]) for x in k["without_module"]] == [
        ("6.1.0-59-amd64", "its headers are not installed")
    ]
    assert k["messages"] == [
        "kernel 6.1.0-59-amd64 (the next boot's kernel) has no nvidia 535.309.01 module: "
        "its headers are not installed; booted, it has no GPU"
    ]
    # What pulls the next kernel in, for the role's optional hold.
    assert k["metapackages"] == ["linux-headers-amd64", "linux-image-amd64"]


def test_a_new_kernel_dkms_failed_on_trixie(run_cli, tmp_path):
    running, new = "6.12.41+deb13-amd64", "6.12.117+deb13-amd64"
    r = driver_json(
        run_cli,
        tmp_path,
        "dpkg.trixie-550.txt",
        "dkms-status.trixie-new-kernel-failed.txt",
        running,
        running,
        new,
    )
    k = r["kernels"]
    assert r["installed"]["version"] == "550.163.01"
    # Ordered by version, not by text (6.12.117 after 6.12.41).
    assert [x["kernel"] for x in k["installed"]] == [running, new]
    assert k["pending"] == new and k["next_boot_without_module"] is True
    assert [(x["kernel"], x["why"]) for x in k["without_module"]] == [
        (new, "DKMS did not build it")
    ]
    assert r["dkms"]["missing"] == [new]  # what the role's dkms autoinstall retries
    (tmp_path / "t").mkdir()
    text = driver_json(
        run_cli,
        tmp_path / "t",
        "dpkg.trixie-550.txt",
        "dkms-status.trixie-new-kernel-failed.txt",
        running,
        running,
        new,
        text=True,
    )
    assert f"WARNING: kernel {new} (the next boot's kernel) has no nvidia 550.163.01" in text


def test_everything_built_and_the_running_kernel_is_the_newest(run_cli, tmp_path):
    running = "6.12.117+deb13-amd64"
    (tmp_path / "dkms").write_text(
        f"nvidia-current/550.163.01, 6.12.41+deb13-amd64, x86_64: installed\n"
        f"nvidia-current/550.163.01, {running}, x86_64: installed\n"
    )
    argv = ["--json", "--dpkg-file", str(DATA / "dpkg.trixie-550.txt")]
    argv += ["--dkms-status-file", str(tmp_path / "dkms"), "--running-kernel", running]
    argv += ["--lib-modules-dir", lib_modules(tmp_path, "6.12.41+deb13-amd64", running)]
    code, r, _ = run_cli(*argv)
    assert code == 0
    k = r["kernels"]
    assert k["pending"] is None and k["without_module"] == [] and k["messages"] == []
    assert k["next_boot"] == running


def test_ubuntu_hwe_metapackages_and_unsigned_images():
    images, metas = kernels.parse_dpkg_kernels((DATA / "dpkg.jammy-hwe.txt").read_text())
    assert images == ["6.8.0-90-generic"]
    assert metas == [
        "linux-generic-hwe-22.04",
        "linux-headers-generic-hwe-22.04",
        "linux-image-generic-hwe-22.04",
    ]


def test_no_driver_means_nothing_lacks_a_module_and_a_container_has_no_images():
    k = kernels.state(
        images=["6.1.0-59-amd64"],
        header_kernels=[],
        dkms_kernels=[],
        running="6.1.0-57-amd64",
        metapackages=[],
        driver_version=None,
    )
    assert k["without_module"] == [] and k["installed"][0]["module"] is None
    # A container: headers only (the role installs them), no image, no next boot.
    k = kernels.state(
        images=[],
        header_kernels=["6.12.117+deb13-amd64"],
        dkms_kernels=[{"kernel": "6.12.117+deb13-amd64", "state": "installed"}],
        running="6.8.0-1-host",
        metapackages=[],
        driver_version="550.163.01",
    )
    assert k["next_boot"] is None and k["pending"] is None and k["without_module"] == []


def _facts(driver_report: Any) -> dict[str, Any]:
    return {"schema": 1, "request": {}, "detect": {"gpus": []}, "kernels": driver_report}


def test_doctor_warns_about_an_installed_kernel_and_fails_on_the_next_boot(run_cli, tmp_path):
    r = driver_json(
        run_cli,
        tmp_path,
        "dpkg.debian12-kernel-upgrade.txt",
        "dkms-status.debian12-three-kernels.txt",
        "6.1.0-57-amd64",
        "6.1.0-57-amd64",
    )
    check = check_kernels(_facts(r["kernels"]))
    assert check is not None and check["id"] == "kernel-modules"
    assert check["status"] == "fail"
    assert "6.1.0-59-amd64 (the next boot's kernel)" in check["seen"]
    assert "apt-get install linux-headers-6.1.0-59-amd64" in check["fix"]
    # An older kernel without the module only warns: the next boot is fine.
    older = dict(r["kernels"], next_boot_without_module=False)
    older["without_module"] = [dict(older["without_module"][0], next_boot=False)]
    assert check_kernels(_facts(older))["status"] == "warn"
    # Facts without kernels (recorded before, or no dpkg): no check at all.
    assert check_kernels({"schema": 1}) is None
    report = evaluate(_facts(r["kernels"]))
    assert "kernel-modules" in [c["id"] for c in report["checks"]]
