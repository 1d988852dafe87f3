"""``oldgpu data gsm8k``: GSM8K as published, turned into verl's parquet layout.

The rows are what verl's ``examples/data_preprocess/gsm8k.py`` writes (in verl's
repository, not its sdist; it loads the data set through ``datasets``, this reads the
published files directly):

- ``data_source``: ``"openai/gsm8k"``; it picks verl's gsm8k reward function.
- ``prompt``: ``[{"role": "user", "content": question + " " + INSTRUCTION}]``
- ``ability``: ``"math"``
- ``reward_model``: ``{"style": "rule", "ground_truth": <the number after "####">}``
- ``extra_info``: ``{"split", "index", "answer", "question"}`` (raw answer and question)

The input is GSM8K's own jsonl (one ``{"question": ..., "answer": ...}`` per line) or a
parquet file with those columns (the hub's copy). The output is written with pyarrow
alone, with the schema and ``datasets`` features verl's script's files have (struct
fields sorted, as ``datasets`` stores them); the same input gives byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from oldgpu import subcommand
from oldgpu.output import EngineError, Result

# The CLI re-runs a command under the training venv when these are missing here.
REQUIRES = ("pyarrow",)

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# verl's extract_solution: the first "#### <number>", commas dropped.
SOLUTION_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
SPLITS = ("train", "test")
PARQUET_MAGIC = b"PAR1"
MAX_LISTED = 10  # bad rows named in one error


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise EngineError(
            "python-package-missing",
            f"reading and writing parquet needs pyarrow ({exc}); run with the training "
            "venv's python",
        ) from exc
    return pa, pq


def extract_solution(answer: str) -> str | None:
    """The ground truth verl's gsm8k reward compares with, or None without ``#### N``."""
    found = SOLUTION_RE.search(answer)
    return found.group(1).replace(",", "") if found else None


def _value(dtype: str) -> dict[str, str]:
    return {"dtype": dtype, "_type": "Value"}


# The features ``datasets`` records in the file (schema metadata "huggingface"), so that
# ``datasets.load_dataset("parquet", ...)``, which verl's RLHFDataset uses, sees the same
# features as for the file verl's script writes.
HF_FEATURES = {
    "data_source": _value("string"),
    "prompt": [{"content": _value("string"), "role": _value("string")}],
    "ability": _value("string"),
    "reward_model": {"ground_truth": _value("string"), "style": _value("string")},
    "extra_info": {
        "answer": _value("string"),
        "index": _value("int64"),
        "question": _value("string"),
        "split": _value("string"),
    },
}


def schema() -> Any:
    """The arrow schema of verl's gsm8k parquet: ``datasets`` sorts struct fields by name."""
    pa, _ = _pyarrow()
    metadata = {"huggingface": json.dumps({"info": {"features": HF_FEATURES}})}
    return pa.schema(
        [
            ("data_source", pa.string()),
            (
                "prompt",
                pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())])),
            ),
            ("ability", pa.string()),
            (
                "reward_model",
                pa.struct([("ground_truth", pa.string()), ("style", pa.string())]),
            ),
            (
                "extra_info",
                pa.struct(
                    [
                        ("answer", pa.string()),
                        ("index", pa.int64()),
                        ("question", pa.string()),
                        ("split", pa.string()),
                    ]
                ),
            ),
        ],
        metadata=metadata,
    )


# --- reading GSM8K as published ---


def _jsonl_rows(path: Path, data: bytes) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EngineError(
            "gsm8k-input-invalid",
            f"{path}: neither parquet nor UTF-8 JSON lines ({exc.reason} at byte {exc.start})",
        ) from exc
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise EngineError(
                "gsm8k-input-invalid",
                f"{path}:{lineno}: not a JSON object ({getattr(exc, 'msg', 'nested too deep')})",
            ) from exc
        yield f"line {lineno}", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    _, pq = _pyarrow()
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises its own error types
        raise EngineError("gsm8k-input-invalid", f"{path}: unreadable parquet ({exc})") from exc
    missing = [c for c in ("question", "answer") if c not in table.column_names]
    if missing:
        raise EngineError(
            "gsm8k-input-invalid",
            f"{path}: no column {', '.join(missing)} (has {', '.join(table.column_names)})",
        )
    columns = table.select(["question", "answer"]).to_pydict()
    for i, (question, answer) in enumerate(
        zip(columns["question"], columns["answer"], strict=True)
    ):
        yield f"row {i}", {"question": question, "answer": answer}


