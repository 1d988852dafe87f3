"""``oldgpu fleet``: whether the hosts of a fleet agree, and whether a Ray cluster can run a job.

Each host's facts (``oldgpu fleet facts``): its GPUs, the driver, the venv's
lock hash (the name of the venv the venv link points to: the python_env key,
sha256 of the lock, its extras and the interpreter) and the patched verl tree's
manifest hash (sha256 of its ``.oldgpu-patch.json``). ``fleet drift`` reads the
facts of every host and names the hosts whose driver, lock or tree differs from
the fleet's most common one. The Ray nodes carry the lock and tree hashes as
resources (``oldgpu_lock_<hash>``, ``oldgpu_tree_<hash>``), so that a cluster
job checks the live nodes, not the inventory's memory of them, before it starts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from oldgpu import detect, paths, subcommand
from oldgpu.output import EngineError, Result, read_json

MANIFEST_NAME = ".oldgpu-patch.json"  # oldgpu.patch.manifest's; not imported: stdlib only
LOCK_PREFIX, TREE_PREFIX = "oldgpu_lock_", "oldgpu_tree_"
# What makes two hosts' runs differ; each is compared across the fleet.
DRIFT_KEYS = ("driver", "lock", "tree")
CONFIG_INVALID = 4
# A cluster that is not whole now (a head that does not answer, a node that has not
# joined yet): a job's unit tries again after RestartSec, unlike a config error.
CLUSTER_NOT_READY = 5


def tree_hash(verl_dir: Path = paths.VERL_DIR) -> str | None:
    """sha256 (16 hex) of the active tree's patch manifest; None without one."""
    try:
        return hashlib.sha256((verl_dir / MANIFEST_NAME).read_bytes()).hexdigest()[:16]
    except OSError:
        return None


def lock_hash(venv_dir: Path = paths.VENV_DIR) -> str | None:
    """The active venv's key (its directory's name under the venvs); None without one."""
    if not venv_dir.exists():
        return None
    return Path(os.path.realpath(venv_dir)).name


def facts(
    gpus: Sequence[Mapping[str, Any]],
    verl_dir: Path | None = None,
    venv_dir: Path | None = None,
) -> dict[str, Any]:
    """This host's facts; the tree and venv are the start scripts' ($VERL_DIR, $VERL_VENV)."""
    verl_dir = verl_dir or Path(os.environ.get("VERL_DIR", str(paths.VERL_DIR)))
    venv_dir = venv_dir or Path(os.environ.get("VERL_VENV", str(paths.VENV_DIR)))
    driven = [g for g in gpus if g.get("source") == "nvidia-smi" and g.get("index") is not None]
    drivers = sorted({g["driver_version"] for g in driven if g.get("driver_version")})
    return {
        "gpus": len(driven),
        "gpu_names": [g.get("name") for g in driven],
        "driver": drivers[0] if len(drivers) == 1 else (",".join(drivers) or None),
        "lock": lock_hash(venv_dir),
        "tree": tree_hash(verl_dir),
    }


def labels(node_facts: Mapping[str, Any]) -> dict[str, int]:
    """The Ray resources that carry a node's lock and tree."""
    out = {}
    if node_facts.get("lock"):
        out[LOCK_PREFIX + node_facts["lock"]] = 1
    if node_facts.get("tree"):
        out[TREE_PREFIX + node_facts["tree"]] = 1
    return out


