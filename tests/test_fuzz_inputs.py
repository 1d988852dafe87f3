"""Every engine command that reads a file, a JSON document or a number: arbitrary bytes,
text and JSON get an answer or a named error (one line, a kebab-case name, the error's
exit code), never a traceback. Seeded, so a failure replays; docs/reliability.md has the
hand-picked cases ("Bad input to the engine")."""

from __future__ import annotations

import json
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import QWEN05B_CONFIG, job_spec

from oldgpu import cli, jobs

DATA = Path(__file__).parent / "data"
EXCERPT = DATA / "pci.ids.excerpt"
SMI = sorted((DATA / "detect").glob("*.nvidia-smi.*"))
LSPCI = sorted((DATA / "detect").glob("*.lspci.txt"))
DRIVER = sorted((DATA / "driver").glob("*.txt"))
FACTS = DATA / "doctor" / "h200-torch2.11-cu130.facts.json"
GSM8K = (
    '{"question": "Ann has 3 pens and buys 5. How many pens?", "answer": "3+5=8\\n#### 8"}\n'
    '{"question": "Below zero?", "answer": "2 - 7 = -5\\n#### -5"}\n'
)
PROFILE_NAMES = ("pascal", "pascal-6.1", "cpu", "volta-7.0", "kepler", "turing-7.5")
# A named error: "oldgpu CMD: some-name: message" on one line (argparse's usage errors too).
NAMED = re.compile(r"^oldgpu [a-z-]+: [a-z0-9]+(-[a-z0-9]+)*: .*$")
USAGE = re.compile(r"oldgpu [a-z -]+: error: ")
ERROR_CODES = {1, 2, 4}  # EngineError's default, jobs' CONFIG_INVALID, venv's BUILD_FAILED


def _job_spec(root: Path) -> dict:
    return job_spec(
        root, name="fuzz", total_steps=3, profile="pascal", overrides=["trainer.test_freq=5"]
    )


# -- the mutations -------------------------------------------------------------------


def _bytes(rng: random.Random, text: str) -> bytes | str:
    """Arbitrary bytes, arbitrary text, or the seed cut, shuffled or sprinkled with junk."""
    kind = rng.randrange(7 if text else 2)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300)))
    if kind == 1:
        return "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(0, 200)))
    if kind == 2:
        return text[: rng.randrange(len(text) + 1)]
    if kind == 3:
        lines = text.splitlines(True)
        rng.shuffle(lines)
        return "".join(lines + rng.sample(lines, min(len(lines), 2)))
    if kind == 4:
        chars = list(text)
        for _ in range(rng.randrange(1, 8)):
            chars[rng.randrange(len(chars))] = rng.choice(',;"\n\t:.-0\x00\xff[]{}')
        return "".join(chars)
    if kind == 5:
        data = bytearray(text.encode())
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    return text.replace(rng.choice([",", " ", ":", "."]), rng.choice(["", ";", "  ", "x"]))


def _value(rng: random.Random, depth: int = 0) -> object:
    """A JSON value of any type: what a hand-edited file may hold where another was meant."""
    kind = rng.randrange(9 if depth < 3 else 6)
    simple = [
        None,
        rng.choice([True, False]),
        rng.choice([0, -1, 1, 2, 7, 2**63, -(2**40)]),
        rng.choice([0.0, -1.5, 2.7, 1e308, 1e-9]),
        rng.choice(["", "x", "pascal-9.9", "/home/u/m", "all", "1,2", "²", "a\nb", "0"]),
        rng.choice(["pascal-abc", "9", "-3", "fp16", "/m", "grpo"]),
    ]
    if kind < 6:
        return simple[kind]
    if kind == 6:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["a", "gpus", "probe", "0"]): _value(rng, depth + 1) for _ in range(2)}


def _json(rng: random.Random, seed: object) -> str:
    """The seed with a value swapped, a key dropped, a type changed, or another document."""
    kind = rng.randrange(6)
    if kind == 0 or not isinstance(seed, dict):
        return json.dumps(_value(rng))
    doc = json.loads(json.dumps(seed))
    key = rng.choice(sorted(doc))
    if kind == 1:
        del doc[key]
    elif kind == 2:
        doc[key] = _value(rng)
    elif kind == 3:
        inner = doc[key]
        if isinstance(inner, dict) and inner:
            inner[rng.choice(sorted(inner))] = _value(rng)
        else:
            doc[key] = [inner, _value(rng)]
    elif kind == 4:
        doc[rng.choice(["extra", key + "x"])] = _value(rng)
    else:
        return "[" * rng.randrange(1, 3000) + rng.choice(["", "]", "1"])
    return json.dumps(doc)


