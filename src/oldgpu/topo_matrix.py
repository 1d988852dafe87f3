"""nvidia-smi's two topology matrices, read: ``topo -m`` and ``topo -p2p r``.

Both print a tab-separated matrix under a header line of ``GPU0 .. GPUn``
(underlined with ANSI escapes on a terminal), then a legend. ``topo -m`` adds
NIC rows and columns and the CPU/NUMA affinity columns (drivers from ~525 an
empty cell before ``GPU NUMA ID``); ``topo -p2p r`` rows start with a space and
end with a tab. Malformed input is a named error, never a traceback.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from oldgpu.output import EngineError

# What each link code means, in the words a P40 owner needs; nvidia-smi's own
# legend (read from the text) explains codes this table lacks.
LINKS = {
    "X": "the GPU itself",
    "PIX": "same PCIe switch (at most one bridge between them)",
    "PXB": "several PCIe switches, below one host bridge (no CPU in the path)",
    "PHB": "across the PCIe host bridge (the CPU's root complex)",
    "NODE": "across host bridges within one NUMA node (one CPU socket)",
    "SYS": "across CPU sockets (QPI/UPI or Infinity Fabric between NUMA nodes)",
    "SOC": "across CPU sockets (older drivers' name for SYS)",
}
P2P_CODES = {
    "X": "the GPU itself",
    "OK": "P2P works",
    "CNS": "chipset not supported",
    "GNS": "GPU not supported",
    "TNS": "topology not supported",
    "NS": "not supported",
    "DR": "disabled by regkey",
    "U": "unknown",
}
AFFINITY_HEADERS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
AFFINITY_KEYS = dict(zip(AFFINITY_HEADERS, ("cpu", "numa", "gpu_numa_id"), strict=True))

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TOKEN = re.compile(r"^[A-Z][A-Z0-9#]{0,7}$")
NVLINK = re.compile(r"^NV[0-9]+$")
_GPU = re.compile(r"^GPU([0-9]+)$")
_LEGEND = re.compile(r"^\s*([A-Z][A-Z0-9#]{0,7})\s+=\s+(.+?)\s*$")
_NIC_LEGEND = re.compile(r"^\s*(NIC\d+):\s*(\S+)\s*$")
_SMI_FAILURES = ("no devices were found", "has failed", "couldn't communicate", "not found")


def _err(name: str, message: str) -> EngineError:
    return EngineError(f"topology-{name}", message)


@dataclass(frozen=True)
class Topology:
    """The GPUs of one host and what lies between each pair."""

    gpus: tuple[int, ...]
    links: dict[tuple[int, int], str]
    p2p: dict[tuple[int, int], str] | None = None
    affinity: dict[int, dict[str, str]] = field(default_factory=dict)
    nics: dict[str, str] = field(default_factory=dict)
    legend: dict[str, str] = field(default_factory=dict)

    def link(self, a: int, b: int) -> str:
        return self.links[(a, b)]

    def p2p_read(self, a: int, b: int) -> str | None:
        """The P2P read status of a pair, the worse direction; None when unknown."""
        if self.p2p is None:
            return None
        there, back = self.p2p[(a, b)], self.p2p[(b, a)]
        return there if there != "OK" else back

    def to_dict(self) -> dict[str, Any]:
        def grid(cells: Mapping[tuple[int, int], str]) -> dict[str, dict[str, str]]:
            return {f"GPU{a}": {f"GPU{b}": cells[(a, b)] for b in self.gpus} for a in self.gpus}

        return {
            "gpus": list(self.gpus),
            "matrix": grid(self.links),
            "p2p_read": None if self.p2p is None else grid(self.p2p),
            "affinity": {f"GPU{g}": dict(v) for g, v in self.affinity.items()},
            "nics": dict(self.nics),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        """The inverse of ``to_dict``; takes ``oldgpu topology --json``'s document too
        (whose ``gpus`` are the job's, ``host_gpus`` the matrix's)."""
        gpus = tuple(int(g) for g in data.get("host_gpus", data["gpus"]))

        def cells(grid: Mapping[str, Mapping[str, str]]) -> dict[tuple[int, int], str]:
            return {(a, b): grid[f"GPU{a}"][f"GPU{b}"] for a in gpus for b in gpus}

        p2p = data.get("p2p_read")
        return cls(
            gpus=gpus,
            links=cells(data["matrix"]),
            p2p=None if p2p is None else cells(p2p),
            affinity={int(k[3:]): dict(v) for k, v in (data.get("affinity") or {}).items()},
            nics=dict(data.get("nics") or {}),
        )


# -- parsing ----------------------------------------------------------------------


def decode(data: bytes | str, what: str) -> str:
    """Text of a recorded output; binary or empty input is a named error."""
    if isinstance(data, bytes):
        if b"\x00" in data:
            raise _err(
                "input-binary", f"{what} is binary (it has NUL bytes), not nvidia-smi's text"
            )
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _err("input-binary", f"{what} is not UTF-8 text: {exc.reason}") from exc
    if "\x00" in data:
        raise _err("input-binary", f"{what} has NUL characters, not nvidia-smi's text")
    if not data.strip():
        raise _err("input-empty", f"{what} is empty")
    return _ANSI.sub("", data)


def _cells(line: str) -> list[str]:
    """A line's cells: tab-separated as nvidia-smi prints them, or a pasted copy
    whose tabs became spaces (its multi-word headers kept whole)."""
    if "\t" in line:
        return [c.strip() for c in line.rstrip("\r\n").split("\t")]
    for header in AFFINITY_HEADERS:
        line = line.replace(header, header.replace(" ", "\x01"))
    return [c.replace("\x01", " ") for c in line.split()]


def _is_header(cells: list[str]) -> bool:
    rest = cells[1:] if cells and cells[0] == "" else cells
    rest = [c for c in rest if c]
    return bool(rest) and rest[0] == "GPU0" and (len(rest) == 1 or rest[1] != "X")


def _matrix(text: str, what: str) -> tuple[list[str], list[str], list[list[str]], list[str]]:
    """(device labels, other column headers, rows of cells, lines after the block)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _is_header(_cells(line))), None)
    if start is None:
        lowered = text.lower()
        failure = next((m for m in _SMI_FAILURES if m in lowered), None)
        if failure:
            first = next((ln for ln in lines if failure in ln.lower()), failure).strip()
            raise _err("nvidia-smi-failed", f"{what} is nvidia-smi's error, not a matrix: {first}")
        first = next((line for line in lines if line.strip()), "")
        if "," in first and "\t" not in first:
            raise _err(
                "no-matrix",
                f"{what} looks like CSV ({first.strip()[:60]!r}), not the matrix of "
                "nvidia-smi topo; record it with `nvidia-smi topo -m` / `topo -p2p r`",
            )
        raise _err("no-matrix", f"{what} has no header line with GPU0 (not nvidia-smi topo's)")
    header = [c for c in _cells(lines[start]) if c]
    split = next((i for i, c in enumerate(header) if c in AFFINITY_HEADERS), len(header))
    labels, others = header[:split], header[split:]
    if len(set(labels)) != len(labels):
        raise _err("not-square", f"{what}: a device appears twice in the header: {labels}")
    rows: list[list[str]] = []
    end = len(lines)
    for i in range(start + 1, len(lines)):
        cells = _cells(lines[i])
        if not any(cells) or cells[0].startswith("Legend"):
            end = i
            break
        rows.append(cells)
    return labels, others, rows, lines[end:]


