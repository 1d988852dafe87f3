"""Jobs on several GPUs of one box: the cards chosen, the plan for them, CUDA's and NCCL's settings.

``oldgpu job command`` runs as the start script runs it, on recorded nvidia-smi
and topology outputs (tests/data/topology: a 4xP40 box behind one switch, the
same box with ACS on, an 8xP40 box across two sockets; tests/data/detect: a
P40 + V100 host).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from conftest import QWEN05B_CONFIG, job_spec

from oldgpu import cli, jobs, profile
from oldgpu.output import EngineError

ROOT = Path(__file__).resolve().parents[1]
TOPO = ROOT / "tests/data/topology"
DETECT = ROOT / "tests/data/detect"

BOXES = {  # nvidia-smi lines, topo -m, topo -p2p r
    "4xp40": ("4xp40.nvidia-smi.csv", "4xp40-switch"),
    "4xp40-acs": ("4xp40.nvidia-smi.csv", "4xp40-acs"),
    "8xp40": ("8xp40.nvidia-smi.csv", "8xp40-2socket"),
}
CUDA_KEYS = {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"}
NCCL_KEYS = {"NCCL_P2P_DISABLE", "NCCL_IB_DISABLE"}


def env_file(job_dir: Path, **extra) -> Path:
    path = job_dir / "gsm8k.env"
    path.write_text(jobs.render_env(jobs.job_from_mapping(job_spec(job_dir, **extra))))
    return path


def box_args(box: str, ib_dir: Path) -> list[str]:
    smi, topo = BOXES[box]
    return [
        "--nvidia-smi-file",
        str(TOPO / smi),
        "--topo-file",
        str(TOPO / f"{topo}.topo-m.txt"),
        "--p2p-file",
        str(TOPO / f"{topo}.topo-p2p-r.txt"),
        "--ib-dir",
        str(ib_dir),
    ]


def command(capsys, job_dir: Path, args: list[str], **extra) -> tuple[int, dict]:
    path = env_file(job_dir, **extra)
    code = cli.main(["job", "command", "--env-file", str(path), "--json", *args])
    return code, json.loads(capsys.readouterr().out or "{}")


def overrides(doc: dict) -> dict[str, str]:
    return {jobs.override_key(o): o.split("=", 1)[1] for o in doc["argv"][2:]}


@pytest.fixture
def no_ib(tmp_path) -> Path:
    return tmp_path / "no-infiniband"  # absent: no verbs device


def test_two_of_four_p40s_behind_one_switch(capsys, job_dir, no_ib):
    code, doc = command(capsys, job_dir, box_args("4xp40", no_ib), gpus=2)
    assert code == 0, doc
    o = overrides(doc)
    assert doc["devices"] == [0, 1]
    assert o["trainer.n_gpus_per_node"] == "2"
    assert doc["plan"]["inputs"]["gpus"] == 2
    assert doc["profile"].startswith("pascal") and doc["memory_mib"] == 24576
    env = doc["environment"]
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    # P2P reads OK behind the switch: NCCL keeps P2P; no verbs device: no IB.
    assert "NCCL_P2P_DISABLE" not in env
    assert env["NCCL_IB_DISABLE"] == "1"


def test_all_four_p40s(capsys, job_dir, no_ib):
    code, doc = command(capsys, job_dir, box_args("4xp40", no_ib), gpus="all")
    assert code == 0, doc
    assert overrides(doc)["trainer.n_gpus_per_node"] == "4"
    assert doc["plan"]["inputs"]["gpus"] == 4
    assert doc["environment"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert "NCCL_P2P_DISABLE" not in doc["environment"]
    # FSDP over 4 shards the states: the plan per GPU is not the one-GPU plan.
    _, one = command(capsys, job_dir, box_args("4xp40", no_ib), gpus=1)
    assert one["plan"]["inputs"]["gpus"] == 1
    assert one["plan"]["estimate"] != doc["plan"]["estimate"]


def test_cards_across_sockets_disable_p2p(capsys, job_dir, tmp_path):
    ib = tmp_path / "infiniband"
    (ib / "mlx5_0").mkdir(parents=True)  # the box's ConnectX
    code, doc = command(capsys, job_dir, box_args("8xp40", ib), gpus=2, devices=[0, 4])
    assert code == 0, doc
    assert doc["devices"] == [0, 4]
    assert overrides(doc)["trainer.n_gpus_per_node"] == "2"
    env = doc["environment"]
    assert env["CUDA_VISIBLE_DEVICES"] == "0,4"
    assert env["NCCL_P2P_DISABLE"] == "1"  # GPU0-GPU4 is SYS, P2P read CNS
    assert "NCCL_IB_DISABLE" not in env  # a verbs device is there
    # Two cards of one socket read each other OK: P2P stays on.
    code, doc = command(capsys, job_dir, box_args("8xp40", ib), gpus=2, devices=[4, 5])
    assert code == 0 and "NCCL_P2P_DISABLE" not in doc["environment"]


def test_broken_p2p_box_disables_p2p(capsys, job_dir, no_ib):
    code, doc = command(capsys, job_dir, box_args("4xp40-acs", no_ib), gpus="all")
    assert code == 0, doc
    assert doc["environment"]["NCCL_P2P_DISABLE"] == "1"
    assert doc["environment"]["NCCL_IB_DISABLE"] == "1"


def test_more_gpus_than_the_host_has_is_refused(capsys, job_dir, no_ib):
    path = env_file(job_dir, gpus=5)
    code = cli.main(["job", "command", "--env-file", str(path), *box_args("4xp40", no_ib)])
    assert code == jobs.CONFIG_INVALID == 4
    assert "gpus-exceed-host" in capsys.readouterr().err
    # The same refusal from the function the start script's command calls.
    job = jobs.job_from_env(jobs.parse_env(path.read_text()))
    smi, _ = BOXES["4xp40"]
    args = argparse.Namespace(nvidia_smi_file=str(TOPO / smi), topo_file=None, ib_dir=str(no_ib))
    with pytest.raises(EngineError) as err:
        jobs.compose_for_host(job, environ={}, args=args)
    assert err.value.name == "gpus-exceed-host" and err.value.code == 4


MIXED = ["--nvidia-smi-file", str(DETECT / "p40-v100.nvidia-smi.csv"), "--lspci-file",
         str(DETECT / "p40-v100.lspci.txt")]  # fmt: skip


def test_mixed_host_runs_one_profile(capsys, job_dir):
    code, doc = command(capsys, job_dir, MIXED, gpus=1)
    assert code == 0, doc
    # The newest profile with enough cards: the V100, its memory, no NCCL for one GPU.
    assert doc["devices"] == [1]
    assert doc["profile"].startswith("volta") and doc["memory_mib"] == 32768
    assert doc["environment"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert not NCCL_KEYS & set(doc["environment"])
    code, doc = command(capsys, job_dir, MIXED, gpus=1, devices=[0])
    assert code == 0 and doc["profile"].startswith("pascal") and doc["memory_mib"] == 24576
    assert doc["environment"]["CUDA_VISIBLE_DEVICES"] == "0"


@pytest.mark.parametrize(
    ("extra", "name"),
    [
        ({"gpus": 2, "devices": [0, 1]}, "devices-mixed-profiles"),
        ({"gpus": "all"}, "gpus-all-mixed-host"),
        ({"gpus": 2}, "gpus-exceed-profile"),
        ({"gpus": 1, "devices": [7]}, "device-unknown"),
    ],
)
def test_mixed_host_refusals(capsys, job_dir, extra, name):
    path = env_file(job_dir, **extra)
    code = cli.main(["job", "command", "--env-file", str(path), *MIXED])
    assert code == 4
    assert name in capsys.readouterr().err


def test_cpu_job_gets_no_device_settings(capsys, job_dir):
    tiny = {**QWEN05B_CONFIG, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 2048}  # fmt: skip
    (job_dir / "model/config.json").write_text(json.dumps(tiny))
    code, doc = command(capsys, job_dir, MIXED, profile="cpu", train_batch_size=4)
    assert code == 0, doc
    assert doc["devices"] is None
    assert overrides(doc)["trainer.n_gpus_per_node"] == "1"
    assert not (CUDA_KEYS | NCCL_KEYS) & set(doc["environment"])


def test_one_gpu_job_without_host_facts_composes_as_before(job_dir):
    # compose() without chosen cards (the pre-existing call): the job's count, no CUDA variables.
    job = jobs.job_from_env(jobs.parse_env(env_file(job_dir).read_text()))
    prof = profile.profile_for_arch("pascal", "6.1")
    doc = jobs.compose(job, prof, 24576, QWEN05B_CONFIG, environ={})
    assert overrides(doc)["trainer.n_gpus_per_node"] == "1" and doc["devices"] is None
    assert not (CUDA_KEYS | NCCL_KEYS) & set(doc["environment"])
    all_job = jobs.job_from_env(jobs.parse_env(env_file(job_dir, gpus="all").read_text()))
    with pytest.raises(EngineError) as err:
        jobs.compose(all_job, prof, 24576, QWEN05B_CONFIG, environ={})
    assert err.value.name == "gpus-all-needs-host"


@pytest.mark.parametrize(
    ("values", "name"),
    [
        ({"gpus": 0}, "gpus-invalid"),
        ({"gpus": "most"}, "gpus-invalid"),
        ({"gpus": 1.5}, "gpus-invalid"),
        ({"devices": "0,1"}, "devices-invalid"),
        ({"devices": [0, 0]}, "devices-invalid"),
        ({"devices": [-1]}, "devices-invalid"),
        ({"devices": [True]}, "devices-invalid"),
    ],
)
def test_bad_gpu_settings_are_named(job_dir, values, name):
    with pytest.raises(EngineError) as err:
        env_file(job_dir, **values)
    assert err.value.name == name and err.value.code == 4


def test_gpu_settings_round_trip_through_the_env_file(job_dir):
    path = env_file(job_dir, gpus="all", devices=[4, 5])
    text = path.read_text()
    assert "VERL_JOB_GPUS='all'" in text and "VERL_JOB_DEVICES='[4, 5]'" in text
    job = jobs.job_from_env(jobs.parse_env(text))
    assert job.gpus == "all" and job.devices == (4, 5)
    assert jobs.job_from_env(jobs.parse_env(env_file(job_dir).read_text())).gpus == 1