def _number(rng: random.Random) -> str:
    return rng.choice(["0", "-1", "-5000", "1", "3", "2.7", "1e3", "x", "", "99999999999", "-0"])


# -- the commands --------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    cases: int
    argv: Callable[[random.Random, Path], list[str]]


def _file(root: Path, name: str, data: bytes | str) -> str:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass"))
    return str(path)


def _smi(rng: random.Random, root: Path) -> list[str]:
    bad = _file(root, "smi.csv", _bytes(rng, rng.choice(SMI).read_text()))
    return ["detect", "--nvidia-smi-file", bad, "--pci-ids", str(EXCERPT)]


def _lspci(rng: random.Random, root: Path) -> list[str]:
    bad = _file(root, "lspci.txt", _bytes(rng, rng.choice(LSPCI).read_text()))
    return ["detect", "--lspci-file", bad, "--pci-ids", str(EXCERPT)]


def _profile(rng: random.Random, root: Path) -> list[str]:
    bad = _file(root, "smi.csv", _bytes(rng, rng.choice(SMI).read_text()))
    return ["profile", "--gpus-from-detect", "--nvidia-smi-file", bad, "--pci-ids", str(EXCERPT)]


def _plan_model(rng: random.Random, root: Path) -> list[str]:
    data = _json(rng, QWEN05B_CONFIG) if rng.random() < 0.8 else _bytes(rng, "{}")
    _file(root, "model/config.json", data)
    return ["plan", "--model", str(root / "model"), "--profile", "pascal", "--gpu-mib", "24576"]


def _plan_numbers(rng: random.Random, root: Path) -> list[str]:
    flags = ["--headroom-mib", "--ppo-mini-batches", "--prompt-length", "--response-length"]
    flags += ["--gpu-mib", "--gpus", "--rollout-n", "--lora-rank", "--target-train-batch"]
    argv = ["plan", "--profile", rng.choice([*PROFILE_NAMES[:2], "pascal-abc", "pascal-9.9"])]
    argv += ["--gpu-mib", "24576"] + [a for f in rng.sample(flags, 2) for a in (f, _number(rng))]
    return argv


def _patch(rng: random.Random, root: Path) -> list[str]:
    (root / "tree").mkdir(exist_ok=True)  # not a verl tree: refused after the options
    name = rng.choice([*PROFILE_NAMES, "pascal-abc", "pascal-9.9", "cpu-6.1", "", "x-"])
    argv = ["patch", "--check", "--profile", name]
    if rng.random() < 0.5:
        argv += ["--compute-dtype", rng.choice(["fp32", "fp16", "bf16"])]
    if rng.random() < 0.3:
        argv += ["--attn-implementation", rng.choice(["sdpa", "eager", "flash_attention_2"])]
    return [*argv, str(root / "tree")]


def _gsm8k(rng: random.Random, root: Path) -> list[str]:
    train = _file(root, "train.jsonl", _bytes(rng, GSM8K))
    return ["data", "gsm8k", "--train", train, "--test", train, "--out", str(root / "out")]


def _doctor(rng: random.Random, root: Path) -> list[str]:
    facts = json.loads(FACTS.read_text())
    data = _json(rng, facts) if rng.random() < 0.8 else _bytes(rng, FACTS.read_text()[:400])
    argv = ["doctor", "--facts", _file(root, "facts.json", data)]
    if rng.random() < 0.2:
        argv += [rng.choice(["--min-free-gpu-mib", "--min-free-host-mib"]), _number(rng)]
    return argv


def _driver(rng: random.Random, root: Path) -> list[str]:
    seed = rng.choice(DRIVER)
    flag = {
        "dkms-status": "--dkms-status-file",
        "dpkg": "--dpkg-file",
        "modules": "--modules-file",
        "proc-version": "--proc-version-file",
    }.get(seed.name.split(".")[0], "--dpkg-file")
    bad = _file(root, "driver.txt", _bytes(rng, seed.read_text()))
    return ["driver", flag, bad, "--lib-modules-dir", str(root / "nomodules")]