def read_gsm8k(path: Path) -> list[dict[str, str]]:
    """The ``question``/``answer`` pairs of a GSM8K jsonl or parquet file, in file order."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EngineError("gsm8k-input-missing", f"{path}: {exc.strerror or exc}") from exc
    rows = _parquet_rows(path) if data[:4] == PARQUET_MAGIC else _jsonl_rows(path, data)
    out: list[dict[str, str]] = []
    bad: list[str] = []
    for where, row in rows:
        if not isinstance(row, dict) or not all(
            isinstance(row.get(k), str) for k in ("question", "answer")
        ):
            raise EngineError(
                "gsm8k-input-invalid", f"{path}: {where}: needs string question and answer"
            )
        if extract_solution(row["answer"]) is None:
            bad.append(where)
        out.append({"question": row["question"], "answer": row["answer"]})
    if bad:
        listed = ", ".join(bad[:MAX_LISTED]) + (
            f" and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
        )
        raise EngineError(
            "gsm8k-answer-unmarked",
            f"{path}: {listed}: the answer has no '#### <number>' final answer, which verl's "
            "gsm8k reward needs",
        )
    if not out:
        raise EngineError("gsm8k-input-invalid", f"{path}: no rows")
    return out


# --- verl's layout ---


def verl_rows(rows: Iterable[dict[str, str]], split: str) -> list[dict[str, Any]]:
    """verl's ``process_fn`` applied to each row (``index`` counts from 0 per split)."""
    out = []
    for index, row in enumerate(rows):
        solution = extract_solution(row["answer"])
        if solution is None:  # read_gsm8k refuses these; callers with their own rows too
            raise EngineError(
                "gsm8k-answer-unmarked", f"{split} row {index}: the answer has no '#### <number>'"
            )
        out.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": row["question"] + " " + INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": solution},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "answer": row["answer"],
                    "question": row["question"],
                },
            }
        )
    return out


def write_parquet(rows: list[dict[str, Any]], target: Path) -> None:
    """Write verl rows to ``target`` atomically (a temp file renamed into place)."""
    pa, pq = _pyarrow()
    table = pa.Table.from_pylist(rows, schema=schema())
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression="snappy")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def gsm8k(train: Path, test: Path, out: Path) -> dict[str, Any]:
    """Convert both splits (all read and checked before anything is written)."""
    sources = {"train": Path(train), "test": Path(test)}
    converted = {split: verl_rows(read_gsm8k(src), split) for split, src in sources.items()}
    files = {}
    for split in SPLITS:
        target = Path(out) / f"{split}.parquet"
        try:
            write_parquet(converted[split], target)
        except OSError as exc:
            raise EngineError("data-write-failed", f"{target}: {exc}") from exc
        files[split] = {
            "path": str(target),
            "source": str(sources[split]),
            "rows": len(converted[split]),
        }
    return {"dataset": "gsm8k", "data_source": DATA_SOURCE, "out": str(out), "files": files}


# --- a placed data set, prepared for a job ---

PREPARED_RECORD = "oldgpu-prepared.json"
# The data sets ``prepare`` knows, by the data_source a job names (verl's reward key).
RECIPES = (DATA_SOURCE,)


def find_split(raw: Path, split: str) -> list[Path]:
    """The file(s) of one split in a data set as published: ``train.jsonl``,
    ``main/train-00000-of-00001.parquet`` (the hub's GSM8K: config ``main`` first)."""
    found = sorted(
        p for p in Path(raw).rglob(f"{split}*")
        if p.is_file() and p.suffix in (".parquet", ".jsonl") and not p.name.startswith(".")
    )  # fmt: skip
    parents = sorted({p.parent for p in found})
    if len(parents) > 1:
        main = [d for d in parents if d.name == "main"]
        if len(main) != 1:
            raise EngineError(
                "data-split-ambiguous",
                f"{raw}: {split} files in {', '.join(str(d) for d in parents)}; give "
                "train_files and val_files instead",
            )
        found = [p for p in found if p.parent == main[0]]
    if not found:
        raise EngineError("data-split-missing", f"{raw}: no {split}*.parquet or {split}*.jsonl")
    return found


