"""oldgpu detect: recorded nvidia-smi / lspci outputs of real GPU models."""

from __future__ import annotations

import gzip
import os
import stat
from pathlib import Path

import pytest
from conftest import cli_runner

from oldgpu import detect
from oldgpu.output import EngineError

DATA = Path(__file__).parent / "data"
REC = DATA / "detect"
EXCERPT = DATA / "pci.ids.excerpt"
SYSTEM_PCI_IDS = Path("/usr/share/misc/pci.ids")

GPU_KEYS = {
    "index",
    "name",
    "chip",
    "pci_id",
    "bus_id",
    "architecture",
    "compute_capability",
    "compute_capability_tuple",
    "memory_mib",
    "source",
    "driver_version",
}

# The recorded P40's fields both tools report alike (they differ in source and driver).
P40 = {
    "index": 0,
    "name": "Tesla P40",
    "chip": "GP102GL",
    "pci_id": "10de:1b38",
    "bus_id": "0000:04:00.0",
    "architecture": "pascal",
    "compute_capability": "6.1",
    "compute_capability_tuple": [6, 1],
    "memory_mib": 24576,
}


@pytest.fixture(scope="module")
def db() -> dict[tuple[str, str], str]:
    return detect.load_pci_ids(EXCERPT)


@pytest.fixture
def run_cli(monkeypatch, capsys):
    return cli_runner(monkeypatch, capsys, ("oldgpu.detect", "oldgpu.profile"))


def smi(name: str, db) -> list[detect.Gpu]:
    return detect.parse_nvidia_smi((REC / name).read_text(), db)


def pci(name: str, db) -> list[detect.Gpu]:
    return detect.parse_lspci((REC / name).read_text(), db)


# -- the PCI ID database ----------------------------------------------------------


def test_excerpt_has_the_real_entries(db):
    assert db[("10de", "1b38")] == "GP102GL [Tesla P40]"
    assert db[("10de", "15f8")] == "GP100GL [Tesla P100 PCIe 16GB]"
    assert db[("10de", "1db6")] == "GV100GL [Tesla V100 PCIe 32GB]"
    assert db[("10de", "1db1")] == "GV100GL [Tesla V100 SXM2 16GB]"
    assert db[("10de", "1eb8")] == "TU104GL [Tesla T4]"
    assert db[("10de", "20f1")] == "GA100 [A100 PCIe 40GB]"
    assert db[("10de", "102d")] == "GK210GL [Tesla K80]"
    assert db[("10de", "2331")] == "GH100 [H100 PCIe]"
    assert db[("10de", "1b06")] == "GP102 [GeForce GTX 1080 Ti]"


def test_pci_ids_skips_subsystems_and_classes(db):
    # 1db8 has a subsystem line "10de 131d  Tesla V100-SXM3-32GB-H"; classes follow vendors.
    assert db[("10de", "1db8")] == "GV100GL [Tesla V100 SXM3 32GB]"
    assert all(len(vendor) == 4 and len(device) == 4 for vendor, device in db)
    assert ("10de", "131d") not in db


def test_pci_ids_gz(tmp_path, db):
    gz = tmp_path / "pci.ids.gz"
    gz.write_bytes(gzip.compress(EXCERPT.read_bytes()))
    assert detect.load_pci_ids(gz) == db


@pytest.mark.skipif(
    not SYSTEM_PCI_IDS.is_file(), reason="no system pci.ids (CI installs the pci.ids package)"
)
def test_system_pci_ids_names_an_unnamed_p40():
    system_db = detect.load_pci_ids(SYSTEM_PCI_IDS)
    [gpu] = pci("p40-unnamed.lspci.txt", system_db)
    assert (gpu.name, gpu.chip, gpu.architecture, gpu.compute_capability) == (
        "Tesla P40",
        "GP102GL",
        "pascal",
        "6.1",
    )


# -- the chip table ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("chip", "arch", "cc"),
    [
        ("GK104GL", "kepler", "3.0"),
        ("GK110BGL", "kepler", "3.5"),
        ("GK180GL", "kepler", "3.5"),
        ("GK210GL", "kepler", "3.7"),
        ("GM107GL", "maxwell", "5.0"),
        ("GM200GL", "maxwell", "5.2"),
        ("GP100GL", "pascal", "6.0"),
        ("GP102GL", "pascal", "6.1"),
        ("GP104", "pascal", "6.1"),
        ("GP10B", "pascal", "6.2"),
        ("GV100GL", "volta", "7.0"),
        ("TU104GL", "turing", "7.5"),
        ("TU117", "turing", "7.5"),
        ("GA100", "ampere", "8.0"),
        ("GA102GL", "ampere", "8.6"),
        ("AD102", "ada", "8.9"),
        ("GH100", "hopper", "9.0"),
    ],
)
def test_chip_info(chip, arch, cc):
    assert detect.chip_info(chip) == (arch, cc)