def _legend(lines: Sequence[str]) -> tuple[dict[str, str], dict[str, str]]:
    legend, nics = {}, {}
    for line in lines:
        nic = _NIC_LEGEND.match(line)
        if nic:
            nics[nic.group(1)] = nic.group(2)
            continue
        entry = _LEGEND.match(line)
        if entry:
            legend[entry.group(1)] = entry.group(2)
    return legend, nics


def _square(
    labels: list[str], rows: list[list[str]], what: str
) -> dict[str, tuple[list[str], list[str]]]:
    """Each row's device cells and the cells after them, checked square."""
    by_label: dict[str, tuple[list[str], list[str]]] = {}
    n = len(labels)
    for cells in rows:
        label = cells[0]
        if label not in labels:
            raise _err(
                "not-square", f"{what}: row {label or cells!r} is not a column of the header"
            )
        if label in by_label:
            raise _err("not-square", f"{what}: row {label} appears twice")
        body = cells[1:]
        if len(body) < n or any(not c for c in body[:n]):
            raise _err(
                "not-square",
                f"{what}: row {label} has {len([c for c in body if c])} cells for {n} columns",
            )
        by_label[label] = (body[:n], body[n:])
    missing = [label for label in labels if label not in by_label]
    if missing:
        raise _err(
            "not-square", f"{what}: no row for {', '.join(missing)} ({len(rows)} rows, {n} columns)"
        )
    for label in labels:
        for j, cell in enumerate(by_label[label][0]):
            if not _TOKEN.match(cell):
                raise _err(
                    "bad-cell", f"{what}: {label}/{labels[j]} is {cell!r}, not a status code"
                )
            if (labels[j] == label) != (cell == "X"):
                raise _err(
                    "bad-cell",
                    f"{what}: {label}/{labels[j]} is {cell!r} (X marks the diagonal only)",
                )
    return by_label


