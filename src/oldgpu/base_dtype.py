"""``oldgpu base-dtype MODEL_DIR``: how many weights of a checkpoint each 16-bit storage
of a LoRA job's frozen base (its ``base_dtype``) would change.

A P40 computes in fp32 either way; the question is only what storing the base at 16
bits rounds away. bf16 has fp32's range and 8 significant bits; fp16 has 11 bits but
the range 2**-24 .. 65504, with fewer bits below 2**-14 (its subnormals). So a bf16
checkpoint (Qwen's and Llama's are) is stored by bf16 bit for bit, while fp16 changes
each weight that is too small for its bits or too large for it. This reads the
checkpoint's safetensors files (each tensor at its stored dtype, round-tripped through
the 16-bit one) and counts, per format: weights changed, turned to 0, turned infinite,
and the largest relative change. The engine's choice (bf16; plan/recipes.py) stands on
these counts.
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path
from typing import Any

from oldgpu import subcommand
from oldgpu.output import EngineError, Result

REQUIRES = ("numpy",)
FORMATS = ("bf16", "fp16")
# safetensors' dtype names this reads (a checkpoint's floating tensors).
FLOAT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header (tensor name -> dtype, shape, offsets) and where data starts."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than a header")
            (size,) = struct.unpack("<Q", raw)
            if size > HEADER_LIMIT:
                raise ValueError(f"header of {size} bytes")
            return json.loads(f.read(size)), 8 + size
    except (OSError, ValueError) as exc:
        raise EngineError("base-dtype-checkpoint-unreadable", f"{path}: {exc}") from None


def _as_fp32(np: Any, data: bytes, dtype: str) -> Any:
    if dtype == "F32":
        return np.frombuffer(data, dtype="<f4")
    if dtype == "F16":
        return np.frombuffer(data, dtype="<f2").astype(np.float32)
    bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16  # bf16: fp32's top half
    return bits.view(np.float32)


def _round_trip(np: Any, x: Any, fmt: str) -> Any:
    """``x`` (fp32) stored as ``fmt`` and read back as fp32 (round to nearest even)."""
    if fmt == "fp16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    out = (rounded & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, out)


def count(paths: list[Path]) -> dict[str, Any]:
    """Per format: weights changed, to zero, to infinity, the largest relative change."""
    import numpy as np

    totals = {f: {"changed": 0, "to_zero": 0, "to_inf": 0, "max_rel_change": 0.0} for f in FORMATS}
    stored: dict[str, int] = {}
    weights = 0
    for path in paths:
        header, start = _header(path)
        with path.open("rb") as f:
            for name, info in header.items():
                if name == "__metadata__" or info.get("dtype") not in FLOAT_DTYPES:
                    continue
                begin, end = info["data_offsets"]
                f.seek(start + begin)
                x = _as_fp32(np, f.read(end - begin), info["dtype"])
                weights += x.size
                stored[info["dtype"]] = stored.get(info["dtype"], 0) + x.size
                finite = np.isfinite(x)
                for fmt in FORMATS:
                    back = _round_trip(np, x, fmt)
                    t = totals[fmt]
                    diff = (back != x) & finite
                    t["changed"] += int(diff.sum())
                    t["to_zero"] += int(((back == 0) & (x != 0)).sum())
                    t["to_inf"] += int((np.isinf(back) & finite).sum())
                    nonzero = finite & (x != 0) & ~np.isinf(back)
                    if nonzero.any():
                        rel = np.abs(back[nonzero] - x[nonzero]) / np.abs(x[nonzero])
                        t["max_rel_change"] = max(t["max_rel_change"], float(rel.max()))
    for t in totals.values():
        t["share_changed"] = t["changed"] / weights if weights else 0.0
    return {"weights": weights, "stored": stored, "formats": totals}


def _files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not model_dir.is_dir() or not files:
        raise EngineError(
            "base-dtype-no-safetensors",
            f"{model_dir}: no *.safetensors files (a Hugging Face model directory)",
        )
    return files


def run(args: argparse.Namespace) -> Result:
    doc = {"model": str(args.model_dir), **count(_files(args.model_dir))}
    stored = ", ".join(f"{n:,} {d}" for d, n in sorted(doc["stored"].items()))
    lines = [f"{args.model_dir}: {doc['weights']:,} weights ({stored})"]
    for fmt, t in doc["formats"].items():
        lines.append(
            f"  stored as {fmt}: {t['changed']:,} change ({100 * t['share_changed']:.4f}%), "
            f"{t['to_zero']:,} to 0, {t['to_inf']:,} to inf, largest relative change "
            f"{t['max_rel_change']:.3g}"
        )
    return Result(doc, "\n".join(lines))


def add_parser(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    summary = "count the weights a 16-bit LoRA base (bf16, fp16) would change in a checkpoint"
    parser = subcommand.add(subparsers, common, "base-dtype", run, __doc__, help=summary)
    parser.add_argument("model_dir", type=Path, help="a model directory with *.safetensors")
