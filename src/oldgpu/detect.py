"""``oldgpu detect``: the NVIDIA GPUs of this host, with or without a driver.

nvidia-smi answers when the driver is loaded; ``lspci`` plus the system PCI ID
database answers when it is not (a fresh host before the driver role ran, or
a card the loaded driver branch no longer supports). Architecture and compute
capability come from the chip name (``GP102GL`` -> pascal 6.1), which the PCI
ID database carries for every NVIDIA device, so no device IDs are copied here.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import re
import shutil
import subprocess
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from oldgpu import subcommand
from oldgpu.output import EngineError, Result

NVIDIA_VENDOR = "10de"

# Where Debian/Ubuntu (pci.ids package), Fedora/Arch (hwdata) and others keep the db.
PCI_IDS_PATHS = (
    "/usr/share/misc/pci.ids",
    "/usr/share/hwdata/pci.ids",
    "/usr/share/pci.ids",
    "/usr/share/misc/pci.ids.gz",
)

NVIDIA_SMI_FIELDS = (
    "index",
    "name",
    "pci.bus_id",
    "pci.device_id",
    "memory.total",
    "compute_cap",
    "driver_version",
)
# Drivers before 510 (470 is Kepler's last branch) do not know compute_cap.
NVIDIA_SMI_FIELDS_LEGACY = tuple(f for f in NVIDIA_SMI_FIELDS if f != "compute_cap")

# PCI classes a GPU function can have; the HDMI audio (0403) and USB-C (0c03)
# functions of the same card are not GPUs. 0380 is "Display controller", which
# some NVIDIA parts (e.g. Optimus laptops) report.
GPU_CLASSES = ("0300", "0302", "0380")

# Chip-name prefix -> (architecture, compute capability); the longest prefix wins.
# Jetson/Tegra parts (GK20A, GM20B, GP10B, GV10B, GA10B) are listed so that
# they are not mistaken for their discrete siblings.
CHIP_FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("GK10", "kepler", "3.0"),
    ("GK20A", "kepler", "3.2"),
    ("GK110", "kepler", "3.5"),
    ("GK180", "kepler", "3.5"),
    ("GK208", "kepler", "3.5"),
    ("GK210", "kepler", "3.7"),
    ("GM10", "maxwell", "5.0"),
    ("GM20", "maxwell", "5.2"),
    ("GM20B", "maxwell", "5.3"),
    ("GP100", "pascal", "6.0"),
    ("GP10", "pascal", "6.1"),
    ("GP10B", "pascal", "6.2"),
    ("GV100", "volta", "7.0"),
    ("GV10B", "volta", "7.2"),
    ("TU", "turing", "7.5"),
    ("GA100", "ampere", "8.0"),
    ("GA10", "ampere", "8.6"),
    ("GA10B", "ampere", "8.7"),
    ("AD", "ada", "8.9"),
    ("GH100", "hopper", "9.0"),
    ("GB100", "blackwell", "10.0"),
    ("GB102", "blackwell", "10.0"),
    ("GB20", "blackwell", "12.0"),
)

# Compute-capability major(.minor) -> architecture, for when the chip is unknown
# but nvidia-smi reports compute_cap. Exact "X.Y" entries win over "X".
_CC_ARCH = {
    "3": "kepler",
    "5": "maxwell",
    "6": "pascal",
    "7": "volta",
    "7.5": "turing",
    "8": "ampere",
    "8.9": "ada",
    "9": "hopper",
    "10": "blackwell",
    "12": "blackwell",
}

# Board memory by marketing model (lower case), for hosts without a driver;
# names that carry a size ("A100 PCIe 40GB") are read from the name instead.
MODEL_MEMORY_MIB = {
    "tesla k80": 12288,  # per GK210, two per board
    "tesla m10": 8192,  # per GM107, four per board
    "tesla m40": 12288,
    "tesla m60": 8192,  # per GM204, two per board
    "tesla p4": 8192,
    "tesla p40": 24576,
    "quadro p6000": 24576,
    "titan xp": 12288,
    "titan x": 12288,
    "geforce gtx 1080 ti": 11264,
    "geforce gtx 1080": 8192,
    "geforce gtx 1070 ti": 8192,
    "geforce gtx 1070": 8192,
    "titan v": 12288,
    "tesla t4": 15360,
    "geforce rtx 2080 ti": 11264,
    "quadro rtx 8000": 49152,
    "geforce rtx 3090": 24576,
    "rtx a6000": 49152,
    "geforce rtx 4090": 24576,
    "h100 pcie": 81920,
}

_GB_HINT = re.compile(r"(\d+)\s*GB\b", re.IGNORECASE)
_CHIP = re.compile(r"^([A-Z]{2}\d{2,3}[A-Z0-9]*)")
_LSPCI_LINE = re.compile(
    r"^(?P<bus>(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+"
    r"(?P<class_name>.*?)\s*\[(?P<class>[0-9a-fA-F]{4})\]:\s+"
    r"(?P<text>.*?)\s*\[(?P<vendor>[0-9a-fA-F]{4}):(?P<device>[0-9a-fA-F]{4})\]"
)
_NVIDIA_SMI_FAILURES = (
    "no devices were found",
    "has failed",
    "not a valid field",
    "couldn't communicate",
)


@dataclass
class Gpu:
    index: int | None
    name: str
    chip: str | None
    pci_id: str | None
    bus_id: str | None
    architecture: str | None
    compute_capability: str | None
    memory_mib: int | None
    source: str
    driver_version: str | None = None

    @property
    def compute_capability_tuple(self) -> tuple[int, int] | None:
        return cc_tuple(self.compute_capability) if self.compute_capability else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        cc = self.compute_capability_tuple
        data["compute_capability_tuple"] = list(cc) if cc else None
        return data


class NvidiaSmiError(ValueError):
    """nvidia-smi's output is not the GPU table (an error message, a missing field)."""


