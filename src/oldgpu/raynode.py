"""``oldgpu ray-node``: this host as a node of a Ray cluster.

ray-head.service and ray-worker.service (role ray_cluster, one static file for
Ansible and NixOS each) run ``files/bin/ray-node``, which asks this command at
every start for the ``ray start --block`` it execs: the GPUs are detected
then, so a box whose cards changed joins with what it has now.

Resources: ``--num-gpus`` counts the GPUs the driver drives, and each GPU
architecture is a custom resource (``{"pascal": 4}``) so that a job can ask
for Pascal nodes only; the venv's lock and the verl tree's hashes are resources
too (``oldgpu fleet``), for a cluster job to compare. Ports are fixed from the
cluster's settings (the GCS port and one block of node ports), so that a
firewall can list them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from oldgpu import detect, fleet, paths, subcommand
from oldgpu.output import EngineError, Result, read_json

# Ray's session files: one fixed place for the head, its workers and a job's
# driver (ray.init on the head reads the head's sockets from it).
RAY_DIR = paths.DATA_DIR / "ray"
# The env file both units read (RAY_* settings; the role or the NixOS module writes it).
NODE_ENV = paths.CONFIG_DIR / "ray" / "node.env"
DEFAULT_GCS_PORT = 6379
DEFAULT_NODE_PORTS_FROM = 6380
DEFAULT_WORKER_PORTS = "10002-10999"
DEFAULT_HEAD_WAIT_S = 60
# The node's own ports, in this order from RAY_NODE_PORTS_FROM (README lists them).
NODE_PORTS = (
    "node-manager-port",
    "object-manager-port",
    "runtime-env-agent-port",
    "dashboard-agent-grpc-port",
    "dashboard-agent-listen-port",
    "metrics-export-port",
)
# Exit status of `wait-head` when the head does not answer (the unit restarts on it).
EXIT_HEAD_UNREACHABLE = 5


def resources(gpus: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``num_gpus`` and one resource per architecture, from detect's GPUs.

    Only GPUs the driver drives (nvidia-smi lists them) count: a card that
    only lspci sees cannot run a Ray task.
    """
    driven = [g for g in gpus if g.get("source") == "nvidia-smi" and g.get("index") is not None]
    per_arch: dict[str, int] = {}
    for g in driven:
        arch = g.get("architecture") or "unknown"
        per_arch[arch] = per_arch.get(arch, 0) + 1
    return {
        "num_gpus": len(driven),
        "resources": dict(sorted(per_arch.items())),
        "gpu_indices": sorted(int(g["index"]) for g in driven),
    }


def _invalid(message: str) -> EngineError:
    return EngineError("ray-node-config-invalid", message, code=4)


