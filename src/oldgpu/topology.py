"""``oldgpu topology``: how a host's GPUs are wired, and the NCCL settings that follow.

Reads ``nvidia-smi topo -m`` (the link matrix: PIX/PXB/PHB/NODE/SYS/NV#) and
``nvidia-smi topo -p2p r`` (whether the driver allows P2P reads per pair).
P40 servers often have P2P broken by PCIe ACS or the IOMMU, and NCCL then
hangs; NCCL's maintainers' answer is ``NCCL_P2P_DISABLE=1``, which costs only
speed. So P2P is disabled whenever a pair of the job's GPUs does not read
``OK`` (or the status is unknown), and ``NCCL_IB_DISABLE=1`` is set when the
host has no verbs device under /sys/class/infiniband.

``oldgpu.topo_matrix`` reads the two outputs; ``oldgpu.devices`` picks a
job's cards.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from oldgpu import subcommand
from oldgpu.output import EngineError, Result
from oldgpu.topo_matrix import LINKS, NVLINK, P2P_CODES, Topology, decode, parse

IB_DIR = "/sys/class/infiniband"
# The id of the doctor's check that ``doctor_check`` makes (kebab-case, as all its ids).
DOCTOR_CHECK_ID = "gpu-topology"

# Links where peers should reach each other without a CPU in the path: a
# refusal there is ACS or the IOMMU, not the platform.
SWITCH_LINKS = ("PIX", "PXB")
CROSS_SOCKET_LINKS = ("SYS", "SOC")

ACS_CAUSE = (
    "PCIe ACS (Access Control Services) on the switch or root ports, or the IOMMU "
    "(VT-d / AMD-Vi), sends peer-to-peer traffic up to the root complex, which drops "
    "or refuses it; NCCL then hangs when it uses P2P"
)
ACS_FIX = (
    "disable ACS on the PCIe switches (a BIOS setting, or `setpci -s <bridge> "
    "ECAP_ACS+0x6.w=0000` for each bridge at every boot) and boot with "
    "`intel_iommu=on iommu=pt` (AMD: `amd_iommu=on iommu=pt`) or turn VT-d/IOMMU off "
    "in the BIOS; until then NCCL_P2P_DISABLE=1 (set by oldgpu) keeps NCCL working, "
    "at the cost of speed only"
)


def _err(name: str, message: str) -> EngineError:
    return EngineError(f"topology-{name}", message)


def parse_gpus(text: str) -> list[int]:
    """``"0,1,3"`` -> ``[0, 1, 3]``; anything else is a named error."""
    parts = [p.strip() for p in text.split(",")]
    if not all(re.fullmatch(r"[0-9]+", p) for p in parts):
        raise _err("bad-gpus", f"--gpus {text!r}: give GPU indices separated by commas, e.g. 0,1")
    gpus = [int(p) for p in parts]
    if len(set(gpus)) != len(gpus):
        raise _err("bad-gpus", f"--gpus {text!r} names a GPU twice")
    return gpus


# -- deciding ---------------------------------------------------------------------


def _as_topology(topology: Topology | Mapping[str, Any]) -> Topology:
    return topology if isinstance(topology, Topology) else Topology.from_dict(topology)


def _check_gpus(topo: Topology, gpu_indices: Sequence[int]) -> list[int]:
    gpus = [int(g) for g in gpu_indices]
    absent = [g for g in gpus if g not in topo.gpus]
    if absent:
        raise _err(
            "gpu-unknown",
            f"GPU(s) {absent} are not in the topology, which has GPUs {list(topo.gpus)}",
        )
    return gpus


def _pairs(gpus: Sequence[int]) -> list[tuple[int, int]]:
    return [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1 :]]


def p2p_ok(topology: Topology | Mapping[str, Any], gpu_indices: Sequence[int]) -> bool | None:
    """Whether P2P reads work between every pair of these GPUs; None when unknown."""
    topo = _as_topology(topology)
    gpus = _check_gpus(topo, gpu_indices)
    if len(gpus) < 2:
        return True
    if topo.p2p is None:
        return None
    return all(topo.p2p_read(a, b) == "OK" for a, b in _pairs(gpus))


def nccl_env(
    topology: Topology | Mapping[str, Any], gpu_indices: Sequence[int], ib_present: bool
) -> dict[str, str]:
    """NCCL variables for a job on these GPUs; only what must change from NCCL's defaults.

    P2P is disabled when any pair of the job's GPUs does not read ``OK``, or
    when the status is unknown (a hang costs more than the speed).
    """
    env = {}
    if p2p_ok(topology, gpu_indices) is not True:
        env["NCCL_P2P_DISABLE"] = "1"
    if not ib_present:
        env["NCCL_IB_DISABLE"] = "1"
    return env


def p2p_groups(topology: Topology | Mapping[str, Any]) -> list[list[int]]:
    """GPUs that read each other ``OK``, grouped (greedy cliques in index order)."""
    topo = _as_topology(topology)
    groups: list[list[int]] = []
    for g in topo.gpus:
        home = next((grp for grp in groups if all(topo.p2p_read(g, o) == "OK" for o in grp)), None)
        if home is None:
            groups.append([g])
        else:
            home.append(g)
    return groups


def ib_devices(ib_dir: str | Path = IB_DIR) -> list[str]:
    """Verbs devices (InfiniBand, or RoCE NICs) the kernel lists; none when no directory."""
    path = Path(ib_dir)
    try:
        return sorted(p.name for p in path.iterdir())
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise _err("input-unreadable", f"{path}: {exc.strerror}") from exc


def ib_devices_from_text(text: str | bytes, what: str = "the InfiniBand listing") -> list[str]:
    """Device names of a recorded ``ls -1 /sys/class/infiniband`` (empty: none)."""
    if not text.strip():
        return []
    names = decode(text, what).split()
    bad = [n for n in names if not re.fullmatch(r"[A-Za-z0-9_.:-]+", n)]
    if bad:
        raise _err("bad-ib-listing", f"{what}: {bad[0]!r} is not a device name")
    return sorted(names)


def _finding(fid: str, status: str, seen: str, cause: str = "", fix: str = "") -> dict[str, str]:
    return {"id": fid, "status": status, "seen": seen, "cause": cause, "fix": fix}


def _pairs_text(pairs: Sequence[tuple[int, int, str, str | None]]) -> str:
    shown = ", ".join(f"{a}-{b} {link} {status}" for a, b, link, status in pairs[:6])
    return shown + (", ..." if len(pairs) > 6 else "")


def findings(topo: Topology, gpus: Sequence[int], ib: Sequence[str]) -> list[dict[str, str]]:
    """What the topology means for a job on ``gpus``, each with its cause and fix."""
    out = []
    pairs = _pairs(gpus)
    if not pairs:
        out.append(_finding("p2p", "ok", f"one GPU ({gpus[0] if gpus else '-'}): no P2P needed"))
    elif topo.p2p is None:
        out.append(
            _finding(
                "p2p-unknown",
                "warn",
                "P2P status unknown (no `nvidia-smi topo -p2p r` output): NCCL_P2P_DISABLE=1",
                "the driver's P2P matrix was not read (a driver without `topo -p2p`?)",
                "record `nvidia-smi topo -p2p r`; P2P stays disabled until it reads OK",
            )
        )
    else:
        status = [(a, b, topo.link(a, b), topo.p2p_read(a, b)) for a, b in pairs]
        broken = [p for p in status if p[3] != "OK"]
        switch = [p for p in broken if p[2] in SWITCH_LINKS or NVLINK.match(p[2])]
        sockets = [p for p in broken if p[2] in CROSS_SOCKET_LINKS]
        root = [p for p in broken if p not in switch and p not in sockets]
        if not broken:
            kinds = ", ".join(sorted({p[2] for p in status}))
            out.append(_finding("p2p", "ok", f"P2P reads OK between GPUs {list(gpus)} ({kinds})"))
        if switch:
            out.append(
                _finding(
                    "p2p-broken",
                    "warn",
                    "P2P reads refused between GPUs behind one PCIe switch "
                    f"({_pairs_text(switch)}): NCCL_P2P_DISABLE=1",
                    ACS_CAUSE,
                    ACS_FIX,
                )
            )
        if root:
            out.append(
                _finding(
                    "p2p-root-complex",
                    "warn",
                    f"P2P reads refused through the CPU's root complex ({_pairs_text(root)}): "
                    "NCCL_P2P_DISABLE=1",
                    "the chipset may not forward peer traffic between its root ports (CNS), "
                    "or " + ACS_CAUSE,
                    ACS_FIX + "; or put the job's cards behind one PCIe switch",
                )
            )
        if sockets:
            groups = [g for g in p2p_groups(topo) if len(g) > 1]
            out.append(
                _finding(
                    "p2p-cross-socket",
                    "ok",
                    f"the job spans CPU sockets ({_pairs_text(sockets)}): NCCL_P2P_DISABLE=1",
                    "the driver does not route P2P between the root complexes of two "
                    "sockets on this platform; usual for dual-socket P40 servers",
                    "to keep P2P, run the job on the GPUs of one socket"
                    + (f" (devices: one of {groups})" if groups else ""),
                )
            )
    if ib:
        out.append(
            _finding("infiniband", "ok", f"verbs devices {', '.join(ib)}: NCCL may use them")
        )
    else:
        out.append(
            _finding(
                "infiniband",
                "ok",
                "no InfiniBand/RoCE device: NCCL_IB_DISABLE=1, NCCL uses TCP between nodes",
            )
        )
    return out


def describe_link(topo: Topology, code: str) -> str:
    if NVLINK.match(code):
        return f"{code[2:]} bonded NVLink(s)"
    return LINKS.get(code) or topo.legend.get(code, "unknown link type")


def report(
    topology: Topology | Mapping[str, Any],
    gpu_indices: Sequence[int] | None = None,
    ib: Sequence[str] = (),
    ib_source: str = IB_DIR,
) -> dict[str, Any]:
    """The ``oldgpu topology --json`` document for a job on ``gpu_indices`` (all: None)."""
    topo = _as_topology(topology)
    gpus = list(topo.gpus) if gpu_indices is None else _check_gpus(topo, gpu_indices)
    pairs = [
        {
            "gpus": [a, b],
            "link": topo.link(a, b),
            "link_meaning": describe_link(topo, topo.link(a, b)),
            "p2p_read": topo.p2p_read(a, b),
            "p2p_meaning": None
            if topo.p2p is None
            else P2P_CODES.get(topo.p2p_read(a, b) or "", "see nvidia-smi's legend"),
        }
        for a, b in _pairs(gpus)
    ]
    return {
        **topo.to_dict(),
        "host_gpus": list(topo.gpus),
        "gpus": gpus,
        "pairs": pairs,
        "p2p_ok": p2p_ok(topo, gpus),
        "infiniband": {"present": bool(ib), "devices": list(ib), "source": ib_source},
        "nccl_env": nccl_env(topo, gpus, bool(ib)),
        "findings": findings(topo, gpus, ib),
    }


def doctor_check(rep: Mapping[str, Any]) -> dict[str, Any]:
    """A ``report`` as one check of ``oldgpu doctor`` (its id/status/seen/fix shape)."""
    order = ("skip", "ok", "warn", "fail")
    items = rep["findings"]
    status = max((f["status"] for f in items), key=order.index, default="skip")
    return {
        "id": DOCTOR_CHECK_ID,
        "status": status,
        "seen": "; ".join(f["seen"] for f in items),
        "fix": "; ".join(
            dict.fromkeys(
                f"{f['cause']}. Fix: {f['fix']}" if f["cause"] else f["fix"]
                for f in items
                if f["fix"] and f["status"] in ("warn", "fail")
            )
        ),
        "details": {"nccl_env": rep["nccl_env"], "pairs": rep["pairs"], "findings": items},
    }


# -- the host and the CLI -----------------------------------------------------------


def run_nvidia_smi(*args: str) -> str:
    """nvidia-smi's output for ``args``; a named error when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        raise _err(
            "unavailable", "nvidia-smi is not installed: load the driver first (oldgpu doctor)"
        )
    try:
        proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise _err("unavailable", f"nvidia-smi {' '.join(args)}: {exc}") from exc
    if proc.returncode != 0:
        first = ((proc.stdout + proc.stderr).strip().splitlines() or [""])[0]
        raise _err("unavailable", f"nvidia-smi {' '.join(args)} exited {proc.returncode}: {first}")
    return proc.stdout