def _job_env(rng: random.Random, root: Path) -> list[str]:
    spec = _job_spec(root)
    data = _json(rng, spec) if rng.random() < 0.85 else _bytes(rng, json.dumps(spec))
    return ["job", "env", _file(root, "job.json", data)]


def _job_command(rng: random.Random, root: Path) -> list[str]:
    text = jobs.render_env(jobs.job_from_mapping(_job_spec(root)))
    bad = _file(root, "job.env", _bytes(rng, text))
    smi = str(DATA / "detect" / "p40.nvidia-smi.csv")
    return ["job", "command", "--env-file", bad, "--nvidia-smi-file", smi, "--json"]


def _guard(rng: random.Random, root: Path) -> list[str]:
    name = rng.choice([*PROFILE_NAMES, "pascal-abc", "pascal-9.9", "zz", "ampere", "maxwell-5"])
    return ["guard", "--env", "--profile", name]


def _switch(rng: random.Random, root: Path) -> list[str]:
    (root / "target").mkdir(exist_ok=True)
    return ["switch", "--check", "--keep", _number(rng), str(root / "link"), str(root / "target")]


def _fleet_drift(rng: random.Random, root: Path) -> list[str]:
    same = {"driver": "580.65.06", "lock": "a" * 16, "tree": "b" * 16, "gpus": 4}
    seed = {"p40-01": same, "p40-02": {**same, "driver": "580.82.07"}}
    data = _json(rng, seed) if rng.random() < 0.85 else _bytes(rng, json.dumps(seed))
    name = rng.choice(["facts.json", "missing.json"])
    path = _file(root, "facts.json", data)
    return ["fleet", "drift", path if name == "facts.json" else str(root / name)]


def _ray_node_env(rng: random.Random, root: Path) -> list[str]:
    seed = {
        "gcs_port": 6379,
        "head_address": "10.0.0.5",
        "object_store_mib": 300,
        "head_wait_s": 60,
    }
    data = _json(rng, seed) if rng.random() < 0.85 else _bytes(rng, json.dumps(seed))
    return ["ray-node", "env", _file(root, "ray.json", data)]


TARGETS = (
    Target("detect-nvidia-smi", 300, _smi),
    Target("detect-lspci", 200, _lspci),
    Target("profile", 150, _profile),
    Target("plan-model", 200, _plan_model),
    Target("plan-numbers", 150, _plan_numbers),
    Target("patch", 200, _patch),
    Target("data-gsm8k", 200, _gsm8k),
    Target("doctor-facts", 200, _doctor),
    Target("driver", 200, _driver),
    Target("job-env", 300, _job_env),
    Target("job-command", 100, _job_command),
    Target("guard-env", 100, _guard),
    Target("switch", 100, _switch),
    Target("fleet-drift", 150, _fleet_drift),
    Target("ray-node-env", 150, _ray_node_env),
)


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse: a usage error, exit 2
        code = exc.code if isinstance(exc.code, int) else 2
        err = capsys.readouterr().err
        assert code == 2 and USAGE.search(err), (argv, err)
        return code, err
    return code, capsys.readouterr().err


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_bad_input_gets_a_named_error_never_a_traceback(target, tmp_path, capsys, monkeypatch):
    # Hermetic: no tool runs, no job directory or venv of this host is read.
    monkeypatch.setattr("shutil.which", lambda *_: None)
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    monkeypatch.setattr(sys, "argv", ["oldgpu"])
    rng = random.Random(f"oldgpu-{target.name}")
    seen = {"ok": 0, "refused": 0}
    for case in range(target.cases):
        root = tmp_path / str(case % 4)  # reused: the files are rewritten each time
        root.mkdir(exist_ok=True)
        argv = target.argv(rng, root)
        try:
            code, err = _run(argv, capsys)
        except Exception as exc:  # the defect this test exists for
            pytest.fail(f"{argv}: traceback {type(exc).__name__}: {exc}")
        if code == 0 or (not err and code in (1, 3)):  # an answer: guard off, doctor's failures
            seen["ok"] += 1
            continue
        seen["refused"] += 1
        lines = err.strip().splitlines()
        usage = code == 2 and USAGE.search(err)
        assert usage or (code in ERROR_CODES and len(lines) == 1 and NAMED.match(lines[0])), (
            argv,
            code,
            err,
        )
    # The generator reaches both sides: bad input refused, and some still accepted.
    assert seen["refused"] > target.cases // 10, seen