class NvidiaSmiMalformed(NvidiaSmiError):
    """Not nvidia-smi's error message either: a header, another table, a broken value."""


# -- the tables -----------------------------------------------------------------


def cc_tuple(cc: str) -> tuple[int, int]:
    """``"6.1"`` -> ``(6, 1)``; raises ValueError on anything else."""
    match = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", cc)
    if not match:
        raise ValueError(f"not a compute capability: {cc!r}")
    return int(match.group(1)), int(match.group(2))


def chip_info(chip: str | None) -> tuple[str, str] | None:
    """Architecture and compute capability of a chip name such as ``GP102GL``."""
    if not chip:
        return None
    chip = chip.upper()
    best: tuple[str, str, str] | None = None
    for prefix, arch, cc in CHIP_FAMILIES:
        if chip.startswith(prefix) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, arch, cc)
    return (best[1], best[2]) if best else None


def arch_for_cc(cc: str) -> str | None:
    """The architecture of a compute capability (``"7.5"`` -> turing), None if unknown."""
    major, minor = cc_tuple(cc)
    return _CC_ARCH.get(f"{major}.{minor}") or _CC_ARCH.get(str(major))


def split_name(name: str) -> tuple[str | None, str]:
    """``"GP102GL [Tesla P40]"`` -> ``("GP102GL", "Tesla P40")``."""
    name = name.strip()
    match = _CHIP.match(name)
    chip = match.group(1) if match else None
    bracket = re.search(r"\[([^\]]+)\]", name)
    if bracket:
        return chip, bracket.group(1).strip()
    if chip:
        rest = name[len(chip) :].strip()
        return chip, rest or name
    return None, name


def memory_for_model(name: str) -> int | None:
    """Board memory in MiB from a size in the name or the per-model table."""
    hint = _GB_HINT.search(name)
    if hint:
        return int(hint.group(1)) * 1024
    key = re.sub(r"^nvidia\s+", "", name.strip().lower())
    return MODEL_MEMORY_MIB.get(key)


# -- the PCI ID database ----------------------------------------------------------


