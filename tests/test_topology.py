"""oldgpu topology: nvidia-smi's topology matrices -> the NCCL settings of a job."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from oldgpu import cli, topo_matrix, topology
from oldgpu.output import EngineError

DATA = Path(__file__).parent / "data"
REC = DATA / "topology"
BOXES = ("4xp40-switch", "8xp40-2socket", "4xp40-acs")


def texts(box: str) -> tuple[str, str]:
    return (
        (REC / f"{box}.topo-m.txt").read_text(),
        (REC / f"{box}.topo-p2p-r.txt").read_text(),
    )


def load(box: str) -> topo_matrix.Topology:
    return topology.parse(*texts(box))


def error_name(call, *args) -> str:
    with pytest.raises(EngineError) as info:
        call(*args)
    return info.value.name


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """``oldgpu.cli.main`` with only this command (others may be half-built)."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("oldgpu.topology",))

    def _run(*argv: str) -> tuple[int, str, str]:
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return _run


# -- the recorded boxes -------------------------------------------------------------


def test_4xp40_switch_parses():
    topo = load("4xp40-switch")
    assert topo.gpus == (0, 1, 2, 3)
    assert {topo.link(a, b) for a in topo.gpus for b in topo.gpus if a != b} == {"PIX"}
    assert all(topo.link(g, g) == "X" for g in topo.gpus)
    assert topo.affinity[3] == {"cpu": "0-15", "numa": "0", "gpu_numa_id": "N/A"}
    assert topo.nics == {}
    assert topo.p2p_read(0, 3) == "OK"


def test_8xp40_two_sockets_parses():
    topo = load("8xp40-2socket")
    assert topo.gpus == tuple(range(8))
    assert (topo.link(0, 1), topo.link(0, 2), topo.link(0, 4), topo.link(7, 6)) == (
        "PIX",
        "PXB",
        "SYS",
        "PIX",
    )
    assert topo.affinity[0]["cpu"] == "0-13,28-41"
    assert topo.affinity[5] == {"cpu": "14-27,42-55", "numa": "1", "gpu_numa_id": "N/A"}
    assert topo.nics == {"NIC0": "mlx5_0"}  # from the NIC legend, not a GPU
    assert (topo.p2p_read(1, 3), topo.p2p_read(3, 4)) == ("OK", "CNS")


def test_acs_box_parses_old_driver_format():
    topo = load("4xp40-acs")
    assert topo.affinity[0] == {"cpu": "0-11,24-35", "numa": "0"}  # 470: no GPU NUMA ID
    assert {topo.p2p_read(a, b) for a in topo.gpus for b in topo.gpus if a != b} == {"CNS"}


@pytest.mark.parametrize(
    ("box", "gpus", "ib", "env"),
    [
        ("4xp40-switch", [0, 1, 2, 3], False, {"NCCL_IB_DISABLE": "1"}),
        ("4xp40-switch", [0, 1, 2, 3], True, {}),
        ("4xp40-switch", [2], False, {"NCCL_IB_DISABLE": "1"}),
        ("8xp40-2socket", [0, 1], True, {}),  # one switch
        ("8xp40-2socket", [0, 3], True, {}),  # two switches, one socket
        ("8xp40-2socket", [4, 5, 6, 7], True, {}),
        ("8xp40-2socket", [0, 4], True, {"NCCL_P2P_DISABLE": "1"}),  # across sockets
        ("8xp40-2socket", [3, 4], False, {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}),
        ("8xp40-2socket", list(range(8)), True, {"NCCL_P2P_DISABLE": "1"}),
        ("4xp40-acs", [0, 1], True, {"NCCL_P2P_DISABLE": "1"}),
        ("4xp40-acs", [0, 1, 2, 3], False, {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}),
        ("4xp40-acs", [3], True, {}),  # one GPU: no P2P to break
    ],
)
def test_nccl_env(box, gpus, ib, env):
    assert topology.nccl_env(load(box), gpus, ib) == env


def test_p2p_unknown_disables_p2p_for_several_gpus_only():
    topo = topology.parse(texts("4xp40-switch")[0])
    assert topo.p2p is None
    assert topology.nccl_env(topo, [0, 1], True) == {"NCCL_P2P_DISABLE": "1"}
    assert topology.nccl_env(topo, [1], True) == {}
    [p2p] = [f for f in topology.findings(topo, [0, 1], ["mlx5_0"]) if f["id"].startswith("p2p")]
    assert (p2p["id"], p2p["status"]) == ("p2p-unknown", "warn")


