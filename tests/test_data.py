"""``oldgpu data gsm8k``: GSM8K as published -> verl's parquet layout."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from oldgpu import cli
from oldgpu import data as gsm8k_data
from oldgpu.output import EngineError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
HAVE_DATASETS = importlib.util.find_spec("datasets") is not None

ROWS = [
    {"question": "Ann has 3 pens and buys 5. How many pens?", "answer": "3+5=<<3+5=8>>8\n#### 8"},
    {"question": "A big one?", "answer": "It is 1,000 + 250 = 1,250.\n#### 1,250"},
    {"question": "Below zero?", "answer": "2 - 7 = -5\n#### -5"},
    {"question": "Half of 5?", "answer": "5 / 2 = 2.5\n#### 2.5"},
]
TRUTHS = ["8", "1250", "-5", "2.5"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def sources(tmp_path: Path) -> tuple[Path, Path]:
    return write_jsonl(tmp_path / "train.jsonl", ROWS), write_jsonl(
        tmp_path / "test.jsonl", ROWS[:2]
    )


def run_offline(script: str, *args: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    """``python -c script args`` with Hugging Face offline and its datasets cache in ``cache``."""
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        env={**os.environ, **offline, **env},
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def run_cli(capsys, *argv: str) -> tuple[int, dict]:
    code = cli.main(["data", "gsm8k", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_layout_is_verls(sources, tmp_path: Path, capsys) -> None:
    train, test = sources
    code, out = run_cli(
        capsys, "--train", str(train), "--test", str(test), "--out", str(tmp_path / "o")
    )
    assert code == 0
    assert out["files"]["train"]["rows"] == 4 and out["files"]["test"]["rows"] == 2
    table = pq.read_table(tmp_path / "o" / "train.parquet")
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    rows = table.to_pylist()
    for i, (row, src, truth) in enumerate(zip(rows, ROWS, TRUTHS, strict=True)):
        assert row["data_source"] == "openai/gsm8k"
        assert row["ability"] == "math"
        assert row["prompt"] == [
            {
                "content": src["question"]
                + ' Let\'s think step by step and output the final answer after "####".',
                "role": "user",
            }
        ]
        assert row["reward_model"] == {"ground_truth": truth, "style": "rule"}
        assert row["extra_info"] == {
            "answer": src["answer"],
            "index": i,
            "question": src["question"],
            "split": "train",
        }
    test_rows = pq.read_table(tmp_path / "o" / "test.parquet").to_pylist()
    assert [r["extra_info"]["split"] for r in test_rows] == ["test", "test"]
    assert [r["extra_info"]["index"] for r in test_rows] == [0, 1]


@pytest.mark.skipif(not HAVE_DATASETS, reason="needs datasets (the engine test venv)")
def test_same_file_as_verls_script(sources, tmp_path: Path) -> None:
    """verl's examples/data_preprocess/gsm8k.py, run on the same rows with ``datasets``."""
    train, test = sources
    gsm8k_data.gsm8k(train, test, tmp_path / "ours")
    script = r"""
import re, sys
import datasets

def extract_solution(solution_str):
    solution = re.search("#### (\\-?[0-9\\.\\,]+)", solution_str)
    assert solution is not None
    final_solution = solution.group(0)
    return final_solution.split("#### ")[1].replace(",", "")

instruction_following = 'Let\'s think step by step and output the final answer after "####".'

def make_map_fn(split):
    def process_fn(example, idx):
        question_raw = example.pop("question")
        question = question_raw + " " + instruction_following
        answer_raw = example.pop("answer")
        solution = extract_solution(answer_raw)
        return {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": idx, "answer": answer_raw,
                           "question": question_raw},
        }
    return process_fn

ds = datasets.load_dataset("json", data_files=sys.argv[1], split="train")
ds = ds.map(function=make_map_fn("train"), with_indices=True)
ds.to_parquet(sys.argv[2])
"""
    ref = tmp_path / "verl-train.parquet"
    proc = run_offline(script, str(train), str(ref), cache=tmp_path / "hf-cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs = pq.read_table(tmp_path / "ours" / "train.parquet"), pq.read_table(ref)
    assert ours.schema.equals(theirs.schema, check_metadata=True)  # datasets features too
    assert ours.equals(theirs)
    assert (tmp_path / "ours" / "train.parquet").read_bytes() == ref.read_bytes()


def test_parquet_input_as_published(sources, tmp_path: Path) -> None:
    # The hub's copy: parquet with question/answer (any further column is ignored).
    table = pa.table(
        {
            "question": [r["question"] for r in ROWS],
            "answer": [r["answer"] for r in ROWS],
            "extra": list(range(len(ROWS))),
        }
    )
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet")
    train, test = sources
    gsm8k_data.gsm8k(tmp_path / "train-00000-of-00001.parquet", test, tmp_path / "from-pq")
    gsm8k_data.gsm8k(train, test, tmp_path / "from-jsonl")
    assert (tmp_path / "from-pq" / "train.parquet").read_bytes() == (
        tmp_path / "from-jsonl" / "train.parquet"
    ).read_bytes()


def test_idempotent(sources, tmp_path: Path) -> None:
    train, test = sources
    gsm8k_data.gsm8k(train, test, tmp_path / "o")
    first = {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir()}
    gsm8k_data.gsm8k(train, test, tmp_path / "o")
    assert {p.name: p.read_bytes() for p in (tmp_path / "o").iterdir()} == first
    assert sorted(first) == ["test.parquet", "train.parquet"]  # no temp files left


def test_extract_solution_is_verls() -> None:
    assert [gsm8k_data.extract_solution(r["answer"]) for r in ROWS] == TRUTHS
    assert gsm8k_data.extract_solution("no marker 42") is None
    assert gsm8k_data.extract_solution("####42") is None  # verl's regex needs the space
    assert gsm8k_data.extract_solution("#### 7 then #### 9") == "7"


def _refused(capsys, name: str, train: Path, test: Path, out: Path) -> dict:
    code = cli.main(
        ["data", "gsm8k", "--train", str(train), "--test", str(test), "--out", str(out), "--json"]
    )
    captured = capsys.readouterr()
    assert code == 2, captured
    err = json.loads(captured.out)
    assert err["error"] == name, err
    return err


def test_rows_without_marker_are_refused(sources, tmp_path: Path, capsys) -> None:
    _, test = sources
    rows = [
        ROWS[0],
        {"question": "q", "answer": "just 8"},
        ROWS[1],
        {"question": "r", "answer": "x"},
    ]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "o"
    err = _refused(capsys, "gsm8k-answer-unmarked", bad, test, out)
    assert "bad.jsonl" in err["message"] and "line 2, line 4" in err["message"]
    assert not out.exists()  # checked before anything is written


def test_bad_input_is_refused(sources, tmp_path: Path, capsys) -> None:
    _, test = sources
    out = tmp_path / "o"
    err = _refused(capsys, "gsm8k-input-missing", tmp_path / "nope.jsonl", test, out)
    assert "nope.jsonl" in err["message"]
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    err = _refused(capsys, "gsm8k-input-invalid", broken, test, out)
    assert "broken.jsonl:2" in err["message"]
    no_answer = write_jsonl(tmp_path / "q.jsonl", [{"question": "q"}])
    _refused(capsys, "gsm8k-input-invalid", no_answer, test, out)
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"problem": ["q"], "solution": ["#### 1"]}), other)
    err = _refused(capsys, "gsm8k-input-invalid", other, test, out)
    assert "question" in err["message"] and "problem" in err["message"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    _refused(capsys, "gsm8k-input-invalid", empty, test, out)
    assert not out.exists()


def test_missing_pyarrow_is_named(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    with pytest.raises(EngineError) as exc:
        gsm8k_data.schema()
    assert exc.value.name == "python-package-missing" and "pyarrow" in exc.value.message


def test_verl_reads_it(sources, tmp_path: Path, verl_pristine: Path) -> None:
    """verl's own RLHFDataset and gsm8k reward on the output (needs the engine venv)."""
    if importlib.util.find_spec("torch") is None or not HAVE_DATASETS:
        pytest.skip("needs the engine test venv (torch, datasets)")
    train, test = sources
    gsm8k_data.gsm8k(train, test, tmp_path / "o")
    script = r"""
import sys
import datasets
from verl.utils.reward_score import default_compute_score

ds = datasets.load_dataset("parquet", data_files=sys.argv[1], split="train")
for row in ds:
    assert isinstance(row["prompt"], list) and row["prompt"][0]["role"] == "user", row
    truth = row["reward_model"]["ground_truth"]
    good = "so the answer is\n#### " + truth
    assert default_compute_score(row["data_source"], good, truth) == 1.0
    assert default_compute_score(row["data_source"], "#### 123456", truth) == 0.0
print(len(ds))
"""
    proc = run_offline(
        script,
        str(tmp_path / "o" / "train.parquet"),
        cache=tmp_path / "hf-cache",
        PYTHONPATH=str(verl_pristine),
        PYTHONDONTWRITEBYTECODE="1",
        CUDA_VISIBLE_DEVICES="",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^4$", proc.stdout, re.M)