def load_pci_ids(path: str | Path) -> dict[tuple[str, str], str]:
    """Device names of a pci.ids file, keyed by ``(vendor, device)`` in lower-case hex."""
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    db: dict[tuple[str, str], str] = {}
    vendor: str | None = None
    for line in raw.decode("utf-8", errors="replace").splitlines():
        if not line or line.startswith("#"):
            continue
        if not line.startswith("\t"):
            # A vendor line; the class section at the end ("C 03 ...") ends devices.
            match = re.match(r"^([0-9a-fA-F]{4})\s+", line)
            vendor = match.group(1).lower() if match else None
            continue
        if vendor is None or line.startswith("\t\t"):
            continue  # subsystems, or a class section entry
        match = re.match(r"^\t([0-9a-fA-F]{4})\s+(.*)$", line)
        if match:
            db[(vendor, match.group(1).lower())] = match.group(2).strip()
    return db


def find_pci_ids(paths: Iterable[str] = PCI_IDS_PATHS) -> Path | None:
    """The first system pci.ids that exists."""
    for candidate in paths:
        path = Path(candidate)
        if path.is_file():
            return path
    return None


# -- parsing ----------------------------------------------------------------------


_BUS_ID = re.compile(r"^(?:([0-9a-f]{1,8}):)?([0-9a-f]{2}:[0-9a-f]{2}\.[0-7])$")


def _normalise_bus_id(bus_id: str) -> str:
    """nvidia-smi's ``00000000:03:00.0`` and lspci's ``0000:03:00.0`` -> the latter."""
    bus_id = bus_id.strip().lower()
    match = _BUS_ID.match(bus_id)
    if not match:
        raise ValueError(f"{bus_id!r} is not a PCI bus id (DOMAIN:BUS:DEVICE.FUNCTION)")
    domain, rest = match.groups()
    return f"{int(domain or '0', 16):04x}:{rest}"


def _na(value: str) -> bool:
    return not value or value.startswith("[") or value.upper() in {"N/A", "NA"}


def _describe(
    pci_db: Mapping[tuple[str, str], str], vendor: str, device: str, fallback: str
) -> tuple[str | None, str]:
    """Chip and model of a device: the db's name first, else the text a tool printed."""
    db_name = pci_db.get((vendor, device))
    return split_name(db_name if db_name else fallback)


def parse_nvidia_smi(text: str, pci_db: Mapping[tuple[str, str], str] | None = None) -> list[Gpu]:
    """GPUs from ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits``.

    Takes the full field list or the one without ``compute_cap`` (drivers < 510).
    Raises NvidiaSmiError when the text is an error message instead.
    """
    pci_db = pci_db or {}
    gpus: list[Gpu] = []
    for lineno, row in enumerate(csv.reader(text.splitlines(), skipinitialspace=True), 1):
        if not row or not "".join(row).strip():
            continue
        if any(msg in ",".join(row).lower() for msg in _NVIDIA_SMI_FAILURES):
            raise NvidiaSmiError(",".join(row).strip())
        if len(row) == len(NVIDIA_SMI_FIELDS):
            fields = NVIDIA_SMI_FIELDS
        elif len(row) == len(NVIDIA_SMI_FIELDS_LEGACY):
            fields = NVIDIA_SMI_FIELDS_LEGACY
        else:
            raise NvidiaSmiMalformed(
                f"line {lineno}: expected {len(NVIDIA_SMI_FIELDS)} fields: {row}"
            )
        values = {f: v.strip() for f, v in zip(fields, row, strict=True)}
        try:
            gpus.append(_smi_gpu(values, pci_db))
        except (ValueError, OverflowError) as exc:
            raise NvidiaSmiMalformed(f"line {lineno}: {exc}") from exc
    return gpus


