"""The driver install survived two kills before molecule's converge (prepare.yml).

The converge after them completed and the idempotence run changed nothing (molecule
checks both); here: what was killed, and that dpkg and the driver are whole.
"""

from __future__ import annotations

from interrupted import kills


def test_dpkg_was_killed_mid_unpack_and_the_next_converge_finished_it(host):
    seen = kills(host)
    print(seen)
    line = seen["driver-killed-in-host"]
    assert "kill host" in line and "dpkg" in line, line
    assert "converge rc 0" not in line, line  # the play failed: the kill landed in the install
    assert host.run("dpkg --audit").stdout.strip() == ""
    assert host.check_output("ls -A /var/lib/dpkg/updates") == ""


def test_the_controller_was_killed_during_the_dkms_build(host):
    line = kills(host)["driver-controller-killed"]
    assert "kill controller" in line and "ansible-playbook" in line, line


def test_every_nvidia_package_is_installed_and_configured(host):
    states = host.check_output(
        "dpkg-query -W -f='${db:Status-Abbrev} ${Package}\\n' '*nvidia*' | grep -v '^un'"
    )
    rows = [r.split() for r in states.splitlines() if r.strip()]
    assert rows, "no nvidia package"
    # Status-Abbrev: wanted (i install, h hold), state (i installed), error flag (none).
    bad = [r for r in rows if r[0][1:] != "i"]
    assert not bad, bad