def _port(name: str, value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise _invalid(f"{name}={value!r} is not a port number") from None
    if not 1024 <= port <= 65535:
        raise _invalid(f"{name}={port} is not a port in 1024..65535")
    return port


def settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """The node's settings from its env file's ``RAY_*`` variables, checked."""
    gcs = _port("RAY_GCS_PORT", environ.get("RAY_GCS_PORT", str(DEFAULT_GCS_PORT)))
    base = _port(
        "RAY_NODE_PORTS_FROM", environ.get("RAY_NODE_PORTS_FROM", str(DEFAULT_NODE_PORTS_FROM))
    )
    last = _port("RAY_NODE_PORTS_FROM (its last port)", str(base + len(NODE_PORTS) - 1))
    workers = environ.get("RAY_WORKER_PORTS", DEFAULT_WORKER_PORTS)
    low, sep, high = workers.partition("-")
    if not sep:
        raise _invalid(f"RAY_WORKER_PORTS={workers!r} is not a range LOW-HIGH")
    lo, hi = _port("RAY_WORKER_PORTS", low), _port("RAY_WORKER_PORTS", high)
    if lo >= hi:
        raise _invalid(f"RAY_WORKER_PORTS={workers!r}: the low port is not below the high one")
    taken = {gcs, *range(base, last + 1)}
    if len(taken) != 1 + len(NODE_PORTS) or any(lo <= p <= hi for p in taken):
        raise _invalid(
            f"ports overlap: GCS {gcs}, node ports {base}-{last}, worker ports {lo}-{hi}"
        )
    store = environ.get("RAY_OBJECT_STORE_MIB", "")
    if store and (not store.isdigit() or int(store) < 80):
        raise _invalid(f"RAY_OBJECT_STORE_MIB={store!r} is not a size in MiB >= 80 (Ray's floor)")
    wait = environ.get("RAY_HEAD_WAIT_S", str(DEFAULT_HEAD_WAIT_S))
    if not wait.isdigit() or int(wait) < 1:
        raise _invalid(f"RAY_HEAD_WAIT_S={wait!r} is not a number of seconds >= 1")
    cpu_workers = environ.get("RAY_CPU_WORKERS", "0")
    if not cpu_workers.isdigit():
        raise _invalid(f"RAY_CPU_WORKERS={cpu_workers!r} is not a count >= 0")
    head = environ.get("RAY_HEAD_ADDRESS", "")
    if head and (any(c.isspace() for c in head) or ":" in head):
        raise _invalid(f"RAY_HEAD_ADDRESS={head!r} is not a host name or IPv4 address")
    return {
        "gcs_port": gcs,
        "node_ports": dict(zip(NODE_PORTS, range(base, last + 1), strict=True)),
        "worker_ports": (lo, hi),
        "object_store_mib": int(store) if store else None,
        "head_address": head,
        "node_ip": environ.get("RAY_NODE_IP", ""),
        "head_wait_s": int(wait),
        "cpu_workers": int(cpu_workers),
    }


def with_cpu_workers(res: Mapping[str, Any], cpu_workers: int) -> dict[str, Any]:
    """A node without GPUs that offers the cpu profile's worker slots.

    verl places each worker in a bundle of one GPU and one ``<device>`` resource
    (``cpu`` on the cpu profile; oldgpu.patch.runtime.compat_cpu): a CPU-only node
    advertises ``cpu_workers`` of both so that a cpu-profile job (CI, the
    tests) can place that many workers on it. A node with GPUs ignores it.
    """
    if res["num_gpus"] or not cpu_workers:
        return dict(res)
    return {
        **res,
        "num_gpus": cpu_workers,
        "resources": {**res["resources"], "cpu": cpu_workers},
    }


def command(role: str, conf: Mapping[str, Any], res: Mapping[str, Any]) -> list[str]:
    """``ray start --block``'s arguments (after the venv's ``ray``) for a head or a worker."""
    if role == "worker" and not conf["head_address"]:
        raise _invalid("a worker needs RAY_HEAD_ADDRESS, the head's host name or address")
    argv = ["start", "--block", "--disable-usage-stats"]
    if role == "head":
        # No dashboard: one web port fewer to open, and its server is the
        # heaviest process of a head.
        argv += ["--head", f"--port={conf['gcs_port']}", "--include-dashboard=false"]
    else:
        argv += [f"--address={conf['head_address']}:{conf['gcs_port']}"]
    if conf["node_ip"]:
        argv.append(f"--node-ip-address={conf['node_ip']}")
    argv += [f"--{name}={port}" for name, port in conf["node_ports"].items()]
    lo, hi = conf["worker_ports"]
    argv += [f"--min-worker-port={lo}", f"--max-worker-port={hi}"]
    if role == "head":
        argv.append(f"--temp-dir={RAY_DIR}")
    if conf["object_store_mib"]:
        argv.append(f"--object-store-memory={conf['object_store_mib'] * 1024 * 1024}")
    argv.append(f"--num-gpus={res['num_gpus']}")
    if res["resources"]:
        argv.append("--resources=" + json.dumps(res["resources"], separators=(",", ":")))
    return argv


def wait_for_head(
    address: str, port: int, timeout_s: float, *, interval_s: float = 2.0, clock=time.monotonic
) -> float:
    """Seconds until the head's GCS port took a connection; a named error after ``timeout_s``."""
    deadline = clock() + timeout_s
    last_error = "no answer"
    while True:
        try:
            wait = min(5.0, max(0.1, deadline - clock()))
            with socket.create_connection((address, port), timeout=wait):
                return timeout_s - (deadline - clock())
        except OSError as exc:
            last_error = exc.strerror or str(exc)
        remaining = deadline - clock()
        if remaining <= 0:
            raise EngineError(
                "ray-head-unreachable",
                f"the Ray head at {address}:{port} did not answer within {timeout_s:g} s "
                f"({last_error}); is ray-head.service running there, and port {port} open "
                f"between the nodes? systemd tries again after RestartSec",
                code=EXIT_HEAD_UNREACHABLE,
            )
        time.sleep(min(interval_s, remaining))


# The role's and the NixOS module's settings -> the env file's variables.
ENV_KEYS = {
    "gcs_port": "RAY_GCS_PORT",
    "node_ports_from": "RAY_NODE_PORTS_FROM",
    "worker_ports": "RAY_WORKER_PORTS",
    "object_store_mib": "RAY_OBJECT_STORE_MIB",
    "head_address": "RAY_HEAD_ADDRESS",
    "node_ip": "RAY_NODE_IP",
    "head_wait_s": "RAY_HEAD_WAIT_S",
    "cpu_workers": "RAY_CPU_WORKERS",
}


def render_env(values: Mapping[str, Any]) -> str:
    """The env file for ``values`` (ENV_KEYS' keys), checked as the node will read it."""
    if not isinstance(values, Mapping):
        raise _invalid("the settings are not a mapping")
    unknown = sorted(set(values) - set(ENV_KEYS))
    if unknown:
        raise _invalid(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(ENV_KEYS)}")
    env: dict[str, str] = {}
    for key, name in ENV_KEYS.items():
        value = values.get(key)
        if (
            value is None
            or value == ""
            # 0 for these two: Ray's default, none (Ansible passes "0").
            or (key in ("object_store_mib", "cpu_workers") and str(value) == "0")
        ):
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise _invalid(f"{key}: {value!r} is not a string or a number")
        text = str(value)
        if any(c in text for c in "'\"\\\n$`"):
            raise _invalid(f"{key}: {text!r} holds a quote, newline, $ or backquote")
        env[name] = text
    settings(env)
    lines = ["# Written by the ray_cluster role (or the NixOS module); read by ray-node."]
    return "\n".join(lines + [f"{k}='{v}'" for k, v in env.items()]) + "\n"


# -- CLI ------------------------------------------------------------------------------


def _resources_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return resources(detect.detect_from_args(args)["gpus"])


def run_resources(args: argparse.Namespace) -> Result:
    res = _resources_from_args(args)
    labels = ", ".join(f"{k}: {v}" for k, v in res["resources"].items()) or "none"
    return Result(res, f"num_gpus {res['num_gpus']}; resources {labels}")


def run_command(args: argparse.Namespace) -> Result:
    conf = settings(os.environ)
    gpus = detect.detect_from_args(args)["gpus"]
    res = with_cpu_workers(resources(gpus), conf["cpu_workers"])
    # The node's venv lock and verl tree, for cluster jobs to compare (oldgpu.fleet).
    res["resources"] = {**res["resources"], **fleet.labels(fleet.facts(gpus))}
    argv = command(args.role, conf, res)
    doc = {"role": args.role, "argv": argv, **res}
    if args.print0:
        sys.stdout.write("\0".join(argv) + "\0")
        sys.stdout.flush()
        return Result(doc, "")
    return Result(doc, "ray " + " ".join(argv))


def run_wait_head(args: argparse.Namespace) -> Result:
    conf = settings(os.environ)
    if not conf["head_address"]:
        raise _invalid("RAY_HEAD_ADDRESS is not set: this worker does not know its head")
    timeout = args.timeout if args.timeout is not None else conf["head_wait_s"]
    took = wait_for_head(conf["head_address"], conf["gcs_port"], timeout)
    where = f"{conf['head_address']}:{conf['gcs_port']}"
    return Result({"head": where, "seconds": round(took, 1)}, f"the Ray head at {where} answers")


def run_env(args: argparse.Namespace) -> Result:
    values = read_json(args.file, "ray-node-config-invalid", "the settings")
    text = render_env(values)
    return Result({"env": text}, text)


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = "this host as a Ray node: its GPU resources and the `ray start` its unit runs"
    parser = subcommand.add(subparsers, common, "ray-node", None, __doc__, help=summary)
    sub = parser.add_subparsers(dest="ray_node_command", required=True)
    res = subcommand.add(
        sub, common, "resources", run_resources, help="num_gpus and a resource per architecture"
    )
    detect.add_source_args(res)
    cmd = subcommand.add(
        sub, common, "command", run_command, help="`ray start --block`'s arguments (RAY_* env)"
    )
    cmd.add_argument("--role", choices=("head", "worker"), required=True)
    cmd.add_argument("--print0", action="store_true", help="NUL-separated arguments")
    detect.add_source_args(cmd)
    env = subcommand.add(
        sub, common, "env", run_env, help="the node's env file from JSON settings (checked)"
    )
    env.add_argument("file", help="JSON settings, or - for stdin")
    wait = subcommand.add(
        sub, common, "wait-head", run_wait_head, help="wait (bounded) for the head's GCS port"
    )
    wait.add_argument("--timeout", type=float, help="seconds (default RAY_HEAD_WAIT_S, else 60)")