def read_host() -> Topology:
    """This host's topology, from nvidia-smi (a named error without a driver)."""
    topo_text = run_nvidia_smi("topo", "-m")
    try:
        p2p_text: str | None = run_nvidia_smi("topo", "-p2p", "r")
    except EngineError:
        p2p_text = None  # a driver without -p2p: P2P counts as unknown, so disabled
    return parse(topo_text, p2p_text)


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise _err("input-unreadable", f"{what} {path}: {exc.strerror}") from exc


def from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``report`` from the flags: recorded files, else the tools and /sys."""
    if args.topo_file:
        topo_text = _read(args.topo_file, "--topo-file")
        p2p_text = _read(args.p2p_file, "--p2p-file") if args.p2p_file else None
        topo = parse(topo_text, p2p_text)
    elif args.p2p_file:
        raise _err("input-missing", "--p2p-file needs --topo-file (the link matrix) as well")
    else:
        topo = read_host()
    gpus = parse_gpus(args.gpus) if args.gpus else None
    if args.ib_file:
        ib = ib_devices_from_text(_read(args.ib_file, "--ib-file"), "--ib-file")
        source = args.ib_file
    else:
        ib, source = ib_devices(args.ib_dir), args.ib_dir
    return report(topo, gpus, ib, source)


def _text(rep: Mapping[str, Any]) -> str:
    lines = [f"GPUs {rep['gpus']} of {rep['host_gpus']}"]
    for p in rep["pairs"]:
        a, b = p["gpus"]
        p2p = p["p2p_read"] or "?"
        lines.append(f"  {a}-{b}: {p['link']} ({p['link_meaning']}), P2P read {p2p}")
    env = " ".join(f"{k}={v}" for k, v in rep["nccl_env"].items()) or "(NCCL defaults)"
    lines.append(f"NCCL: {env}")
    for f in rep["findings"]:
        lines.append(f"{f['status']}: {f['seen']}")
        if f["status"] != "ok" and f["cause"]:
            lines.append(f"  cause: {f['cause']}")
        if f["fix"]:
            lines.append(f"  fix: {f['fix']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> Result:
    rep = from_args(args)
    return Result(payload=rep, text=_text(rep))


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = "how the GPUs are wired, and the NCCL settings a job on them needs"
    parser = subcommand.add(
        subparsers, common, "topology", run, __doc__, help=summary, whole_doc=True
    )
    parser.add_argument("--topo-file", metavar="FILE", help="output of nvidia-smi topo -m")
    parser.add_argument("--p2p-file", metavar="FILE", help="output of nvidia-smi topo -p2p r")
    parser.add_argument("--gpus", metavar="0,1,...", help="the job's GPUs (default: all)")
    ib = parser.add_mutually_exclusive_group()
    ib.add_argument(
        "--ib-file", metavar="FILE", help="recorded `ls -1 /sys/class/infiniband` (empty: none)"
    )
    ib.add_argument("--ib-dir", metavar="DIR", default=IB_DIR, help=f"default {IB_DIR}")
