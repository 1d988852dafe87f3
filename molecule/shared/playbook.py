"""Run ansible-playbook against a scenario's test hosts from a testinfra test.

Used to prove what a user would see: a --check run on a converged host changes
nothing, and bad input stops the play before any change.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

PROJECT = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", Path(__file__).resolve().parents[2]))


@dataclass
class Run:
    rc: int
    output: str

    def recap(self, host: str) -> dict[str, int]:
        """The PLAY RECAP counters for one host."""
        m = re.search(rf"^{re.escape(host)}\s+:\s+(.*)$", self.output, re.M)
        assert m, f"no recap for {host} in:\n{self.output[-3000:]}"
        return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}


def playbook(*args: str, playbook: str = "site.yml", limit: str | None = None) -> Run:
    inventory = os.environ["MOLECULE_INVENTORY_FILE"]
    env = dict(os.environ)
    env.update(
        ANSIBLE_CONFIG=str(PROJECT / "ansible.cfg"),
        ANSIBLE_ROLES_PATH=str(PROJECT / "roles"),
        ANSIBLE_COLLECTIONS_PATH=str(PROJECT / ".collections"),
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_VALID_GROUP_NAMES="ignore",
        ANSIBLE_CONNECTION_PLUGINS=str(PROJECT / "molecule" / "plugins" / "connection"),
    )
    cmd = ["ansible-playbook", "-i", inventory, str(PROJECT / playbook), *args]
    if limit:
        cmd += ["--limit", limit]
    proc = subprocess.run(
        cmd, cwd=PROJECT, env=env, capture_output=True, text=True, timeout=1800, check=False
    )
    return Run(proc.returncode, proc.stdout + proc.stderr)
