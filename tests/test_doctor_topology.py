"""``oldgpu doctor`` on a multi-GPU host: its ``gpu-topology`` check (recorded topologies)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from test_doctor import healthy_p40

from oldgpu import topology
from oldgpu.doctor import checks as doctor_checks
from oldgpu.doctor import facts as doctor_facts
from oldgpu.output import EngineError

TOPO = Path(__file__).resolve().parent / "data/topology"


def report(box: str, ib: list[str]) -> dict:
    topo = topology.parse(
        (TOPO / f"{box}.topo-m.txt").read_bytes(), (TOPO / f"{box}.topo-p2p-r.txt").read_bytes()
    )
    # As gather_facts stores it: JSON, like a recorded facts file.
    return json.loads(json.dumps(topology.report(topo, None, ib)))


def test_acs_box_warns_with_the_cause_and_the_fix():
    f = healthy_p40() | {"topology": report("4xp40-acs", [])}
    rep = doctor_checks.evaluate(f)
    ids = [c["id"] for c in rep["checks"]]
    assert ids == [*doctor_checks.CHECK_IDS, doctor_checks.TOPOLOGY_CHECK_ID]
    topo = rep["checks"][-1]
    assert topo["status"] == "warn" and "ACS" in topo["fix"] and "iommu=pt" in topo["fix"]
    assert topo["details"]["nccl_env"]["NCCL_P2P_DISABLE"] == "1"
    # A warning: the engine's NCCL_P2P_DISABLE keeps jobs working, so the host is ready.
    assert rep["ok"] is True and rep["summary"] == "10 ok, 1 warn, 0 fail"


def test_check_ids_share_one_style():
    """kebab-case, as the engine's error names: a reader matching on an id guesses it right."""
    ids = [*doctor_checks.CHECK_IDS, *doctor_checks.OPTIONAL_CHECK_IDS]
    assert [i for i in ids if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", i)] == []
    assert "gpu-topology" in doctor_checks.OPTIONAL_CHECK_IDS


def test_healthy_switch_box_is_ok():
    rep = doctor_checks.evaluate(healthy_p40() | {"topology": report("4xp40-switch", ["mlx5_0"])})
    assert rep["checks"][-1]["status"] == "ok" and rep["summary"] == "11 ok, 0 warn, 0 fail"


def test_no_topology_leaves_the_report_as_it_was():
    for topo in (None, {}):
        rep = doctor_checks.evaluate(healthy_p40() | {"topology": topo})
        assert [c["id"] for c in rep["checks"]] == list(doctor_checks.CHECK_IDS)
        assert rep["counts"] == {"ok": 10, "warn": 0, "fail": 0, "skip": 0}


def test_unreadable_topology_warns():
    rep = doctor_checks.evaluate(healthy_p40() | {"topology": {"error": "nvidia-smi failed"}})
    assert (
        rep["checks"][-1]["status"] == "warn" and "nvidia-smi failed" in rep["checks"][-1]["seen"]
    )


def gpus(n: int) -> dict:
    return {"gpus": [{"index": i} for i in range(n)]}


def test_facts_read_the_topology_only_for_several_driven_gpus(monkeypatch):
    calls = []

    def read_host():
        calls.append(1)
        return topology.parse((TOPO / "4xp40-switch.topo-m.txt").read_bytes(), None)

    monkeypatch.setattr(topology, "read_host", read_host)
    monkeypatch.setattr(topology, "ib_devices", lambda *a: [])
    assert doctor_facts.topology_facts(gpus(1)) is None
    assert doctor_facts.topology_facts({"gpus": [{"index": None}, {"index": None}]}) is None
    recorded = argparse.Namespace(nvidia_smi_file="x.csv")
    assert doctor_facts.topology_facts(gpus(4), recorded) is None
    assert calls == []
    rep = doctor_facts.topology_facts(gpus(4))
    assert rep["host_gpus"] == [0, 1, 2, 3] and rep["p2p_ok"] is None  # no -p2p output
    assert rep["nccl_env"] == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}

    def broken():
        raise EngineError("topology-unavailable", "nvidia-smi topo -m exited 9")

    monkeypatch.setattr(topology, "read_host", broken)
    assert doctor_facts.topology_facts(gpus(2)) == {"error": "nvidia-smi topo -m exited 9"}