def drift(hosts: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Per key, the fleet's most common value and the hosts that differ from it."""
    out: dict[str, Any] = {}
    for key in DRIFT_KEYS:
        values = {h: f.get(key) for h, f in hosts.items()}
        counts = Counter(values.values())
        if not counts:
            continue
        # Ties go to the value of the first host by name: stable, and said.
        top = max(counts.values())
        common = next(values[h] for h in sorted(values) if counts[values[h]] == top)
        out[key] = {
            "common": common,
            "differ": {h: v for h, v in sorted(values.items()) if v != common},
        }
    per_host = {h: sorted(k for k in out if h in out[k]["differ"]) for h in sorted(hosts)}
    return {"keys": out, "hosts": per_host, "drift": any(per_host.values())}


def _error(name: str, message: str) -> EngineError:
    return EngineError(name, message, code=CONFIG_INVALID)


def check_cluster(
    nodes: Sequence[Mapping[str, Any]],
    gpus: int | None,
    expected_nodes: int,
    local: Mapping[str, Any],
) -> dict[str, int]:
    """``trainer.nnodes`` and ``n_gpus_per_node`` for a job on a live cluster, or a named error.

    ``nodes`` are ``ray.nodes()``'s entries (``Alive``, ``NodeManagerAddress``,
    ``Resources``); ``expected_nodes`` the inventory's count of the cluster's
    hosts; ``gpus`` the job's GPUs per node (None: all of a node's); ``local``
    this host's facts (the job's tree and lock). Nodes without GPUs (a head that
    only coordinates) take no training workers; the others must have equal counts.
    """
    alive = [n for n in nodes if n.get("Alive")]
    if len(alive) != expected_nodes:
        where = ", ".join(sorted(str(n.get("NodeManagerAddress")) for n in alive)) or "none"
        raise EngineError(
            "cluster-nodes-missing",
            f"the cluster has {len(alive)} live node(s) ({where}) and the inventory "
            f"names {expected_nodes}; `ray status` on the head shows which did not join",
            code=CLUSTER_NOT_READY,
        )
    counts = {
        str(n.get("NodeManagerAddress")): int(n["Resources"].get("GPU", 0))
        for n in alive
        if n["Resources"].get("GPU", 0)
    }
    if not counts:
        raise _error("cluster-no-gpus", "no node of the cluster offers a GPU")
    if len(set(counts.values())) > 1:
        raise _error(
            "cluster-gpus-unequal",
            "verl needs the same GPU count on every node, and the nodes have "
            + ", ".join(f"{a}: {c}" for a, c in sorted(counts.items())),
        )
    have = next(iter(counts.values()))
    gpus = have if gpus is None else gpus
    if gpus > have:
        raise _error(
            "cluster-gpus-exceed-node",
            f"the job asks for {gpus} GPU(s) per node and the nodes have {have}",
        )
    for key, prefix in (("tree", TREE_PREFIX), ("lock", LOCK_PREFIX)):
        want = local.get(key)
        if not want:
            raise _error(f"cluster-{key}-unknown", f"this host has no {key} hash to compare")
        odd = sorted(
            str(n.get("NodeManagerAddress")) for n in alive if prefix + want not in n["Resources"]
        )
        if odd:
            what = "patched verl tree" if key == "tree" else "venv lock"
            raise _error(
                f"cluster-{key}-differs",
                f"node(s) {', '.join(odd)} run another {what} than this host's ({want}); "
                "converge the fleet (site.yml) so that every node has the same, then "
                "restart their ray-head/ray-worker units",
            )
    return {"nnodes": len(counts), "n_gpus_per_node": gpus}


# Run by the venv's python: the engine itself runs on the system python, without Ray.
_NODES_SCRIPT = (
    "import json, sys, ray\n"
    "ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)\n"
    "print(json.dumps([{k: n[k] for k in ('Alive', 'NodeManagerAddress', 'Resources')}"
    " for n in ray.nodes()]))\n"
)


def live_nodes(
    address: str, python: str = str(paths.VENV_PYTHON), timeout_s: float = 120
) -> list[dict[str, Any]]:
    """``ray.nodes()`` of the cluster at ``address``; a named error if the head does not answer."""
    try:
        proc = subprocess.run(
            [python, "-c", _NODES_SCRIPT, address],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if proc.returncode == 0:
            return json.loads(proc.stdout.strip().splitlines()[-1])
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    except subprocess.TimeoutExpired:
        why = f"no answer in {timeout_s:g} s"
    except (OSError, ValueError, IndexError) as exc:
        why = str(exc)
    raise EngineError(
        "ray-head-unreachable",
        f"the Ray head at {address} does not answer ({why}); is ray-head.service running "
        "there, and this host's ray-head or ray-worker unit joined to it?",
        code=CLUSTER_NOT_READY,
    )


def read_nodes(path: str) -> list[dict[str, Any]]:
    """Recorded ``ray.nodes()`` (tests, and a look at what a job would be checked against)."""
    try:
        nodes = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _error("cluster-nodes-unreadable", f"{path}: {exc}") from None
    if not isinstance(nodes, list) or not all(
        isinstance(n, dict) and isinstance(n.get("Resources"), dict) for n in nodes
    ):
        raise _error("cluster-nodes-unreadable", f"{path}: not a list of ray.nodes() entries")
    return nodes


# -- CLI ------------------------------------------------------------------------------


def run_facts(args: argparse.Namespace) -> Result:
    doc = facts(detect.detect_from_args(args)["gpus"])
    return Result(doc, "\n".join(f"{k}: {v}" for k, v in doc.items()))


def run_drift(args: argparse.Namespace) -> Result:
    hosts = read_json(args.file, "fleet-facts-invalid", "the fleet's facts", code=CONFIG_INVALID)
    if not isinstance(hosts, dict) or not all(isinstance(v, dict) for v in hosts.values()):
        raise _error("fleet-facts-invalid", "expected {host: {driver, lock, tree, ...}}")
    for host, facts_ in hosts.items():
        for key in DRIFT_KEYS:
            if isinstance(facts_.get(key), (dict, list)):
                raise _error(
                    "fleet-facts-invalid",
                    f"{host}: {key} is a {type(facts_[key]).__name__}, not a value",
                )
    doc = drift(hosts)
    lines = [
        f"{h}: " + (", ".join(f"{k} {hosts[h].get(k)}" for k in keys) or "as the fleet")
        for h, keys in doc["hosts"].items()
    ]
    return Result(doc, "\n".join(lines))


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = "a fleet's hosts: their facts, and which differ (driver, lock, verl tree)"
    parser = subcommand.add(subparsers, common, "fleet", None, __doc__, help=summary)
    sub = parser.add_subparsers(dest="fleet_command", required=True)
    one = subcommand.add(sub, common, "facts", run_facts, help="this host's GPUs, driver, hashes")
    detect.add_source_args(one)
    many = subcommand.add(sub, common, "drift", run_drift, help="hosts that differ from the rest")
    many.add_argument("file", help="JSON {host: facts}, or - for stdin")
