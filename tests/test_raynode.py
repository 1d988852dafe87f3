"""A host as a Ray node: resources from the detected GPUs, the `ray start` its unit runs,
the env file the role writes, the bounded wait for the head, and the two unit files."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from oldgpu import cli, detect, paths, raynode
from oldgpu.output import EngineError

ROOT = Path(__file__).resolve().parents[1]
DETECT = ROOT / "tests/data/detect"
TOPO = ROOT / "tests/data/topology"
UNITS = {name: ROOT / "files/systemd" / name for name in ("ray-head.service", "ray-worker.service")}
JOB_UNIT = ROOT / "files/systemd/verl-train@.service"
SCRIPT = ROOT / "files/bin/ray-node"
ROLE = ROOT / "roles/ray_cluster"


def gpus(smi: Path | None = None, lspci: Path | None = None) -> list[dict]:
    return detect.detect(
        smi.read_text() if smi else None,
        lspci.read_text() if lspci else None,
        ROOT / "tests/data/pci.ids.excerpt",
        run_tools=False,
    )["gpus"]


@pytest.mark.parametrize(
    ("smi", "num_gpus", "labels"),
    [
        (TOPO / "4xp40.nvidia-smi.csv", 4, {"pascal": 4}),
        (TOPO / "8xp40.nvidia-smi.csv", 8, {"pascal": 8}),
        (DETECT / "p40-v100.nvidia-smi.csv", 2, {"pascal": 1, "volta": 1}),
        (DETECT / "v100.nvidia-smi.csv", 1, {"volta": 1}),
        (DETECT / "t4.nvidia-smi.csv", 1, {"turing": 1}),
    ],
)
def test_resources_count_gpus_and_label_each_architecture(smi, num_gpus, labels):
    res = raynode.resources(gpus(smi))
    assert res["num_gpus"] == num_gpus
    assert res["resources"] == labels
    assert res["gpu_indices"] == list(range(num_gpus))


def test_cards_without_a_driver_are_no_ray_gpus():
    # lspci sees a P40, nvidia-smi does not answer: Ray could not use it.
    assert gpus(lspci=DETECT / "p40.lspci.txt")
    assert raynode.resources(gpus(lspci=DETECT / "p40.lspci.txt")) == {
        "num_gpus": 0,
        "resources": {},
        "gpu_indices": [],
    }


def test_cli_resources_reads_recorded_nvidia_smi(capsys):
    smi = str(TOPO / "4xp40.nvidia-smi.csv")
    assert cli.main(["ray-node", "resources", "--json", "--nvidia-smi-file", smi]) == 0
    assert json.loads(capsys.readouterr().out)["resources"] == {"pascal": 4}


def test_head_command():
    conf = raynode.settings({"RAY_OBJECT_STORE_MIB": "512", "RAY_NODE_IP": "10.0.0.1"})
    argv = raynode.command("head", conf, raynode.resources(gpus(TOPO / "4xp40.nvidia-smi.csv")))
    assert argv[:3] == ["start", "--block", "--disable-usage-stats"]
    assert {"--head", "--port=6379", "--include-dashboard=false"} <= set(argv)
    assert "--node-ip-address=10.0.0.1" in argv
    assert f"--temp-dir={paths.DATA_DIR}/ray" in argv
    assert f"--object-store-memory={512 * 2**20}" in argv
    assert "--num-gpus=4" in argv and '--resources={"pascal":4}' in argv
    ports = [int(a.split("=")[1]) for a in argv if a.split("=")[0][2:] in raynode.NODE_PORTS]
    assert ports == list(range(6380, 6386))
    assert {"--min-worker-port=10002", "--max-worker-port=10999"} <= set(argv)
    assert not any(a.startswith("--address") for a in argv)


def test_worker_command_joins_the_head_and_a_cpu_node_has_no_gpu():
    conf = raynode.settings({"RAY_HEAD_ADDRESS": "ray-head.lab", "RAY_GCS_PORT": "7000"})
    argv = raynode.command("worker", conf, raynode.resources([]))
    assert "--address=ray-head.lab:7000" in argv and "--head" not in argv
    assert "--num-gpus=0" in argv and not any(a.startswith("--resources") for a in argv)
    assert not any(a.startswith("--temp-dir") for a in argv)  # the head's, from its GCS


def test_a_cpu_node_offers_worker_slots_and_a_gpu_node_its_gpus():
    cpu = raynode.with_cpu_workers(raynode.resources([]), 1)
    assert (cpu["num_gpus"], cpu["resources"]) == (1, {"cpu": 1})
    assert raynode.with_cpu_workers(raynode.resources([]), 0)["num_gpus"] == 0
    p40 = raynode.resources(gpus(TOPO / "4xp40.nvidia-smi.csv"))
    assert raynode.with_cpu_workers(p40, 1) == p40


def test_a_worker_without_a_head_address_is_refused():
    with pytest.raises(EngineError) as err:
        raynode.command("worker", raynode.settings({}), raynode.resources([]))
    assert err.value.name == "ray-node-config-invalid" and err.value.code == 4


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"RAY_GCS_PORT": "80"}, "1024..65535"),
        ({"RAY_GCS_PORT": "six"}, "not a port"),
        ({"RAY_GCS_PORT": "6381"}, "overlap"),
        ({"RAY_NODE_PORTS_FROM": "65533"}, "its last port"),
        ({"RAY_WORKER_PORTS": "10002"}, "LOW-HIGH"),
        ({"RAY_WORKER_PORTS": "11000-10000"}, "not below"),
        ({"RAY_WORKER_PORTS": "6000-7000"}, "overlap"),
        ({"RAY_OBJECT_STORE_MIB": "10"}, ">= 80"),
        ({"RAY_HEAD_WAIT_S": "0"}, ">= 1"),
        ({"RAY_HEAD_ADDRESS": "head:6379"}, "host name"),
    ],
)
def test_bad_settings_get_a_named_error(env, words):
    with pytest.raises(EngineError) as err:
        raynode.settings(env)
    assert err.value.name == "ray-node-config-invalid"
    assert words in err.value.message


def test_command_print0_for_the_start_script(capsys, monkeypatch):
    monkeypatch.setenv("RAY_HEAD_ADDRESS", "10.1.2.3")
    smi = str(DETECT / "p40-v100.nvidia-smi.csv")
    rc = cli.main(["ray-node", "command", "--role", "worker", "--print0", "--nvidia-smi-file", smi])
    assert rc == 0
    argv = capsys.readouterr().out.split("\0")
    assert argv[-1] == "" and argv[0] == "start"
    assert '--resources={"pascal":1,"volta":1}' in argv and "--num-gpus=2" in argv


def test_env_file_round_trips_through_the_settings():
    text = raynode.render_env(
        {
            "gcs_port": "6379",
            "head_address": "10.0.0.5",
            "object_store_mib": "0",
            "cpu_workers": 0,
            "head_wait_s": 30,
        }
    )
    env = dict(re.findall(r"^(RAY_\w+)='([^']*)'$", text, re.M))
    assert env == {"RAY_GCS_PORT": "6379", "RAY_HEAD_ADDRESS": "10.0.0.5", "RAY_HEAD_WAIT_S": "30"}
    assert raynode.settings(env)["head_wait_s"] == 30


@pytest.mark.parametrize(
    "values",
    [{"gcs_port": 22}, {"head_address": "a'b"}, {"colour": "red"}, {"head_wait_s": [1]}, []],
)
def test_env_refuses_bad_settings(values):
    with pytest.raises(EngineError) as err:
        raynode.render_env(values)
    assert err.value.name == "ray-node-config-invalid"


def test_cli_env_refuses_with_json_and_exit_4(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"worker_ports": "1-2"}')
    assert cli.main(["ray-node", "env", "--json", str(bad)]) == 4
    assert json.loads(capsys.readouterr().out)["error"] == "ray-node-config-invalid"


def test_wait_for_a_head_that_answers():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert raynode.wait_for_head("127.0.0.1", port, 5, interval_s=0.1) < 5


def test_a_head_that_does_not_answer_is_named_within_the_timeout():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]  # then closed: nothing listens there
    started = time.monotonic()
    with pytest.raises(EngineError) as err:
        raynode.wait_for_head("127.0.0.1", port, 1, interval_s=0.3)
    # The whole wait, as the message says, and not much more.
    assert 1 <= time.monotonic() - started < 3
    assert err.value.name == "ray-head-unreachable"
    assert err.value.code == raynode.EXIT_HEAD_UNREACHABLE == 5
    assert f"127.0.0.1:{port} did not answer within 1 s" in err.value.message


# -- the units ------------------------------------------------------------------------


def unit(path: Path) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


HARDENING = [
    "ProtectSystem",
    "ProtectHome",
    "PrivateTmp",
    "NoNewPrivileges",
    "DevicePolicy",
    "DeviceAllow",
    "CapabilityBoundingSet",
    "AmbientCapabilities",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectKernelLogs",
    "ProtectControlGroups",
    "ProtectClock",
    "ProtectHostname",
    "ProtectProc",
    "RestrictNamespaces",
    "RestrictRealtime",
    "RestrictSUIDSGID",
    "LockPersonality",
    "RemoveIPC",
    "KeyringMode",
    "RestrictAddressFamilies",
    "SystemCallArchitectures",
    "SystemCallFilter",
    "SystemCallErrorNumber",
]


@pytest.mark.parametrize("name", sorted(UNITS))
def test_units_are_hardened_like_the_job_unit(name):
    ray, job = unit(UNITS[name]), unit(JOB_UNIT)
    for key in HARDENING:
        assert ray.get(key) == job[key], key
    assert ray["User"] == [paths.USER] and ray["Group"] == [paths.GROUP]
    assert ray["EnvironmentFile"] == [str(raynode.NODE_ENV)]
    assert ray["ConditionPathExists"] == [str(raynode.NODE_ENV)]
    # Ray's session, and the jobs' state where a cluster job's ranks write their shards.
    assert ray["StateDirectory"] == [
        f"{raynode.RAY_DIR.relative_to('/var/lib')} {paths.STATE_DIR.relative_to('/var/lib')}"
    ]
    assert ray["Environment"] == [f"RAY_TMPDIR={raynode.RAY_DIR}"]
    role = name.removeprefix("ray-").removesuffix(".service")
    assert ray["ExecStart"] == [f"{paths.BIN_DIR}/ray-node {role}"]
    # Restarts: on failure, not faster than RestartSec, a bounded number in an interval.
    assert ray["Restart"] == ["on-failure"]
    assert int(ray["RestartSec"][0]) >= 10
    assert int(ray["StartLimitBurst"][0]) * int(ray["RestartSec"][0]) < int(
        ray["StartLimitIntervalSec"][0]
    )
    assert ray["Conflicts"] == [f"ray-{'worker' if role == 'head' else 'head'}.service"]


def test_a_cluster_jobs_driver_may_write_the_heads_session():
    assert unit(JOB_UNIT)["ReadWritePaths"] == [f"-{raynode.RAY_DIR}"]


def test_only_the_worker_waits_for_the_head():
    assert unit(UNITS["ray-worker.service"])["ExecStartPre"] == [
        f"{paths.BIN_DIR}/ray-node wait-head"
    ]
    assert "ExecStartPre" not in unit(UNITS["ray-head.service"])


def test_the_start_scripts_defaults_are_the_tables():
    text = SCRIPT.read_text(encoding="utf-8")
    defaults = dict(re.findall(r"^\w+=\$\{(\w+):-([^}]+)\}$", text, re.M))
    assert defaults == {
        "OLDGPU_BIN": str(paths.ENGINE_BIN),
        "VERL_VENV": str(paths.VENV_DIR),
        "VERL_DIR": str(paths.VERL_DIR),
        "STATE_DIRECTORY": str(raynode.RAY_DIR),
    }


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_units_pass_systemd_analyze_verify(tmp_path):
    # A root with systemd's own units, ours, the script and the env file.
    shutil.copytree("/usr/lib/systemd/system", tmp_path / "usr/lib/systemd/system", symlinks=True)
    (tmp_path / "etc/systemd/system").mkdir(parents=True)
    for name, path in UNITS.items():
        shutil.copy(path, tmp_path / "etc/systemd/system" / name)
    script = tmp_path / str(paths.BIN_DIR).lstrip("/") / "ray-node"
    script.parent.mkdir(parents=True)
    shutil.copy(SCRIPT, script)
    env = tmp_path / str(raynode.NODE_ENV).lstrip("/")
    env.parent.mkdir(parents=True)
    env.write_text(raynode.render_env({"head_address": "10.0.0.5"}))
    proc = subprocess.run(
        ["systemd-analyze", "verify", f"--root={tmp_path}", *UNITS],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_role_files_are_the_projects_files():
    for name in (*UNITS, "ray-node"):
        link = ROLE / "files" / name
        assert link.resolve() == (UNITS.get(name) or SCRIPT).resolve()


def test_argument_specs_match_the_defaults():
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text(encoding="utf-8"))
    specs = yaml.safe_load((ROLE / "meta/argument_specs.yml").read_text(encoding="utf-8"))
    options = specs["argument_specs"]["main"]["options"]
    assert set(options) == set(defaults)
    for name, value in defaults.items():
        assert options[name]["default"] == value, name
        kind = {bool: "bool", int: "int", str: "str"}[type(value)]
        assert options[name]["type"] == kind, name
