"""oldgpu assets: models and data sets placed from a mirror or the hub, checked, switched whole."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from oldgpu import asset_files, assets, data, jobs, paths
from oldgpu.output import EngineError

ROOT = Path(__file__).resolve().parents[1]
MODEL = "acme/tiny"
DATASET = "acme/gsm8k-tiny"


@pytest.fixture
def places(tmp_path, monkeypatch):
    """The host's fixed places, under tmp_path."""
    for name in ("MODELS_DIR", "DATASETS_DIR", "PREPARED_DIR"):
        monkeypatch.setattr(paths, name, tmp_path / "host" / name.lower())
    return tmp_path / "host"


def model_dir(where: Path, weights: bytes = b"weights-1", extra: dict | None = None) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": '{"model_type": "qwen2"}',
        "tokenizer.json": '{"version": "1.0"}',
        "tokenizer_config.json": "{}",
        **(extra or {}),
    }
    for name, text in files.items():
        (where / name).write_text(text)
    (where / "model.safetensors").write_bytes(weights)
    return where


def gsm8k_dir(where: Path, rows: int = 6) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    for split in data.SPLITS:
        with open(where / f"{split}.jsonl", "w") as fh:
            for i in range(rows):
                fh.write(json.dumps({"question": f"{split} {i}+1?", "answer": f"#### {i + 1}"}))
                fh.write("\n")
    return where


def published(tmp_path: Path, revision: str = "r1", weights: bytes = b"weights-1") -> Path:
    mirror = tmp_path / "mirror"
    assets.publish(
        "model", MODEL, revision, model_dir(tmp_path / "src" / revision, weights), mirror
    )
    return mirror


def stagings(place: Path) -> list[str]:
    copies = assets.copies_of(place)
    return (
        sorted(p.name for p in copies.iterdir() if ".staging-" in p.name) if copies.exists() else []
    )


def code_of(exc: pytest.ExceptionInfo) -> tuple[str, int]:
    return exc.value.name, exc.value.code


# --- from a mirror ---


def test_fetch_places_verifies_and_records(places, tmp_path):
    mirror = published(tmp_path)
    doc = assets.fetch("model", MODEL, "r1", "mirror", mirror=mirror)
    place = places / "models_dir" / MODEL / "r1"
    assert doc["changed"] and doc["action"] == "placed" and doc["path"] == str(place)
    assert (place / "model.safetensors").read_bytes() == b"weights-1"
    record = json.loads((place / asset_files.MANIFEST).read_text())
    assert record["source"] == f"mirror:{mirror}" and record["revision"] == "r1"
    assert (
        record["files"]["model.safetensors"]["sha256"] == hashlib.sha256(b"weights-1").hexdigest()
    )
    assert place.is_symlink() and oct(place.resolve().stat().st_mode & 0o777) == "0o755"
    assert assets.verify_placed(place) == []
    again = assets.fetch("model", MODEL, "r1", "mirror", mirror=mirror)
    assert (again["changed"], again["action"], again["digest"]) == (
        False,
        "unchanged",
        doc["digest"],
    )


def test_check_mode_changes_nothing(places, tmp_path):
    mirror = published(tmp_path)
    doc = assets.fetch("model", MODEL, "r1", "mirror", mirror=mirror, check=True)
    assert (doc["changed"], doc["action"]) == (True, "would-place")
    assert not (places / "models_dir").exists()