def test_p2p_groups_are_the_sockets():
    assert topology.p2p_groups(load("8xp40-2socket")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topology.p2p_groups(load("4xp40-switch")) == [[0, 1, 2, 3]]
    assert topology.p2p_groups(load("4xp40-acs")) == [[0], [1], [2], [3]]


def test_acs_finding_names_cause_and_fix():
    found = {f["id"]: f for f in topology.findings(load("4xp40-acs"), [0, 1, 2, 3], [])}
    broken = found["p2p-broken"]
    assert broken["status"] == "warn"
    assert "ACS" in broken["cause"] and "IOMMU" in broken["cause"]
    for text in ("intel_iommu=on iommu=pt", "amd_iommu=on iommu=pt", "ACS", "speed"):
        assert text in broken["fix"]
    assert found["infiniband"]["seen"].startswith("no InfiniBand")


def test_cross_socket_finding_is_no_fault_and_suggests_one_socket():
    found = {f["id"]: f for f in topology.findings(load("8xp40-2socket"), [0, 4], [])}
    assert "p2p-broken" not in found
    assert found["p2p-cross-socket"]["status"] == "ok"
    assert "[[0, 1, 2, 3], [4, 5, 6, 7]]" in found["p2p-cross-socket"]["fix"]
    within = {f["id"]: f for f in topology.findings(load("8xp40-2socket"), [4, 6], ["mlx5_0"])}
    assert within["p2p"]["status"] == "ok" and "PXB" in within["p2p"]["seen"]
    assert "mlx5_0" in within["infiniband"]["seen"]


def test_root_complex_refusal_is_its_own_finding():
    text = texts("4xp40-acs")[0].replace("PIX", "PHB")
    topo = topology.parse(text, texts("4xp40-acs")[1])
    ids = [f["id"] for f in topology.findings(topo, [0, 1], [])]
    assert ids == ["p2p-root-complex", "infiniband"]


def test_report_and_doctor_check():
    rep = topology.report(load("4xp40-acs"), [0, 2], [], "/sys/class/infiniband")
    assert rep["gpus"] == [0, 2] and rep["host_gpus"] == [0, 1, 2, 3]
    assert rep["pairs"] == [
        {
            "gpus": [0, 2],
            "link": "PIX",
            "link_meaning": topo_matrix.LINKS["PIX"],
            "p2p_read": "CNS",
            "p2p_meaning": "chipset not supported",
        }
    ]
    assert rep["p2p_ok"] is False
    assert rep["matrix"]["GPU1"]["GPU3"] == "PIX" and rep["p2p_read"]["GPU1"]["GPU3"] == "CNS"
    check = topology.doctor_check(rep)
    assert (check["id"], check["status"]) == ("gpu-topology", "warn")
    assert "ACS" in check["fix"] and "iommu=pt" in check["fix"]
    assert check["details"]["nccl_env"] == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
    healthy = topology.doctor_check(topology.report(load("4xp40-switch"), None, ["mlx5_0"]))
    assert (healthy["status"], healthy["fix"]) == ("ok", "")


def test_report_round_trips_through_json():
    rep = json.loads(json.dumps(topology.report(load("8xp40-2socket"), [0, 1])))
    again = topo_matrix.Topology.from_dict(rep)
    assert again.gpus == tuple(range(8))
    assert topology.nccl_env(rep, [0, 1], True) == {}
    assert topology.nccl_env(rep, [1, 5], True) == {"NCCL_P2P_DISABLE": "1"}


# -- formats seen in the wild -------------------------------------------------------


def test_terminal_underline_is_ignored():
    plain_m, plain_p = texts("8xp40-2socket")
    first_m, rest_m = plain_m.split("\n", 1)
    first_p, rest_p = plain_p.split("\n", 1)
    tty_m = first_m.replace("GPU0", "\x1b[4mGPU0", 1) + "\x1b[0m\n" + rest_m
    tty_p = first_p.replace("GPU0", "\x1b[4mGPU0", 1).rstrip("\t") + "\t\x1b[0m\n" + rest_p
    assert topology.parse(tty_m, tty_p) == topology.parse(plain_m, plain_p)


@pytest.mark.parametrize("box", BOXES)
def test_pasted_copy_with_spaces_and_crlf(box):
    m, p = texts(box)
    assert topology.parse(m.expandtabs(8), p.expandtabs(8)) == load(box)
    assert topology.parse(m.replace("\n", "\r\n"), p.replace("\n", "\r\n")) == load(box)


def test_old_driver_soc_and_nic_column():
    # Drivers before ~418: SOC for SYS, only CPU Affinity, NICs named by device.
    text = (
        "\tGPU0\tGPU1\tGPU2\tmlx5_0\tCPU Affinity\n"
        "GPU0\t X \tPIX\tSOC\tSOC\t0-13\n"
        "GPU1\tPIX\t X \tSOC\tSOC\t0-13\n"
        "GPU2\tSOC\tSOC\t X \tPHB\t14-27\n"
        "mlx5_0\tSOC\tSOC\tPHB\t X \t\n"
    )
    topo = topology.parse(text)
    assert topo.nics == {"mlx5_0": "mlx5_0"}
    assert topo.affinity[2] == {"cpu": "14-27"}
    assert topology.describe_link(topo, "SOC").startswith("across CPU sockets")


def test_nvlink_and_single_gpu():
    nv = topology.parse(
        "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV2\t0-23\t0\nGPU1\tNV2\t X \t0-23\t0\n",
        " \tGPU0\tGPU1\t\n GPU0\tX\tOK\t\n GPU1\tOK\tX\t\n",
    )
    assert topology.describe_link(nv, "NV2") == "2 bonded NVLink(s)"
    assert topology.nccl_env(nv, [0, 1], True) == {}
    one = topology.parse(
        "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-15\t0\t\tN/A\n",
        " \tGPU0\t\n GPU0\tX\t\n",
    )
    assert one.gpus == (0,) and topology.nccl_env(one, [0], False) == {"NCCL_IB_DISABLE": "1"}


def test_asymmetric_p2p_takes_the_worse_direction():
    m, p = texts("4xp40-switch")
    p = p.replace(" GPU2\tOK\t", " GPU2\tNS\t", 1)  # 2 -> 0 refused, 0 -> 2 OK
    topo = topology.parse(m, p)
    assert (topo.p2p_read(0, 2), topo.p2p_read(2, 0)) == ("NS", "NS")
    assert topology.nccl_env(topo, [0, 2], True) == {"NCCL_P2P_DISABLE": "1"}
    assert topology.nccl_env(topo, [1, 3], True) == {}


# -- infiniband ---------------------------------------------------------------------


def test_ib_devices_from_sysfs(tmp_path):
    assert topology.ib_devices(tmp_path / "absent") == []
    assert topology.ib_devices(tmp_path) == []
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").symlink_to(tmp_path / "mlx5_1")
    assert topology.ib_devices(tmp_path) == ["mlx5_0", "mlx5_1"]


def test_ib_listing():
    assert topology.ib_devices_from_text("") == []
    assert topology.ib_devices_from_text(b"mlx5_0\nmlx5_1\n") == ["mlx5_0", "mlx5_1"]
    assert error_name(topology.ib_devices_from_text, b"\x00\x01") == "topology-input-binary"
    assert error_name(topology.ib_devices_from_text, "mlx5_0 $(x)") == "topology-bad-ib-listing"


# -- refusals -----------------------------------------------------------------------


def _drop_line(text: str, starts: str) -> str:
    return "".join(line for line in text.splitlines(True) if not line.startswith(starts))


M4, P4 = texts("4xp40-switch")
M8, P8 = texts("8xp40-2socket")
MALFORMED = {
    "binary": (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)), "topology-input-binary"),
    "latin-1": ("\tGPU0\nGPU0\t X \tcaf\xe9\n".encode("latin-1"), "topology-input-binary"),
    "nul": (M4.replace("PIX", "P\x00X", 1), "topology-input-binary"),
    "empty": (b"", "topology-input-empty"),
    "blank": ("\n \n\t\n", "topology-input-empty"),
    "csv-with-header": (
        "index, name, pci.bus_id\n0, Tesla P40, 00000000:04:00.0\n",
        "topology-no-matrix",
    ),
    "csv-noheader": ((DATA / "detect" / "2xp40.nvidia-smi.csv").read_text(), "topology-no-matrix"),
    "prose": ("the GPUs are fine\n", "topology-no-matrix"),
    "no-driver": (
        (DATA / "detect" / "nodriver.nvidia-smi.txt").read_text(),
        "topology-nvidia-smi-failed",
    ),
    "no-devices": ("No devices were found\n", "topology-nvidia-smi-failed"),
    "row-missing": (_drop_line(M4, "GPU2"), "topology-not-square"),
    "cell-missing": (M4.replace("PIX\tPIX\t0-15", "PIX\t\t0-15", 1), "topology-not-square"),
    "truncated": (M4[: M4.rindex("\nGPU3") + 10], "topology-not-square"),
    "extra-column": (M4.replace("GPU3\tCPU", "GPU3\tGPU4\tCPU", 1), "topology-not-square"),
    "row-twice": (M4.replace("\nGPU3\t", "\nGPU2\t"), "topology-not-square"),
    "stray-row": (M4.replace("\nGPU3\t", "\nGPU9\t"), "topology-not-square"),
    "header-twice": (M4.replace("GPU3\tCPU", "GPU2\tCPU", 1), "topology-not-square"),
    "unknown-code": (M4.replace("PIX", "FOO", 1), "topology-bad-cell"),
    "lowercase": (M4.replace("PIX", "pix", 1), "topology-bad-cell"),
    "diagonal": (M4.replace(" X ", "PIX", 1), "topology-bad-cell"),
    "x-off-diagonal": (M4.replace("PIX", "X", 1), "topology-bad-cell"),
    "p2p-as-topo": (P4, "topology-wrong-matrix"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_link_matrix(case):
    text, name = MALFORMED[case]
    assert error_name(topology.parse, text) == name


@pytest.mark.parametrize(
    ("p2p", "name"),
    [
        (M4, "topology-wrong-matrix"),
        (P8, "topology-p2p-mismatch"),
        (P4.replace("OK", "MAYBE", 1), "topology-bad-cell"),
        (P4.replace("OK", "PIX", 1), "topology-wrong-matrix"),
        (P4.replace("OK\t\n", "OK\tOK\t\n", 1), "topology-not-square"),
        (_drop_line(P4, " GPU1"), "topology-not-square"),
        (b"", "topology-input-empty"),
        (b"\x00" * 10, "topology-input-binary"),
    ],
)
def test_malformed_p2p_matrix(p2p, name):
    assert error_name(topology.parse, M4, p2p) == name


def test_gpus_absent_from_the_matrix():
    topo = load("4xp40-switch")
    assert error_name(topology.nccl_env, topo, [0, 4], True) == "topology-gpu-unknown"
    assert error_name(topology.report, topo, [7]) == "topology-gpu-unknown"


@pytest.mark.parametrize("text", ["", "0,", "a,b", "0;1", "-1", "0,0", "1.5"])
def test_bad_gpus_flag(text):
    assert error_name(topology.parse_gpus, text) == "topology-bad-gpus"


def test_legend_of_a_new_driver_explains_a_new_code():
    # A code nvidia-smi's own legend explains is read, not refused.
    legend = "C2C  = Connection over chip-to-chip\n  NV# ="
    m = M4.replace("PIX", "C2C", 1).replace("NV#  =", legend)
    topo = topology.parse(m)
    assert topology.describe_link(topo, "C2C") == "Connection over chip-to-chip"


# -- fuzzing: bad input gets a named error, never a traceback or "no GPUs" ---------


def _mutate(rng: random.Random, text: str) -> str | bytes:
    lines = text.splitlines(True)
    kind = rng.randrange(8)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
    if kind == 1:
        alphabet = "GPU0123456789XPIXSYSNODE \t\n,-:=OKCNS"
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 400)))
    if kind == 2:
        return text[: rng.randrange(len(text))]
    if kind == 3 and len(lines) > 1:
        del lines[rng.randrange(len(lines))]
    elif kind == 4:
        i = rng.randrange(len(lines))
        lines.insert(i, lines[rng.randrange(len(lines))])
    elif kind == 5:
        cells = text.split("\t")
        cells[rng.randrange(len(cells))] = rng.choice(["", "??", "OK", "PIX", "GPU7", "X", "9"])
        return "\t".join(cells)
    elif kind == 6:
        chars = list(text)
        for _ in range(rng.randrange(1, 10)):
            chars[rng.randrange(len(chars))] = chr(rng.randrange(0, 0x3000))
        return "".join(chars)
    else:
        return text.replace("\t", rng.choice([" ", "  ", ",", ""]), rng.randrange(1, 20))
    return "".join(lines)