@pytest.mark.parametrize("chip", [None, "", "NV43", "G92"])
def test_chip_info_unknown(chip):
    assert detect.chip_info(chip) is None


@pytest.mark.parametrize(
    ("cc", "arch"),
    [
        ("3.7", "kepler"),
        ("5.2", "maxwell"),
        ("6.1", "pascal"),
        ("7.0", "volta"),
        ("7.5", "turing"),
        ("8.0", "ampere"),
        ("8.6", "ampere"),
        ("8.9", "ada"),
        ("9.0", "hopper"),
        ("2.1", None),
    ],
)
def test_arch_for_cc(cc, arch):
    assert detect.arch_for_cc(cc) == arch


@pytest.mark.parametrize(
    ("name", "mib"),
    [
        ("Tesla P40", 24576),
        ("Tesla P100 PCIe 12GB", 12288),
        ("Tesla V100 PCIe 32GB", 32768),
        ("A100 PCIe 40GB", 40960),
        ("GeForce GTX 1080 Ti", 11264),
        ("GeForce GTX 1080", 8192),
        ("Tesla T4", 15360),
        ("H100 PCIe", 81920),
        ("NVIDIA device 10de:1b38", None),
    ],
)
def test_memory_for_model(name, mib):
    assert detect.memory_for_model(name) == mib


# -- nvidia-smi -------------------------------------------------------------------


def test_nvidia_smi_p40(db):
    [gpu] = smi("p40.nvidia-smi.csv", db)
    assert gpu.to_dict() == {**P40, "source": "nvidia-smi", "driver_version": "535.183.01"}


@pytest.mark.parametrize(
    ("record", "name", "chip", "arch", "cc", "mib"),
    [
        ("p100.nvidia-smi.csv", "Tesla P100-PCIE-16GB", "GP100GL", "pascal", "6.0", 16384),
        ("v100.nvidia-smi.csv", "Tesla V100-PCIE-32GB", "GV100GL", "volta", "7.0", 32768),
        ("t4.nvidia-smi.csv", "Tesla T4", "TU104GL", "turing", "7.5", 15360),
        ("a100.nvidia-smi.csv", "NVIDIA A100-PCIE-40GB", "GA100", "ampere", "8.0", 40960),
    ],
)
def test_nvidia_smi_models(db, record, name, chip, arch, cc, mib):
    [gpu] = smi(record, db)
    assert (gpu.name, gpu.chip, gpu.architecture, gpu.compute_capability, gpu.memory_mib) == (
        name,
        chip,
        arch,
        cc,
        mib,
    )


def test_nvidia_smi_two_p40(db):
    gpus = smi("2xp40.nvidia-smi.csv", db)
    assert [(g.index, g.bus_id, g.architecture) for g in gpus] == [
        (0, "0000:04:00.0", "pascal"),
        (1, "0000:82:00.0", "pascal"),
    ]


def test_nvidia_smi_470_has_no_compute_cap(db):
    # Driver 470 rejects compute_cap; the CC comes from the chip via pci.ids.
    [gpu] = smi("p40-470.nvidia-smi.csv", db)
    assert (gpu.compute_capability, gpu.architecture, gpu.driver_version) == (
        "6.1",
        "pascal",
        "470.256.02",
    )
    # Without a PCI ID database nothing tells the chip.
    [bare] = smi("p40-470.nvidia-smi.csv", {})
    assert (bare.chip, bare.architecture, bare.compute_capability) == (None, None, None)
    assert bare.memory_mib == 24576


def test_nvidia_smi_mixed_k80_a100_on_470(db):
    gpus = smi("k80-a100-470.nvidia-smi.csv", db)
    assert [(g.name, g.architecture, g.compute_capability) for g in gpus] == [
        ("Tesla K80", "kepler", "3.7"),
        ("Tesla K80", "kepler", "3.7"),
        ("NVIDIA A100-PCIE-40GB", "ampere", "8.0"),
    ]


