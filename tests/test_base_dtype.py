"""``oldgpu base-dtype``: the weights a 16-bit base would change, counted exactly."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from oldgpu import cli

np = pytest.importorskip("numpy")


def write_safetensors(path: Path, tensors: dict[str, tuple[str, bytes, list[int]]]) -> None:
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, data, shape) in tensors.items():
        span = [offset, offset + len(data)]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": span}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def bf16_bytes(values: list[float]) -> bytes:
    bits = np.array(values, dtype=np.float32).view(np.uint32) >> 16  # exact: bf16 values
    return bits.astype("<u2").tobytes()


def run(capsys, *argv: str) -> tuple[int, dict]:
    code = cli.main(["base-dtype", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out or "{}")


def test_a_bf16_checkpoint_is_kept_by_bf16_and_changed_by_fp16(tmp_path: Path, capsys) -> None:
    values = [
        0.5,
        -1e-3,  # as bf16 rounded it: a normal number for both
        2.0**-20 + 2.0**-27,  # fp16 subnormal: 2**-27 is below its last bit
        2.0**-30,  # below fp16's smallest subnormal: 0
        1e6,  # above fp16's 65504: inf
        0.0,
    ]
    write_safetensors(tmp_path / "model.safetensors", {"w": ("BF16", bf16_bytes(values), [6])})
    (tmp_path / "config.json").write_text("{}")
    code, doc = run(capsys, str(tmp_path))
    assert code == 0
    assert doc["weights"] == 6 and doc["stored"] == {"BF16": 6}
    assert doc["formats"]["bf16"]["changed"] == 0
    fp16 = doc["formats"]["fp16"]
    assert (fp16["changed"], fp16["to_zero"], fp16["to_inf"]) == (3, 1, 1)


def test_an_fp32_checkpoint_is_rounded_by_both(tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(0, 0.02, 1000).astype("<f4")
    write_safetensors(tmp_path / "model.safetensors", {"w": ("F32", x.tobytes(), [1000])})
    code, doc = run(capsys, str(tmp_path))
    assert code == 0 and doc["stored"] == {"F32": 1000}
    bf16, fp16 = doc["formats"]["bf16"], doc["formats"]["fp16"]
    assert bf16["changed"] > 990 and fp16["changed"] > 990  # nearly every weight rounds
    assert bf16["max_rel_change"] <= 2.0**-8  # half of bf16's last bit
    assert fp16["max_rel_change"] < bf16["max_rel_change"]  # 3 more bits in its range


def test_no_checkpoint_is_a_named_error(tmp_path: Path, capsys) -> None:
    code = cli.main(["base-dtype", str(tmp_path), "--json"])
    out = capsys.readouterr()
    assert code == 2 and "base-dtype-no-safetensors" in out.err + out.out
    (tmp_path / "model.safetensors").write_bytes(b"\x01")
    code = cli.main(["base-dtype", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 2 and "base-dtype-checkpoint-unreadable" in out.err + out.out