@pytest.mark.parametrize("seed", range(6))
def test_fuzzed_input_never_crashes(seed):
    rng = random.Random(seed)
    sources = [t for box in BOXES for t in texts(box)]
    parsed = refused = 0
    for _ in range(150):
        base = rng.choice(sources)
        bad = _mutate(rng, base)
        target = rng.choice(["links", "p2p"])
        try:
            if target == "links":
                topo = topology.parse(bad)
            else:
                topo = topology.parse(texts("8xp40-2socket")[0] if "GPU7" in base else M4, bad)
        except EngineError as exc:
            assert exc.name.startswith("topology-"), exc.name
            refused += 1
            continue
        parsed += 1
        # What parses is a whole matrix: at least one GPU, a link for every pair.
        assert topo.gpus and all((a, b) in topo.links for a in topo.gpus for b in topo.gpus)
        assert set(topology.nccl_env(topo, list(topo.gpus), False)) <= {
            "NCCL_P2P_DISABLE",
            "NCCL_IB_DISABLE",
        }
    assert refused > 0


# -- the command --------------------------------------------------------------------


def test_cli_json(run_cli, tmp_path):
    (tmp_path / "ib").write_text("")
    code, out, _ = run_cli(
        "topology",
        "--json",
        "--topo-file",
        str(REC / "8xp40-2socket.topo-m.txt"),
        "--p2p-file",
        str(REC / "8xp40-2socket.topo-p2p-r.txt"),
        "--gpus",
        "0,4",
        "--ib-file",
        str(tmp_path / "ib"),
    )
    assert code == 0
    doc = json.loads(out)
    assert doc["gpus"] == [0, 4]
    assert doc["nccl_env"] == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
    assert doc["matrix"]["GPU0"]["GPU4"] == "SYS" and doc["p2p_read"]["GPU0"]["GPU4"] == "CNS"
    assert doc["infiniband"] == {"present": False, "devices": [], "source": str(tmp_path / "ib")}
    assert {f["id"] for f in doc["findings"]} == {"p2p-cross-socket", "infiniband"}