def test_nvidia_smi_compute_cap_without_db():
    [gpu] = smi("t4.nvidia-smi.csv", {})
    assert (gpu.chip, gpu.architecture, gpu.compute_capability) == (None, "turing", "7.5")


def test_nvidia_smi_compute_cap_beats_the_chip_table(db):
    text = "0, Tesla P40, 00000000:04:00.0, 0x1B3810DE, 24576, 7.0, 535.183.01\n"
    [gpu] = detect.parse_nvidia_smi(text, db)
    assert (gpu.architecture, gpu.compute_capability) == ("volta", "7.0")


def test_nvidia_smi_not_available_values(db):
    text = "0, Tesla P40, 00000000:04:00.0, 0x1B3810DE, [N/A], [N/A], 535.183.01\n"
    [gpu] = detect.parse_nvidia_smi(text, db)
    assert (gpu.memory_mib, gpu.compute_capability) == (24576, "6.1")


@pytest.mark.parametrize("record", ["nogpu.nvidia-smi.txt", "nodriver.nvidia-smi.txt"])
def test_nvidia_smi_error_messages(db, record):
    with pytest.raises(detect.NvidiaSmiError):
        smi(record, db)


def test_nvidia_smi_empty():
    assert detect.parse_nvidia_smi("", {}) == []


# -- lspci ------------------------------------------------------------------------


def test_lspci_p40(db):
    [gpu] = pci("p40.lspci.txt", db)  # the Matrox BMC VGA is not NVIDIA's
    assert gpu.to_dict() == {**P40, "source": "lspci", "driver_version": None}


def test_lspci_unnamed_device_needs_the_db(db):
    # An old pci.ids: lspci prints "NVIDIA Corporation Device [10de:1b38]".
    assert "Device [10de:1b38]" in (REC / "p40-unnamed.lspci.txt").read_text()
    [gpu] = pci("p40-unnamed.lspci.txt", db)
    assert (gpu.name, gpu.chip, gpu.architecture, gpu.memory_mib) == (
        "Tesla P40",
        "GP102GL",
        "pascal",
        24576,
    )
    [bare] = pci("p40-unnamed.lspci.txt", {})
    assert (bare.name, bare.chip, bare.architecture, bare.compute_capability) == (
        "NVIDIA device 10de:1b38",
        None,
        None,
        None,
    )


def test_lspci_text_is_the_fallback_name():
    # No database at all: lspci's own text still carries the chip.
    [gpu] = pci("p40.lspci.txt", {})
    assert (gpu.name, gpu.chip, gpu.compute_capability) == ("Tesla P40", "GP102GL", "6.1")


def test_lspci_ignores_the_audio_function(db):
    [gpu] = pci("gtx1080ti.lspci.txt", db)
    assert (gpu.name, gpu.bus_id, gpu.memory_mib) == (
        "GeForce GTX 1080 Ti",
        "0000:01:00.0",
        11264,
    )


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ("2xp40.lspci.txt", [("Tesla P40", "6.1", 24576)] * 2),
        ("p100.lspci.txt", [("Tesla P100 PCIe 16GB", "6.0", 16384)]),
        ("v100.lspci.txt", [("Tesla V100 PCIe 32GB", "7.0", 32768)]),
        ("t4.lspci.txt", [("Tesla T4", "7.5", 15360)]),
        ("a100.lspci.txt", [("A100 PCIe 40GB", "8.0", 40960)]),
        ("h100.lspci.txt", [("H100 PCIe", "9.0", 81920)]),
        (
            "p40-v100.lspci.txt",
            [("Tesla P40", "6.1", 24576), ("Tesla V100 PCIe 32GB", "7.0", 32768)],
        ),
        (
            "k80-h100.lspci.txt",
            [("Tesla K80", "3.7", 12288), ("Tesla K80", "3.7", 12288), ("H100 PCIe", "9.0", 81920)],
        ),
        ("nogpu.lspci.txt", []),
        ("empty.lspci.txt", []),
    ],
)
def test_lspci_hosts(db, record, expected):
    gpus = pci(record, db)
    assert [(g.name, g.compute_capability, g.memory_mib) for g in gpus] == expected
    assert [g.index for g in gpus] == list(range(len(expected)))
    assert all(g.source == "lspci" and g.driver_version is None for g in gpus)