def test_sha256sums_statement_is_checked(places, tmp_path):
    src = model_dir(tmp_path / "mirror" / MODEL / "r1")
    lines = [f"{hashlib.sha256(b'other').hexdigest()}  model.safetensors"]
    (src / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    with pytest.raises(EngineError) as exc:
        assets.fetch("model", MODEL, "r1", "mirror", mirror=tmp_path / "mirror")
    assert code_of(exc) == ("asset-sha-mismatch", asset_files.EXIT_SHA)
    assert "model.safetensors" in exc.value.message
    place = places / "models_dir" / MODEL / "r1"
    assert not place.exists() and stagings(place) == []


def test_sha_mismatch_leaves_the_old_copy(places, tmp_path):
    mirror = published(tmp_path)
    first = assets.fetch("model", MODEL, "r1", "mirror", mirror=mirror)
    # New content for r1, whose file then rots in the mirror: refused, the old copy kept.
    assets.publish("model", MODEL, "r1", model_dir(tmp_path / "src2", b"weights-2"), mirror)
    (mirror / MODEL / "r1" / "model.safetensors").write_bytes(b"bit rot")
    with pytest.raises(EngineError) as exc:
        assets.fetch("model", MODEL, "r1", "mirror", mirror=mirror)
    assert code_of(exc) == ("asset-sha-mismatch", asset_files.EXIT_SHA)
    place = Path(first["path"])
    assert (place / "model.safetensors").read_bytes() == b"weights-1"
    assert assets.verify_placed(place) == [] and stagings(place) == []


@pytest.mark.parametrize(
    ("drop", "extra", "error", "code"),
    [
        ("config.json", {}, "asset-files-missing", asset_files.EXIT_MISSING),
        ("tokenizer.json", {}, "asset-files-missing", asset_files.EXIT_MISSING),
        ("model.safetensors", {}, "asset-files-missing", asset_files.EXIT_MISSING),
        (
            None,
            {"model.safetensors.index.json": '{"weight_map": {"a": "model-00002.safetensors"}}'},
            "asset-index-inconsistent",
            asset_files.EXIT_INDEX,
        ),
    ],
)
def test_a_model_missing_what_it_needs_is_refused(places, tmp_path, drop, extra, error, code):
    src = model_dir(tmp_path / "mirror" / MODEL / "r1", extra=extra)
    if drop:
        (src / drop).unlink()
    with pytest.raises(EngineError) as exc:
        assets.fetch("model", MODEL, "r1", "mirror", mirror=tmp_path / "mirror")
    assert code_of(exc) == (error, code)
    assert not (places / "models_dir").exists()


def test_a_statement_naming_a_missing_file_is_refused(places, tmp_path):
    mirror = published(tmp_path)
    (mirror / MODEL / "r1" / "tokenizer_config.json").unlink()
    with pytest.raises(EngineError) as exc:
        assets.fetch("model", MODEL, "r1", "mirror", mirror=mirror)
    assert code_of(exc) == ("asset-files-missing", asset_files.EXIT_MISSING)
    assert "tokenizer_config.json" in exc.value.message


def test_a_revision_not_in_the_mirror_is_named(places, tmp_path):
    mirror = published(tmp_path)
    with pytest.raises(EngineError) as exc:
        assets.fetch("model", MODEL, "r2", "mirror", mirror=mirror)
    assert code_of(exc) == ("asset-revision-missing", asset_files.EXIT_REVISION)
    assert "revisions there: r1" in exc.value.message


@pytest.mark.parametrize(
    ("kind", "asset_id", "revision", "error"),
    [
        ("model", "../etc", "r1", "asset-id-invalid"),
        ("model", "a/b/c", "r1", "asset-id-invalid"),
        ("model", MODEL, "refs/pr/1", "asset-revision-invalid"),
        ("model", MODEL, "..", "asset-revision-invalid"),
        ("weights", MODEL, "r1", "asset-kind-unknown"),
    ],
)
def test_ids_and_revisions_are_one_directory_name(kind, asset_id, revision, error):
    with pytest.raises(EngineError) as exc:
        asset_files.place_of(kind, asset_id, revision)
    assert code_of(exc) == (error, asset_files.EXIT_SPEC)


def test_unknown_source_is_named(places, tmp_path):
    with pytest.raises(EngineError) as exc:
        assets.fetch("model", MODEL, "r1", "ftp", mirror=tmp_path)
    assert code_of(exc) == ("asset-source-unknown", asset_files.EXIT_SOURCE)


def test_a_changed_revision_is_noticed_and_switched_whole(places, tmp_path):
    mirror = published(tmp_path, weights=b"weights-1")
    first = assets.fetch("model", MODEL, "r1", "mirror", mirror=mirror)
    # The same revision name now holds other content (a branch that moved).
    assets.publish("model", MODEL, "r1", model_dir(tmp_path / "src2", b"weights-2"), mirror)
    check = assets.fetch("model", MODEL, "r1", "mirror", mirror=mirror, check=True)
    assert (check["changed"], check["action"]) == (True, "would-replace")
    place = Path(first["path"])
    assert (place / "model.safetensors").read_bytes() == b"weights-1"
    second = assets.fetch("model", MODEL, "r1", "mirror", mirror=mirror)
    assert (second["changed"], second["action"]) == (True, "replaced")
    assert second["previous_digest"] == first["digest"] != second["digest"]
    assert (place / "model.safetensors").read_bytes() == b"weights-2"
    # Only the copy the link names is kept.
    assert sorted(p.name for p in place.parent.iterdir()) == [".r1+copies", "r1"]
    assert [p.name for p in assets.copies_of(place).iterdir()] == [second["digest"][:16]]


def test_an_interrupted_copy_leaves_the_old_one(places, tmp_path, monkeypatch):
    mirror = published(tmp_path, weights=b"weights-1")
    first = assets.fetch("model", MODEL, "r1", "mirror", mirror=mirror)
    assets.publish("model", MODEL, "r1", model_dir(tmp_path / "src2", b"weights-2"), mirror)
    copied = []
    real_copy = assets.shutil.copyfile

    def dies_midway(src, dst):
        if copied:
            raise KeyboardInterrupt  # the run is killed after one file
        copied.append(src)
        return real_copy(src, dst)

    monkeypatch.setattr(assets.shutil, "copyfile", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        assets.fetch("model", MODEL, "r1", "mirror", mirror=mirror)
    place = Path(first["path"])
    assert (place / "model.safetensors").read_bytes() == b"weights-1"
    assert assets.verify_placed(place) == [] and stagings(place) == []
    # A staging dir a hard kill left behind goes at the next run.
    monkeypatch.setattr(assets.shutil, "copyfile", real_copy)
    (assets.copies_of(place) / ".staging-killed").mkdir()
    assert assets.fetch("model", MODEL, "r1", "mirror", mirror=mirror)["action"] == "replaced"
    assert stagings(place) == []


def test_a_placed_file_changed_by_hand_is_placed_again(places, tmp_path):
    mirror = published(tmp_path)
    place = Path(assets.fetch("model", MODEL, "r1", "mirror", mirror=mirror)["path"])
    target = place.resolve() / "model.safetensors"
    target.chmod(0o644)
    target.write_bytes(b"edited")  # another size: noticed without hashing
    assert assets.verify_placed(place) != []
    assert assets.fetch("model", MODEL, "r1", "mirror", mirror=mirror)["action"] == "replaced"
    assert (place / "model.safetensors").read_bytes() == b"weights-1"
    # The record damaged, the content the same: a new copy beside the live one, then switched.
    (place.resolve() / asset_files.MANIFEST).chmod(0o644)
    (place.resolve() / asset_files.MANIFEST).write_text("{")
    live = place.resolve()
    assert assets.fetch("model", MODEL, "r1", "mirror", mirror=mirror)["action"] == "replaced"
    assert place.resolve() != live and not live.exists() and assets.verify_placed(place) == []


def test_publish_is_idempotent(tmp_path):
    src = model_dir(tmp_path / "src")
    assert assets.publish("model", MODEL, "r1", src, tmp_path / "mirror")["changed"] is True
    assert assets.publish("model", MODEL, "r1", src, tmp_path / "mirror")["changed"] is False
    (src / "config.json").write_text('{"model_type": "llama"}')
    assert assets.publish("model", MODEL, "r1", src, tmp_path / "mirror")["changed"] is True


# --- a job's model and data set ---


def test_place_job_fetches_and_prepares(places, tmp_path):
    mirror = published(tmp_path)
    assets.publish("dataset", DATASET, "v1", gsm8k_dir(tmp_path / "raw"), mirror)
    doc = assets.place_job(MODEL, "r1", DATASET, "v1", source="mirror", mirror=mirror)
    assert doc["changed"] and [a["action"] for a in doc["assets"]] == ["placed"] * 3
    train, val = asset_files.job_paths("dataset", DATASET, "v1")
    import pyarrow.parquet as pq

    assert pq.read_table(train).num_rows == 6 and pq.read_table(val).num_rows == 6
    assert pq.read_table(train).column("data_source").to_pylist()[0] == data.DATA_SOURCE
    again = assets.place_job(MODEL, "r1", DATASET, "v1", source="mirror", mirror=mirror)
    assert not again["changed"], again
    # A new revision of the data set's content: fetched and prepared again.
    assets.publish("dataset", DATASET, "v1", gsm8k_dir(tmp_path / "raw2", rows=4), mirror)
    check = assets.place_job("", "main", DATASET, "v1", source="mirror", mirror=mirror, check=True)
    assert [a["action"] for a in check["assets"]] == ["would-replace", "would-prepare"]
    third = assets.place_job("", "main", DATASET, "v1", source="mirror", mirror=mirror)
    assert [a["action"] for a in third["assets"]] == ["replaced", "replaced"]
    assert pq.read_table(train).num_rows == 4


def test_data_placed_prepares_from_the_placed_copy(places, tmp_path, capsys):
    from oldgpu import cli

    mirror = tmp_path / "mirror"
    assets.publish("dataset", DATASET, "v1", gsm8k_dir(tmp_path / "raw", rows=3), mirror)
    assert cli.main(["data", "placed", DATASET, "--revision", "v1", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == "data-source-unplaced"
    assets.fetch("dataset", DATASET, "v1", "mirror", mirror=mirror)
    assert cli.main(["data", "placed", DATASET, "--revision", "v1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["action"], doc["rows"]) == ("placed", {"train": 3, "test": 3})
    assert cli.main(["data", "placed", DATASET, "--revision", "v1", "--json", "--check"]) == 0
    assert json.loads(capsys.readouterr().out)["changed"] is False


def test_prepare_refuses_a_data_source_it_does_not_know(places, tmp_path):
    mirror = tmp_path / "mirror"
    assets.publish("dataset", DATASET, "v1", gsm8k_dir(tmp_path / "raw"), mirror)
    with pytest.raises(EngineError) as exc:
        assets.place_job(dataset=DATASET, dataset_revision="v1", data_source="lighteval/MATH",
                         source="mirror", mirror=mirror)  # fmt: skip
    assert exc.value.name == "data-recipe-unknown"


def test_find_split_prefers_the_main_config(tmp_path):
    for config in ("main", "socratic"):
        (tmp_path / config).mkdir()
        (tmp_path / config / "train-00000-of-00001.parquet").write_bytes(b"PAR1")
    assert data.find_split(tmp_path, "train") == [tmp_path / "main/train-00000-of-00001.parquet"]
    with pytest.raises(EngineError, match="data-split-missing"):
        data.find_split(tmp_path, "test")


# --- job fields ---

BASE = {"name": "j", "total_steps": 2, "profile": "cpu"}


def test_a_job_names_its_model_and_data_set_by_id():
    job = jobs.job_from_mapping(
        {**BASE, "model": MODEL, "model_revision": "r1", "dataset": DATASET}
    )
    assert job.model_path == str(paths.MODELS_DIR / MODEL / "r1")
    assert job.train_files == str(paths.PREPARED_DIR / DATASET / "main" / "train.parquet")
    assert job.val_files == str(paths.PREPARED_DIR / DATASET / "main" / "test.parquet")
    assert jobs.job_from_env(jobs.parse_env(jobs.render_env(job))) == job


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ({"dataset": DATASET}, "job-config-invalid"),  # no model, no model_path
        ({"model": MODEL}, "job-config-invalid"),  # no data set, no train_files
        ({"model": MODEL, "model_path": "/srv/m", "dataset": DATASET}, "job-asset-twice"),
        ({"model": "../x", "dataset": DATASET}, "job-config-invalid"),
        ({"model": MODEL, "dataset": DATASET, "dataset_revision": "a/b"}, "job-config-invalid"),
    ],
)
def test_a_job_names_each_asset_once(extra, error):
    with pytest.raises(EngineError) as exc:
        jobs.job_from_mapping({**BASE, **extra})
    assert exc.value.name == error and exc.value.code == 4


# --- the hub (huggingface_hub's API, answered here from a local directory) ---


class FakeHub:
    """huggingface_hub's repo_info and snapshot_download over a directory."""

    def __init__(self, files: Path, commit: str, lfs: dict[str, str]):
        self.files, self.commit, self.lfs, self.downloads = files, commit, lfs, 0

    def module(self) -> types.ModuleType:
        hub = self

        class HfApi:
            def __init__(self, endpoint=None, token=None):
                assert endpoint == "http://mirror.lab.example" and token == "tok"

            def repo_info(self, repo_id, repo_type, revision, files_metadata):
                siblings = []
                for p in sorted(hub.files.iterdir()):
                    lfs = {"sha256": hub.lfs[p.name]} if p.name in hub.lfs else None
                    blob = None if lfs else asset_files.git_blob_id(p)
                    siblings.append(types.SimpleNamespace(rfilename=p.name, lfs=lfs, blob_id=blob))
                return types.SimpleNamespace(sha=hub.commit, siblings=siblings)

        def snapshot_download(repo_id, repo_type, revision, local_dir, endpoint, token):
            assert revision == hub.commit  # the commit asked about, not the branch
            hub.downloads += 1
            for p in hub.files.iterdir():
                (Path(local_dir) / p.name).write_bytes(p.read_bytes())
            (Path(local_dir) / ".cache" / "huggingface").mkdir(parents=True)

        return types.SimpleNamespace(HfApi=HfApi, snapshot_download=snapshot_download)


def test_hub_fetch_checks_lfs_sha_and_knows_the_commit(places, tmp_path, monkeypatch):
    files = model_dir(tmp_path / "hubfiles")
    good = {"model.safetensors": hashlib.sha256(b"weights-1").hexdigest()}
    hub = FakeHub(files, "a" * 40, good)
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub.module())
    opts = {"endpoint": "http://mirror.lab.example", "token": "tok"}
    doc = assets.fetch("model", MODEL, "main", "hub", **opts)
    assert (doc["action"], doc["commit"]) == ("placed", "a" * 40)
    place = Path(doc["path"])
    assert not (place / ".cache").exists()
    # The same commit: nothing downloaded.
    assert assets.fetch("model", MODEL, "main", "hub", **opts)["action"] == "unchanged"
    assert hub.downloads == 1
    # The branch moved, and the hub states a hash the download does not have.
    hub.commit, hub.lfs = "b" * 40, {"model.safetensors": "0" * 64}
    with pytest.raises(EngineError) as exc:
        assets.fetch("model", MODEL, "main", "hub", **opts)
    assert code_of(exc) == ("asset-sha-mismatch", asset_files.EXIT_SHA)
    assert json.loads((place / asset_files.MANIFEST).read_text())["commit"] == "a" * 40
    # A file outside LFS whose git blob id differs.
    hub.lfs = good
    real = FakeHub.module

    def corrupting(self):
        mod = real(self)
        inner = mod.snapshot_download

        def download(*a, **k):
            inner(*a, **k)
            (Path(k["local_dir"]) / "config.json").write_text("{}")

        return types.SimpleNamespace(HfApi=mod.HfApi, snapshot_download=download)

    monkeypatch.setitem(sys.modules, "huggingface_hub", corrupting(hub))
    with pytest.raises(EngineError) as exc:
        assets.fetch("model", MODEL, "main", "hub", **opts)
    assert code_of(exc) == ("asset-sha-mismatch", asset_files.EXIT_SHA)
    assert "config.json" in exc.value.message


# --- the command line ---


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "oldgpu", *args], capture_output=True, text=True,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}, check=False,
    )  # fmt: skip


def test_cli_reports_changed_and_named_errors(tmp_path):
    mirror = published(tmp_path)
    out = cli("assets", "fetch", "--json", "model", MODEL, "--revision", "r1", "--mirror",
              str(mirror), "--check")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["changed"] is True
    missing = cli("assets", "fetch", "--json", "model", MODEL, "--revision", "r9", "--mirror",
                  str(mirror))  # fmt: skip
    assert missing.returncode == asset_files.EXIT_REVISION
    assert json.loads(missing.stdout)["error"] == "asset-revision-missing"
    assert "Traceback" not in missing.stderr