def _smi_gpu(values: Mapping[str, str], pci_db: Mapping[tuple[str, str], str]) -> Gpu:
    """One row of nvidia-smi's table; ValueError when a value is not its kind."""
    index = int(values["index"])
    device_id = int(values["pci.device_id"], 16)
    if index < 0 or not 0 <= device_id <= 0xFFFFFFFF:
        raise ValueError(f"index {index} or device id {values['pci.device_id']} out of range")
    # pci.device_id is device << 16 | vendor, e.g. 0x1B3810DE.
    vendor, device = f"{device_id & 0xFFFF:04x}", f"{device_id >> 16:04x}"
    name = values["name"]
    chip, _model = _describe(pci_db, vendor, device, "")
    from_chip = chip_info(chip)
    cc = values.get("compute_cap", "")
    cc = (from_chip[1] if from_chip else "") if _na(cc) else "{}.{}".format(*cc_tuple(cc))
    arch = from_chip[0] if from_chip else None
    if cc and (arch is None or (from_chip and from_chip[1] != cc)):
        # The driver knows the card better than a name table: trust its CC.
        arch = arch_for_cc(cc) or arch
    memory = values["memory.total"]
    memory_mib = int(float(memory)) if not _na(memory) else memory_for_model(name)
    if memory_mib is not None and memory_mib < 0:
        raise ValueError(f"memory.total {memory!r} is negative")
    return Gpu(
        index=index,
        name=name,
        chip=chip,
        pci_id=f"{vendor}:{device}",
        bus_id=_normalise_bus_id(values["pci.bus_id"]),
        architecture=arch,
        compute_capability=cc or None,
        memory_mib=memory_mib,
        source="nvidia-smi",
        driver_version=None if _na(values["driver_version"]) else values["driver_version"],
    )


def parse_lspci(text: str, pci_db: Mapping[tuple[str, str], str] | None = None) -> list[Gpu]:
    """NVIDIA GPU functions from ``lspci -nn -D``, numbered in bus order like nvidia-smi."""
    pci_db = pci_db or {}
    found: list[tuple[str, str, str, str]] = []
    for line in text.splitlines():
        match = _LSPCI_LINE.match(line.strip())
        if not match or match.group("vendor").lower() != NVIDIA_VENDOR:
            continue
        if match.group("class") not in GPU_CLASSES:
            continue
        # lspci's own text, less the vendor name; "Device" alone means it had no name.
        text_name = re.sub(r"^NVIDIA Corporation\s*", "", match.group("text")).strip()
        found.append(
            (
                _normalise_bus_id(match.group("bus")),
                match.group("vendor").lower(),
                match.group("device").lower(),
                text_name,
            )
        )
    gpus = []
    for index, (bus_id, vendor, device, text_name) in enumerate(sorted(found)):
        chip, model = _describe(pci_db, vendor, device, text_name)
        if model in {"", "Device"} or re.fullmatch(r"Device [0-9a-fA-F]{4}", model):
            model = f"NVIDIA device {vendor}:{device}"
        info = chip_info(chip)
        gpus.append(
            Gpu(
                index=index,
                name=model,
                chip=chip,
                pci_id=f"{vendor}:{device}",
                bus_id=bus_id,
                architecture=info[0] if info else None,
                compute_capability=info[1] if info else None,
                memory_mib=memory_for_model(model),
                source="lspci",
            )
        )
    return gpus


def merge(smi: Sequence[Gpu], pci: Sequence[Gpu]) -> list[Gpu]:
    """nvidia-smi's GPUs plus the ones only lspci sees (not driven by the loaded branch)."""
    seen = {g.bus_id for g in smi}
    extra = [
        Gpu(**{**asdict(g), "index": None}) for g in pci if g.bus_id not in seen
    ]  # no CUDA index: the driver does not drive it
    return sorted([*smi, *extra], key=lambda g: g.bus_id or "")


# -- running the tools ------------------------------------------------------------