def test_cli_text_with_ib_dir(run_cli, tmp_path):
    (tmp_path / "mlx5_0").mkdir()
    code, out, _ = run_cli(
        "topology",
        "--topo-file",
        str(REC / "4xp40-acs.topo-m.txt"),
        "--p2p-file",
        str(REC / "4xp40-acs.topo-p2p-r.txt"),
        "--ib-dir",
        str(tmp_path),
    )
    assert code == 0
    assert "NCCL: NCCL_P2P_DISABLE=1\n" in out
    assert "cause: PCIe ACS" in out and "iommu=pt" in out


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["--topo-file", "/nonexistent/topo"], "topology-input-unreadable"),
        (["--p2p-file", str(REC / "4xp40-acs.topo-p2p-r.txt")], "topology-input-missing"),
        (["--topo-file", str(REC / "README.md")], "topology-no-matrix"),
        (["--topo-file", str(REC / "4xp40-acs.topo-m.txt"), "--gpus", "5"], "topology-gpu-unknown"),
    ],
)
def test_cli_refusals(run_cli, argv, name):
    code, out, err = run_cli("topology", "--json", "--ib-dir", "/nonexistent", *argv)
    assert code == 2
    assert json.loads(out)["error"] == name
    assert err.startswith(f"oldgpu topology: {name}:")
    assert "Traceback" not in err


def test_cli_without_nvidia_smi(run_cli, monkeypatch):
    monkeypatch.setattr(topology.shutil, "which", lambda _name: None)
    code, out, _ = run_cli("topology", "--json")
    assert code == 2 and json.loads(out)["error"] == "topology-unavailable"