def _raw_digest(raw: Path) -> str | None:
    try:
        return json.loads((Path(raw) / "oldgpu-assets.json").read_text())["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prepare(raw: Path, data_source: str, out: Path, *, check: bool = False) -> dict[str, Any]:
    """A placed data set (oldgpu assets) in verl's layout at OUT/{train,test}.parquet.

    Made again only when the placed copy changed (its digest is recorded beside the
    files); written beside OUT and switched in whole (a link renamed), like the copy.
    """
    from oldgpu import assets  # oldgpu.assets imports nothing of this module

    if data_source not in RECIPES:
        raise EngineError(
            "data-recipe-unknown",
            f"data_source {data_source!r}: oldgpu data prepares {', '.join(RECIPES)}; for "
            "another data set give train_files and val_files in verl's layout",
            code=4,
        )
    out = Path(out)
    digest = _raw_digest(raw)
    report = {"kind": "prepared", "path": str(out), "source": str(raw), "data_source": data_source}
    try:
        done = json.loads((out / PREPARED_RECORD).read_text())
    except (OSError, ValueError):
        done = {}
    whole = all((out / f"{split}.parquet").is_file() for split in SPLITS)
    if digest and done.get("source_digest") == digest and whole:
        return {**report, "changed": False, "action": "unchanged"}
    action = "replace" if out.exists() or out.is_symlink() else "place"
    if check or digest is None:
        if digest is None and not check:
            raise EngineError(
                "data-source-unplaced", f"{raw}: no placed data set there (oldgpu assets fetch)"
            )
        return {**report, "changed": True, "action": f"would-{action}"}
    rows = {
        split: verl_rows([r for f in find_split(raw, split) for r in read_gsm8k(f)], split)
        for split in SPLITS
    }
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = assets.new_staging(out)
        try:
            for split in SPLITS:
                write_parquet(rows[split], staging / f"{split}.parquet")
            record = {"source": str(raw), "source_digest": digest, "data_source": data_source,
                      "rows": {split: len(rows[split]) for split in SPLITS}}  # fmt: skip
            (staging / PREPARED_RECORD).write_text(json.dumps(record, indent=2) + "\n")
            for path in [staging, *staging.iterdir()]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            assets.switch_in(out, staging, digest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        raise EngineError("data-write-failed", f"{out}: {exc}") from exc
    return {**report, "changed": True, "action": action + "d",
            "rows": {split: len(rows[split]) for split in SPLITS}}  # fmt: skip


# --- CLI ---


def add_parser(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    summary = "turn a data set as published into verl's parquet layout"
    parser = subcommand.add(subparsers, common, "data", None, __doc__, help=summary)
    kinds = parser.add_subparsers(dest="dataset", required=True)
    summary = "GSM8K (jsonl or parquet with question/answer) -> train/test.parquet"
    g = subcommand.add(kinds, common, "gsm8k", run, __doc__, help=summary, whole_doc=True)
    g.add_argument("--train", type=Path, required=True, help="the train split as published")
    g.add_argument("--test", type=Path, required=True, help="the test split as published")
    g.add_argument("--out", type=Path, required=True, help="writes OUT/{train,test}.parquet")
    summary = "a data set oldgpu assets placed -> prepared_dir/<id>/<revision>, by data_source"
    p = subcommand.add(kinds, common, "placed", run_placed, help=summary)
    p.add_argument("id", help="the data set's id, as a job's dataset names it")
    p.add_argument("--revision", default="main", help="as the job's dataset_revision")
    p.add_argument("--data-source", default=DATA_SOURCE, help=f"the job's (default {DATA_SOURCE})")
    p.add_argument("--check", action="store_true", help="say what would change; change nothing")


def run_placed(args: argparse.Namespace) -> Result:
    from oldgpu import asset_files

    raw = asset_files.place_of("dataset", args.id, args.revision)
    out = asset_files.prepared_of(args.id, args.revision)
    doc = prepare(raw, args.data_source, out, check=args.check)
    return Result(doc, f"{doc['path']}: {doc['action']} from {raw}")


def run(args: argparse.Namespace) -> Result:
    payload = gsm8k(args.train, args.test, args.out)
    text = "\n".join(
        f"{f['path']}: {f['rows']} rows from {f['source']}" for f in payload["files"].values()
    )
    return Result(payload, text)