# -- the cases issue 16 reported, and their kind elsewhere ---------------------------

SMI_P40 = "0, Tesla P40, 00000000:04:00.0, 0x1B3810DE, 24576, 6.1, 535.183.01\n"
HEADER = "index, name, pci.bus_id, pci.device_id, memory.total [MiB], compute_cap, driver_version\n"
BINARY = b"\xff\xfe\x00\x01garbage\x80\n"
P = ["--profile", "pascal", "--gpu-mib", "24576"]
# (files to write, argv with {root}, the error's name, exit code); docs/reliability.md's table.
# fmt: off
REPORTED = [
    ({"f": BINARY}, "detect --lspci-file {root}/f", "detect-input-not-text", 2),
    ({"f": BINARY}, "detect --nvidia-smi-file {root}/f", "detect-input-not-text", 2),
    ({"f": HEADER + SMI_P40}, "detect --nvidia-smi-file {root}/f", "nvidia-smi-output-malformed", 2),  # noqa: E501
    ({"f": HEADER + SMI_P40}, "profile --gpus-from-detect --nvidia-smi-file {root}/f", "nvidia-smi-output-malformed", 2),  # noqa: E501
    ({"f": HEADER + SMI_P40}, "plan --nvidia-smi-file {root}/f", "nvidia-smi-output-malformed", 2),
    ({"f": SMI_P40.replace("00000000:04", "zz:04")}, "detect --nvidia-smi-file {root}/f", "nvidia-smi-output-malformed", 2),  # noqa: E501
    ({"f": SMI_P40.replace("00000000:04:00.0", "04")}, "detect --nvidia-smi-file {root}/f", "nvidia-smi-output-malformed", 2),  # noqa: E501
    ({"f": SMI_P40.replace("24576", "lots")}, "detect --nvidia-smi-file {root}/f", "nvidia-smi-output-malformed", 2),  # noqa: E501
    ({"f": SMI_P40.replace("24576", "-1")}, "detect --nvidia-smi-file {root}/f", "nvidia-smi-output-malformed", 2),  # noqa: E501
    ({"f": BINARY}, "plan --lspci-file {root}/f", "detect-input-not-text", 2),
    ({"f": BINARY}, "data gsm8k --train {root}/f --test {root}/f --out {root}/o", "gsm8k-input-invalid", 2),  # noqa: E501
    ({"m/config.json": {"num_attention_heads": 0}}, "plan --model {root}/m", "plan-model-config-invalid", 2),  # noqa: E501
    ({"m/config.json": {"hidden_size": -896}}, "plan --model {root}/m", "plan-model-config-invalid", 2),  # noqa: E501
    ({"m/config.json": {"num_key_value_heads": 0}}, "plan --model {root}/m", "plan-model-config-invalid", 2),  # noqa: E501
    ({"m/config.json": {"num_key_value_heads": "two"}}, "plan --model {root}/m", "plan-model-config-invalid", 2),  # noqa: E501
    ({"m/config.json": {"head_dim": -3}}, "plan --model {root}/m", "plan-model-config-invalid", 2),
    ({"m/config.json": {"hidden_size": True}}, "plan --model {root}/m", "plan-model-config-invalid", 2),  # noqa: E501
    ({"m/config.json": BINARY}, "plan --model {root}/m", "plan-model-config-invalid", 2),
    ({"m/config.json": "[" * 5000}, "plan --model {root}/m", "plan-model-config-invalid", 2),
    ({"m/config.json": {"max_position_embeddings": 1024}}, "plan --model {root}/m --prompt-length 1000", "plan-sequence-too-long", 2),  # noqa: E501
    ({}, "plan --profile pascal-abc --gpu-mib 24576", "bad-compute-capability", 2),
    ({}, "plan --profile pascal-9.9 --gpu-mib 24576", "profile-cc-mismatch", 2),
    ({}, "plan --profile cpu-6.1 --host-mib 4096", "profile-cc-mismatch", 2),
    ({}, "plan --headroom-mib -5000", "plan-bad-input", 2),
    ({}, "plan --ppo-mini-batches 0", "plan-bad-input", 2),
    ({"t/x": ""}, "patch --profile pascal-abc {root}/t", "bad-compute-capability", 2),
    ({"t/x": ""}, "patch --profile pascal-9.9 {root}/t", "profile-cc-mismatch", 2),
    ({"t/x": ""}, "patch --profile pascal --compute-dtype bf16 {root}/t", "patch-dtype-unsupported", 2),  # noqa: E501
    ({"t/x": ""}, "patch --profile pascal --attn-implementation flash_attention_2 {root}/t", "patch-attention-unsupported", 2),  # noqa: E501
    ({}, "guard --env --profile pascal-abc", "guard-profile-unknown", 2),
    ({"j": {"profile": "pascal-abc"}}, "job env {root}/j", "job-config-invalid", 4),
    ({"j": {"profile": "pascal-9.9"}}, "job env {root}/j", "job-config-invalid", 4),
    ({"j": [1, 2]}, "job env {root}/j", "job-config-invalid", 4),
    ({"j": None}, "job env {root}/j", "job-config-invalid", 4),
    ({"j": "x"}, "job env {root}/j", "job-config-invalid", 4),
    ({"j": BINARY}, "job env {root}/j", "job-config-invalid", 4),
    ({"j": {"total_steps": 2.7}}, "job env {root}/j", "job-config-invalid", 4),
    ({"j": {"overrides": [1, [2]]}}, "job env {root}/j", "job-config-invalid", 4),
    ({"j": {"devices": ["²"]}}, "job env {root}/j", "devices-invalid", 4),
    ({"j": {"model_path": "/home/u/model"}}, "job env {root}/j", "job-path-protected", 4),
    ({"j": {"train_files": "/root/train.parquet"}}, "job env {root}/j", "job-path-protected", 4),
    ({"e": BINARY}, "job command --env-file {root}/e", "job-config-invalid", 4),
    ({"f": [1]}, "doctor --facts {root}/f", "facts-invalid", 2),
    ({"f": {"detect": 3, "probe": "x"}}, "doctor --facts {root}/f", "facts-invalid", 2),
    ({}, "doctor --min-free-gpu-mib -3", "doctor-bad-input", 2),
    ({"m/acme/x/r1/oldgpu-assets.json": BINARY}, "assets fetch model acme/x --revision r1 --mirror {root}/m", "asset-statement-invalid", 23),  # noqa: E501
    ({"m/acme/x/r1/config.json": "{}"}, "assets fetch model acme/x --revision r2 --mirror {root}/m", "asset-revision-missing", 21),  # noqa: E501
    ({"m/acme/x/r1/config.json": "{}"}, "assets fetch model acme/x --revision r1 --mirror {root}/m", "asset-files-missing", 22),  # noqa: E501
    ({}, "assets fetch model ../x --mirror {root}", "asset-id-invalid", 4),
    ({}, "assets fetch model acme/x --source ftp", "asset-source-unknown", 20),
]
# fmt: on


@pytest.mark.parametrize(("files", "argv", "name", "code"), REPORTED, ids=[r[1] for r in REPORTED])
def test_reported_bad_input(files, argv, name, code, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda *_: None)
    for rel, data in files.items():
        if rel == "m/config.json" and isinstance(data, dict):
            data = json.dumps({**QWEN05B_CONFIG, **data})
        elif rel == "j" and isinstance(data, dict):
            data = json.dumps({**_job_spec(tmp_path), **data})
        elif not isinstance(data, str | bytes):
            data = json.dumps(data)
        _file(tmp_path, rel, data)
    words = argv.format(root=tmp_path).split()
    if words[0] == "plan" and "--profile" not in words and "--nvidia-smi-file" not in words:
        words += P if "--lspci-file" not in words else []
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    got, err = _run(words, capsys)
    assert (got, err.split(": ")[1]) == (code, name), err
    assert len(err.strip().splitlines()) == 1, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing made