def _gpu_index(label: str) -> int | None:
    match = _GPU.match(label)
    return int(match.group(1)) if match else None


def _index(label: str) -> int:
    index = _gpu_index(label)
    if index is None:
        raise ValueError(f"{label} is not a GPU label")
    return index


def parse_links(text: str, what: str = "the topology (nvidia-smi topo -m)") -> Topology:
    """The link matrix of ``nvidia-smi topo -m``; NIC rows and columns kept aside."""
    labels, others, rows, rest = _matrix(text, what)
    by_label = _square(labels, rows, what)
    legend, nic_names = _legend(rest)
    gpu_labels = [lb for lb in labels if _gpu_index(lb) is not None]
    known = set(LINKS) | set(legend)
    links: dict[tuple[int, int], str] = {}
    for a in gpu_labels:
        for j, cell in enumerate(by_label[a][0]):
            b = labels[j]
            if cell in P2P_CODES and cell != "X":
                raise _err(
                    "wrong-matrix",
                    f"{what}: {a}/{b} is {cell!r}, a P2P status: this is `nvidia-smi topo -p2p`'s "
                    "output, not `topo -m`'s",
                )
            if cell not in known and not NVLINK.match(cell):
                raise _err("bad-cell", f"{what}: {a}/{b} is {cell!r}, not a link type")
            if _gpu_index(b) is not None:
                links[(_index(a), _index(b))] = cell
    # Old drivers print only CPU Affinity, new ones an empty cell before GPU NUMA ID;
    # a column a later driver adds is kept under its own name.
    affinity = {
        _index(a): {
            AFFINITY_KEYS.get(h, h): v
            for h, v in zip(others, [c for c in by_label[a][1] if c], strict=False)
        }
        for a in gpu_labels
    }
    nics = {lb: nic_names.get(lb, lb) for lb in labels if _gpu_index(lb) is None}
    return Topology(
        gpus=tuple(_index(lb) for lb in gpu_labels),
        links=links,
        affinity=affinity,
        nics=nics,
        legend={k: v for k, v in legend.items() if k not in P2P_CODES or k == "X"},
    )


def parse_p2p(
    text: str, what: str = "the P2P matrix (nvidia-smi topo -p2p r)"
) -> dict[tuple[int, int], str]:
    """Status codes of ``nvidia-smi topo -p2p r``, keyed by (from, to) GPU index."""
    labels, others, rows, rest = _matrix(text, what)
    if others or any(_gpu_index(lb) is None for lb in labels):
        raise _err(
            "wrong-matrix",
            f"{what} has columns {others or labels}: this is `nvidia-smi topo -m`'s output, "
            "not `topo -p2p r`'s",
        )
    by_label = _square(labels, rows, what)
    legend, _ = _legend(rest)
    known = set(P2P_CODES) | set(legend)
    statuses = {}
    for a in labels:
        cells, extra = by_label[a]
        if any(extra):
            raise _err(
                "not-square", f"{what}: row {a} has more cells than the header's {len(labels)}"
            )
        for j, cell in enumerate(cells):
            if (cell in LINKS and cell != "X") or NVLINK.match(cell):
                raise _err(
                    "wrong-matrix",
                    f"{what}: {a}/{labels[j]} is the link type {cell!r}: this is "
                    "`nvidia-smi topo -m`'s output, not `topo -p2p r`'s",
                )
            if cell not in known:
                raise _err("bad-cell", f"{what}: {a}/{labels[j]} is {cell!r}, not a P2P status")
            statuses[(_index(a), _index(labels[j]))] = cell
    return statuses


def parse(topo_text: str | bytes, p2p_text: str | bytes | None = None) -> Topology:
    """A host's topology from the two recorded outputs (P2P may be missing)."""
    topo = parse_links(decode(topo_text, "the topology (nvidia-smi topo -m)"))
    if p2p_text is None:
        return topo
    p2p = parse_p2p(decode(p2p_text, "the P2P matrix (nvidia-smi topo -p2p r)"))
    p2p_gpus = sorted({a for a, _ in p2p})
    if p2p_gpus != sorted(topo.gpus):
        raise _err(
            "p2p-mismatch",
            f"the P2P matrix has GPUs {p2p_gpus}, the link matrix {list(topo.gpus)}: "
            "record both on the same host",
        )
    return Topology(topo.gpus, topo.links, p2p, topo.affinity, topo.nics, topo.legend)
