"""A fleet's hosts and a cluster job: facts and drift, the live cluster's checks, and the
command and environment of a job that joins a Ray cluster (`oldgpu job command` on
recorded nvidia-smi output and recorded ``ray.nodes()``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import QWEN05B_CONFIG

from oldgpu import cli, fleet, jobs
from oldgpu.output import EngineError

ROOT = Path(__file__).resolve().parents[1]
TOPO = ROOT / "tests/data/topology"
TREE, LOCK = "a" * 16, "b" * 16


def node(address: str, gpus: int, tree: str = TREE, lock: str = LOCK, alive: bool = True) -> dict:
    resources = {"CPU": 8.0, f"oldgpu_tree_{tree}": 1.0, f"oldgpu_lock_{lock}": 1.0}
    if gpus:
        resources.update(GPU=float(gpus), pascal=float(gpus))
    return {"Alive": alive, "NodeManagerAddress": address, "Resources": resources}


LOCAL = {"tree": TREE, "lock": LOCK}


# -- facts and drift ----------------------------------------------------------------


def test_facts_hash_the_tree_manifest_and_name_the_venv(tmp_path):
    tree = tmp_path / "trees/abc-pascal"
    tree.mkdir(parents=True)
    (tree / ".oldgpu-patch.json").write_bytes(b'{"schema": 1}')
    (tmp_path / "verl").symlink_to(tree)
    venv = tmp_path / "venvs/0123456789abcdef"
    venv.mkdir(parents=True)
    (tmp_path / "venv").symlink_to(venv)
    gpus = [
        {"index": 0, "source": "nvidia-smi", "name": "Tesla P40", "driver_version": "580.65.06"},
        {"index": None, "source": "lspci", "name": "Tesla P40", "driver_version": None},
    ]
    got = fleet.facts(gpus, tmp_path / "verl", tmp_path / "venv")
    assert got["gpus"] == 1 and got["driver"] == "580.65.06"
    assert got["lock"] == "0123456789abcdef"
    assert len(got["tree"]) == 16
    # Another manifest, another hash.
    (tree / ".oldgpu-patch.json").write_bytes(b'{"schema": 1, "x": 2}')
    assert fleet.facts(gpus, tmp_path / "verl", tmp_path / "venv")["tree"] != got["tree"]
    assert fleet.labels(got) == {f"oldgpu_lock_{got['lock']}": 1, f"oldgpu_tree_{got['tree']}": 1}


def test_a_host_without_tree_or_venv_has_none(tmp_path):
    got = fleet.facts([], tmp_path / "verl", tmp_path / "venv")
    assert (got["tree"], got["lock"], got["driver"], got["gpus"]) == (None, None, None, 0)
    assert fleet.labels(got) == {}


def test_drift_names_the_host_that_differs():
    same = {"driver": "580.65.06", "lock": LOCK, "tree": TREE}
    hosts = {
        "p40-01": same,
        "p40-02": same,
        "p40-03": {**same, "driver": "580.82.07"},
        "p40-04": {**same, "tree": "c" * 16},
    }
    doc = fleet.drift(hosts)
    assert doc["drift"] is True
    assert doc["hosts"] == {"p40-01": [], "p40-02": [], "p40-03": ["driver"], "p40-04": ["tree"]}
    assert doc["keys"]["driver"] == {"common": "580.65.06", "differ": {"p40-03": "580.82.07"}}
    assert fleet.drift({"a": same, "b": same})["drift"] is False


def test_cli_drift_reads_the_hosts_facts(capsys, tmp_path):
    path = tmp_path / "facts.json"
    path.write_text(json.dumps({"a": {"lock": "1"}, "b": {"lock": "1"}, "c": {"lock": "2"}}))
    assert cli.main(["fleet", "drift", "--json", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["hosts"]["c"] == ["lock"]
    path.write_text("[1, 2]")
    assert cli.main(["fleet", "drift", "--json", str(path)]) == 4
    assert json.loads(capsys.readouterr().out)["error"] == "fleet-facts-invalid"


# -- the live cluster's checks ---------------------------------------------------------


def test_a_cluster_of_equal_nodes():
    nodes = [node("10.0.0.1", 4), node("10.0.0.2", 4), node("10.0.0.3", 4)]
    assert fleet.check_cluster(nodes, 2, 3, LOCAL) == {"nnodes": 3, "n_gpus_per_node": 2}
    assert fleet.check_cluster(nodes, None, 3, LOCAL) == {"nnodes": 3, "n_gpus_per_node": 4}


def test_a_head_without_gpus_only_coordinates():
    nodes = [node("10.0.0.1", 0), node("10.0.0.2", 1), node("10.0.0.3", 1)]
    assert fleet.check_cluster(nodes, 1, 3, LOCAL) == {"nnodes": 2, "n_gpus_per_node": 1}


@pytest.mark.parametrize(
    ("nodes", "gpus", "expected", "error", "words"),
    [
        ([node("h", 4), node("w", 2)], 2, 2, "cluster-gpus-unequal", "h: 4, w: 2"),
        ([node("h", 4), node("w", 4)], 8, 2, "cluster-gpus-exceed-node", "asks for 8"),
        ([node("h", 4), node("w", 4, tree="c" * 16)], 1, 2, "cluster-tree-differs", "node(s) w"),
        ([node("h", 4), node("w", 4, lock="d" * 16)], 1, 2, "cluster-lock-differs", "venv lock"),
        ([node("h", 0), node("w", 0)], 1, 2, "cluster-no-gpus", "no node"),
    ],
)
def test_refusals(nodes, gpus, expected, error, words):
    with pytest.raises(EngineError) as err:
        fleet.check_cluster(nodes, gpus, expected, LOCAL)
    assert err.value.name == error and err.value.code == 4
    assert words in err.value.message


# A node that has not joined (yet): the job's unit tries again, unlike the refusals above.
@pytest.mark.parametrize(
    ("nodes", "words"),
    [([node("h", 4), node("w", 4, alive=False)], "1 live"), ([node("h", 4)], "names 2")],
)
def test_a_missing_node_is_named_and_retryable(nodes, words):
    with pytest.raises(EngineError) as err:
        fleet.check_cluster(nodes, 1, 2, LOCAL)
    assert err.value.name == "cluster-nodes-missing" and err.value.code == 5
    assert words in err.value.message


def test_a_host_without_hashes_cannot_be_compared():
    with pytest.raises(EngineError) as err:
        fleet.check_cluster([node("h", 1)], 1, 1, {"tree": None, "lock": LOCK})
    assert err.value.name == "cluster-tree-unknown"


def fake_python(tmp_path: Path, body: str) -> str:
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\nimport sys\n{body}\n")
    script.chmod(0o755)
    return str(script)


def test_live_nodes_asks_the_venvs_ray(tmp_path):
    python = fake_python(
        tmp_path,
        "assert sys.argv[1] == '-c' and 'ray.nodes()' in sys.argv[2]\n"
        "print('some ray log line')\n"
        'print(\'[{"Alive": true, "NodeManagerAddress": "%s", "Resources": {}}]\''
        " % sys.argv[3])",
    )
    assert fleet.live_nodes("10.0.0.1:6379", python) == [
        {"Alive": True, "NodeManagerAddress": "10.0.0.1:6379", "Resources": {}}
    ]


def test_a_head_that_does_not_answer_is_named(tmp_path):
    python = fake_python(
        tmp_path,
        "print('ConnectionError: Could not find any running Ray instance', file=sys.stderr)"
        "\nsys.exit(1)",
    )
    with pytest.raises(EngineError) as err:
        fleet.live_nodes("10.0.0.9:6379", python)
    assert err.value.name == "ray-head-unreachable" and err.value.code == 5
    assert "10.0.0.9:6379" in err.value.message and "Could not find" in err.value.message
    slow = fake_python(tmp_path, "import time; time.sleep(30)")
    with pytest.raises(EngineError) as err:
        fleet.live_nodes("10.0.0.9:6379", slow, timeout_s=1)
    assert "no answer in 1 s" in err.value.message


# -- a cluster job's command ---------------------------------------------------------------


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A job's files and this host's tree and venv (what the start script points at)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN05B_CONFIG))
    for name in ("train.parquet", "test.parquet"):
        (tmp_path / name).write_bytes(b"PAR1")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / ".oldgpu-patch.json").write_bytes(b"{}")
    venv = tmp_path / "venvs" / LOCK
    venv.mkdir(parents=True)
    monkeypatch.setenv("VERL_DIR", str(tree))
    monkeypatch.setenv("VERL_VENV", str(venv))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path


TINY = {  # the smoke model's shape: a cpu job fits any test machine's memory
    **QWEN05B_CONFIG,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 128,
    "vocab_size": 1024,
}


def job_command(capsys, host: Path, nodes: list[dict], args: list[str], **extra):
    values = {
        "name": "gsm8k",
        "model_path": str(host / "model"),
        "train_files": str(host / "train.parquet"),
        "val_files": str(host / "test.parquet"),
        "total_steps": 10,
        "cluster": "lab",
        "cluster_address": "10.0.0.1:6379",
        "cluster_nodes": len(nodes),
        **extra,
    }
    env = host / "gsm8k.env"
    env.write_text(jobs.render_env(jobs.job_from_mapping(values)))
    recorded = host / "nodes.json"
    recorded.write_text(json.dumps(nodes))
    argv = ["job", "command", "--env-file", str(env), "--json"]
    code = cli.main([*argv, "--cluster-nodes-file", str(recorded), *args])
    return code, json.loads(capsys.readouterr().out or "{}")


def tree_of(host: Path) -> str:
    return fleet.tree_hash(host / "tree")


def overrides(doc: dict) -> dict[str, str]:
    return {jobs.override_key(o): o.split("=", 1)[1] for o in doc["argv"][2:]}


def test_cpu_job_over_two_workers_and_a_coordinating_head(capsys, host):
    t = tree_of(host)
    nodes = [node("10.0.0.1", 0, tree=t), node("10.0.0.2", 1, tree=t), node("10.0.0.3", 1, tree=t)]
    (host / "model/config.json").write_text(json.dumps(TINY))
    code, doc = job_command(
        capsys,
        host,
        nodes,
        [],
        profile="cpu",
        prompt_length=128,
        response_length=16,
        train_batch_size=4,
    )
    assert code == 0, doc
    o = overrides(doc)
    assert (o["trainer.nnodes"], o["trainer.n_gpus_per_node"]) == ("2", "1")
    assert doc["plan"]["inputs"]["gpus"] == 1  # one worker in each node's memory
    assert doc["cluster"] == {"address": "10.0.0.1:6379", "nnodes": 2, "n_gpus_per_node": 1}
    # verl gives each of the 2 workers half of each mini batch: the micro batches divide it.
    mini = int(o["actor_rollout_ref.actor.ppo_mini_batch_size"])
    for key, value in o.items():
        if key.endswith("micro_batch_size_per_gpu"):
            assert (mini // 2) % int(value) == 0, (key, value, mini)
    env = doc["environment"]
    assert env["RAY_ADDRESS"] == "10.0.0.1:6379"
    assert env["RAY_TMPDIR"] == "/var/lib/verl/ray"
    workers = json.loads(env["RAY_JOB_CONFIG_JSON_ENV_VAR"])["runtime_env"]["env_vars"]
    # The profile's variables, the patched tree and the job's paths reach every worker.
    assert workers["PYTHONPATH"] == os.environ["VERL_DIR"]
    assert workers["OLDGPU_COMPUTE_DTYPE"] == env["OLDGPU_COMPUTE_DTYPE"] == "fp32"
    assert workers["HF_HUB_OFFLINE"] == workers["PYTHONUNBUFFERED"] == "1"
    assert workers["TENSORBOARD_DIR"] == env["TENSORBOARD_DIR"]
    assert "RAY_ADDRESS" not in workers and "RAY_TMPDIR" not in workers


def test_gpu_job_over_two_4xp40_boxes(capsys, host, tmp_path):
    t = tree_of(host)
    nodes = [node("10.0.0.1", 4, tree=t), node("10.0.0.2", 4, tree=t)]
    recorded = [
        "--nvidia-smi-file", str(TOPO / "4xp40.nvidia-smi.csv"),
        "--topo-file", str(TOPO / "4xp40-acs.topo-m.txt"),
        "--p2p-file", str(TOPO / "4xp40-acs.topo-p2p-r.txt"),
        "--ib-dir", str(tmp_path / "no-ib"),
    ]  # fmt: skip
    code, doc = job_command(capsys, host, nodes, recorded, gpus="all")
    assert code == 0, doc
    o = overrides(doc)
    assert (o["trainer.nnodes"], o["trainer.n_gpus_per_node"]) == ("2", "4")
    assert doc["plan"]["inputs"]["gpus"] == 8
    assert doc["profile"].startswith("pascal")
    env = doc["environment"]
    # Ray gives each worker its card; NCCL's settings travel to every node.
    assert "CUDA_VISIBLE_DEVICES" not in env
    workers = json.loads(env["RAY_JOB_CONFIG_JSON_ENV_VAR"])["runtime_env"]["env_vars"]
    assert workers["NCCL_P2P_DISABLE"] == "1" and workers["NCCL_IB_DISABLE"] == "1"


@pytest.mark.parametrize(
    ("gpus", "nodes", "error"),
    [
        (1, lambda t: [node("a", 4, tree=t), node("b", 2, tree=t)], "cluster-gpus-unequal"),
        (8, lambda t: [node("a", 8, tree=t), node("b", 8, tree=t)], "gpus-exceed-host"),
        (1, lambda t: [node("a", 4, tree=t), node("b", 4)], "cluster-tree-differs"),
        (1, lambda t: [node("a", 4, tree=t), node("b", 4, tree=t, lock="e" * 16)],
         "cluster-lock-differs"),
    ],
)  # fmt: skip
def test_cluster_jobs_are_refused_before_verl_starts(capsys, host, gpus, nodes, error):
    smi = ["--nvidia-smi-file", str(TOPO / "4xp40.nvidia-smi.csv")]
    code, doc = job_command(capsys, host, nodes(tree_of(host)), smi, gpus=gpus)
    assert (code, doc["error"]) == (4, error), doc


def test_a_cluster_job_needs_its_address_and_nodes():
    base = {"name": "j", "model_path": "/m", "train_files": "/t", "val_files": "/v"}
    for extra, words in (
        ({"cluster": "lab"}, "cluster_address"),
        ({"cluster": "lab", "cluster_address": "h:6379"}, "cluster_nodes"),
        ({"cluster": "Lab!", "cluster_address": "h:6379", "cluster_nodes": 2}, "cluster:"),
        ({"cluster_address": "h:6379"}, "belong to a job with a cluster"),
    ):
        with pytest.raises(EngineError) as err:
            jobs.job_from_mapping({**base, "total_steps": 1, **extra})
        assert err.value.name == "job-config-invalid" and words in err.value.message
