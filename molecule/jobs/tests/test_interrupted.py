"""The venv install survived two kills before molecule's converge (prepare.yml).

The converge after them completed and the idempotence run changed nothing (molecule
checks both); here: what was killed, and that no half-built venv is left.
"""

from __future__ import annotations

from interrupted import kills


def test_pip_and_the_engine_were_killed_mid_install_and_nothing_half_built_is_left(host):
    seen = kills(host)
    print(seen)
    line = seen["venv-killed-in-host"]
    assert "kill host" in line and "pip install" in line, line
    assert "converge rc 0" not in line, line
    # The engine's marker of a build in progress: the next converge removed that venv.
    assert host.check_output("ls -A /opt/verl/venvs | grep -c building || true") == "0"
    venvs = host.check_output("ls -1d /opt/verl/venvs/*/ | wc -l")
    assert int(venvs) == 1, host.check_output("ls -la /opt/verl/venvs")


def test_the_controller_was_killed_during_the_next_build(host):
    line = kills(host)["venv-controller-killed"]
    assert "kill controller" in line and "ansible-playbook" in line, line
    assert host.file("/opt/verl/venv").is_symlink
    host.check_output("/opt/verl/venv/bin/python -c 'import torch, ray, verl'")