def _run(argv: Sequence[str]) -> tuple[int, str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, proc.stdout + proc.stderr if proc.returncode else proc.stdout


def run_nvidia_smi() -> str | None:
    """nvidia-smi's GPU table, or None when it is missing or fails (no driver loaded)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    for fields in (NVIDIA_SMI_FIELDS, NVIDIA_SMI_FIELDS_LEGACY):
        rc, out = _run([exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
        if rc == 0:
            return out
    return None


def run_lspci() -> str | None:
    exe = shutil.which("lspci")
    if not exe:
        return None
    rc, out = _run([exe, "-nn", "-D"])
    return out if rc == 0 else None


def detect(
    nvidia_smi_text: str | None = None,
    lspci_text: str | None = None,
    pci_ids: str | Path | None = None,
    *,
    run_tools: bool = True,
) -> dict[str, Any]:
    """The host's GPUs and where each answer came from.

    Texts given replace running the tools; with ``run_tools=False`` a tool
    whose text is not given counts as missing (hermetic tests, recordings).
    """
    db_path = Path(pci_ids) if pci_ids else find_pci_ids()
    try:
        pci_db = load_pci_ids(db_path) if db_path else {}
    except (OSError, EOFError, zlib.error) as exc:
        raise EngineError("pci-ids-unreadable", f"{db_path}: {exc}") from exc
    recorded = nvidia_smi_text is not None
    if run_tools:
        nvidia_smi_text = nvidia_smi_text if nvidia_smi_text is not None else run_nvidia_smi()
        lspci_text = lspci_text if lspci_text is not None else run_lspci()

    smi: list[Gpu] = []
    smi_status = "missing"
    if nvidia_smi_text is not None:
        try:
            smi = parse_nvidia_smi(nvidia_smi_text, pci_db)
            smi_status = "ok"
        except NvidiaSmiMalformed as exc:
            if recorded:  # a file given: read as "no GPU", it would give the cpu profile
                raise EngineError(
                    "nvidia-smi-output-malformed",
                    f"not nvidia-smi's --format=csv,noheader,nounits table: {exc}",
                ) from exc
            smi_status = "failed"
        except NvidiaSmiError:
            smi_status = "failed"
    pci = parse_lspci(lspci_text, pci_db) if lspci_text is not None else []
    gpus = merge(smi, pci) if smi else pci
    return {
        "gpus": [g.to_dict() for g in gpus],
        "sources": {
            "nvidia-smi": smi_status,
            "lspci": "missing" if lspci_text is None else "ok",
            "pci_ids": str(db_path) if db_path else None,
        },
    }


# -- CLI --------------------------------------------------------------------------


def add_source_args(parser: argparse.ArgumentParser) -> None:
    """Flags that replace running nvidia-smi/lspci with recorded output."""
    group = parser.add_argument_group("recorded input (replaces running the tools)")
    group.add_argument(
        "--nvidia-smi-file",
        metavar="FILE",
        help="output of nvidia-smi --query-gpu=... --format=csv,noheader,nounits",
    )
    group.add_argument("--lspci-file", metavar="FILE", help="output of lspci -nn -D")
    group.add_argument("--pci-ids", metavar="FILE", help="PCI ID database (default: system's)")


def _read(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise EngineError("detect-input-unreadable", f"{path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise EngineError(
            "detect-input-not-text", f"{path}: not UTF-8 text ({exc.reason})"
        ) from exc
    if "\0" in text:
        raise EngineError("detect-input-not-text", f"{path}: binary data (a NUL byte), not text")
    return text


def detect_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``detect`` with the recorded-input flags; any file given stops all tool runs."""
    smi_file = getattr(args, "nvidia_smi_file", None)
    lspci_file = getattr(args, "lspci_file", None)
    pci_ids = getattr(args, "pci_ids", None)
    if pci_ids and not Path(pci_ids).is_file():
        raise EngineError("pci-ids-missing", f"{pci_ids} is not a file")
    return detect(
        _read(smi_file),
        _read(lspci_file),
        pci_ids,
        run_tools=smi_file is None and lspci_file is None,
    )


def _text(report: dict[str, Any]) -> str:
    gpus = report["gpus"]
    if not gpus:
        return "no NVIDIA GPU found"
    lines = []
    for g in gpus:
        index = "-" if g["index"] is None else g["index"]
        mem = f"{g['memory_mib']} MiB" if g["memory_mib"] else "memory unknown"
        lines.append(
            f"{index}: {g['name']} ({g['chip'] or 'chip unknown'}, {g['pci_id']}) at "
            f"{g['bus_id']}: {g['architecture'] or 'unknown architecture'} "
            f"cc {g['compute_capability'] or '?'}, {mem} [{g['source']}]"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> Result:
    report = detect_from_args(args)
    return Result(payload=report, text=_text(report))


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = "the NVIDIA GPUs of this host"
    parser = subcommand.add(
        subparsers, common, "detect", run, __doc__, help=summary, whole_doc=True
    )
    add_source_args(parser)