def test_lspci_without_domain(db):
    line = (
        "04:00.0 3D controller [0302]: NVIDIA Corporation GP102GL [Tesla P40] [10de:1b38] (rev a1)"
    )
    [gpu] = detect.parse_lspci(line, db)
    assert gpu.bus_id == "0000:04:00.0"


# -- detect() and the CLI ---------------------------------------------------------


def test_merge_adds_what_the_driver_does_not_drive(db):
    # Driver 535 ignores the K80 (Kepler's last branch is 470); lspci still sees it.
    report = detect.detect(
        (REC / "k80-a100-535.nvidia-smi.csv").read_text(),
        (REC / "k80-a100.lspci.txt").read_text(),
        EXCERPT,
        run_tools=False,
    )
    assert [(g["name"], g["index"], g["source"]) for g in report["gpus"]] == [
        ("Tesla K80", None, "lspci"),
        ("Tesla K80", None, "lspci"),
        ("NVIDIA A100-PCIE-40GB", 0, "nvidia-smi"),
    ]


def test_detect_falls_back_to_lspci_when_nvidia_smi_fails():
    report = detect.detect(
        (REC / "nodriver.nvidia-smi.txt").read_text(),
        (REC / "p40.lspci.txt").read_text(),
        EXCERPT,
        run_tools=False,
    )
    assert report["sources"]["nvidia-smi"] == "failed"
    assert [g["source"] for g in report["gpus"]] == ["lspci"]


def test_cli_detect_json(run_cli):
    code, report, _ = run_cli(
        "detect",
        "--json",
        "--nvidia-smi-file",
        str(REC / "p40-v100.nvidia-smi.csv"),
        "--lspci-file",
        str(REC / "p40-v100.lspci.txt"),
        "--pci-ids",
        str(EXCERPT),
    )
    assert code == 0
    assert report["sources"] == {"nvidia-smi": "ok", "lspci": "ok", "pci_ids": str(EXCERPT)}
    assert [g["architecture"] for g in report["gpus"]] == ["pascal", "volta"]
    assert all(set(g) == GPU_KEYS for g in report["gpus"])


def test_cli_detect_text(run_cli):
    code, out, _ = run_cli("detect", "--lspci-file", str(REC / "p40.lspci.txt"))
    assert code == 0
    assert "Tesla P40" in out and "pascal" in out and "[lspci]" in out


@pytest.mark.parametrize(
    "files",
    [
        ["--lspci-file", str(REC / "nogpu.lspci.txt")],
        ["--lspci-file", str(REC / "empty.lspci.txt")],
        ["--nvidia-smi-file", str(REC / "nogpu.nvidia-smi.txt")],
    ],
)
def test_cli_detect_no_gpu(run_cli, files):
    code, out, _ = run_cli("detect", "--json", "--pci-ids", str(EXCERPT), *files)
    assert code == 0
    assert out["gpus"] == []


def test_cli_detect_missing_file(run_cli, tmp_path):
    code, out, _ = run_cli("detect", "--json", "--lspci-file", str(tmp_path / "nope"))
    assert code == EngineError.code
    assert out["error"] == "detect-input-unreadable"


def _fake_tool(directory: Path, name: str, script: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_no_tools_on_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    report = detect.detect(pci_ids=EXCERPT)
    assert report["gpus"] == []
    assert report["sources"]["nvidia-smi"] == report["sources"]["lspci"] == "missing"


def test_runs_nvidia_smi_again_without_compute_cap(monkeypatch, tmp_path):
    # What a 470 driver does with a field it does not know.
    legacy = (REC / "p40-470.nvidia-smi.csv").read_text()
    _fake_tool(
        tmp_path,
        "nvidia-smi",
        'case "$1" in *compute_cap*)\n'
        "  echo 'Field \"compute_cap\" is not a valid field to query.' >&2; exit 2;;\n"
        f"esac\ncat <<'EOF'\n{legacy}EOF\n",
    )
    _fake_tool(tmp_path, "lspci", f"cat <<'EOF'\n{(REC / 'p40.lspci.txt').read_text()}EOF\n")
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + "/usr/bin:/bin")
    report = detect.detect(pci_ids=EXCERPT)
    [gpu] = report["gpus"]
    assert (gpu["source"], gpu["driver_version"], gpu["compute_capability"]) == (
        "nvidia-smi",
        "470.256.02",
        "6.1",
    )
