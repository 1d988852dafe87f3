"""What a user checks after `ansible-playbook site.yml -l p40-hosts` on a bare Debian 12."""

import re

import pytest
from playbook import playbook

COMPONENTS = {"main", "contrib", "non-free", "non-free-firmware"}


def test_verl_user_is_an_unprivileged_system_account(host):
    user = host.user("verl")
    assert user.exists
    assert user.group == "verl"
    assert user.shell == "/usr/sbin/nologin"
    assert user.uid < 1000, "a system account"
    assert user.password in ("!", "*", "!*"), "no usable password"
    assert host.group("verl").exists


@pytest.mark.parametrize(
    ("path", "owner", "group", "mode"),
    [
        ("/opt/verl", "root", "root", 0o755),
        ("/var/lib/verl", "verl", "verl", 0o750),
        ("/var/log/verl", "verl", "verl", 0o750),
        ("/etc/verl", "root", "root", 0o755),
        ("/etc/verl/jobs", "root", "verl", 0o750),
    ],
)
def test_directories(host, path, owner, group, mode):
    d = host.file(path)
    assert d.is_directory
    assert (d.user, d.group, d.mode) == (owner, group, mode)


def test_debian_components_enabled_in_the_hosts_own_sources(host):
    entries = []
    deb822 = host.file("/etc/apt/sources.list.d/debian.sources")
    if deb822.exists:
        entries += [
            set(c.split()) for c in re.findall(r"^Components:(.*)$", deb822.content_string, re.M)
        ]
    one_line = host.file("/etc/apt/sources.list")
    if one_line.exists:
        for line in one_line.content_string.splitlines():
            if line.startswith("deb "):
                entries.append(set(line.split()[3:]))
    assert entries, "no apt entries found"
    for comps in entries:
        assert comps == COMPONENTS
    # apt sees them: a package that lives only in contrib/non-free is known.
    policy = host.run("apt-cache policy nvidia-driver").stdout
    candidate = re.search(r"Candidate: (\S+)", policy)
    assert candidate and candidate.group(1) != "(none)", policy


def test_systemd_is_running(host):
    state = host.run("systemctl is-system-running").stdout.strip()
    assert state in ("running", "degraded"), state


def test_check_mode_on_a_converged_host_changes_nothing(host):
    name = host.backend.get_hostname()
    run = playbook("--check", limit=name)
    assert run.rc == 0, run.output[-3000:]
    recap = run.recap(name)
    assert recap["changed"] == 0 and recap["failed"] == 0, recap


@pytest.mark.parametrize(
    ("extra", "variable"),
    [
        ("base_user='bad user'", "base_user"),
        ("base_data_dir=var/lib/relative", "base_data_dir"),
        ("base_jobs_dir=/etc/verl/../jobs", "base_jobs_dir"),
    ],
)
def test_bad_input_stops_before_any_change(host, extra, variable):
    name = host.backend.get_hostname()
    if name != "p40-host-1":
        pytest.skip("one host is enough to prove the preflight")
    before = host.run(
        "getent passwd; ls -la /var/lib /etc/verl; cat /etc/apt/sources.list* 2>/dev/null"
    ).stdout
    run = playbook("-e", extra, limit=name)
    assert run.rc != 0
    assert f"{variable}=" in run.output, run.output[-2000:]
    recap = run.recap(name)
    assert recap["changed"] == 0 and recap["failed"] == 1, recap
    after = host.run(
        "getent passwd; ls -la /var/lib /etc/verl; cat /etc/apt/sources.list* 2>/dev/null"
    ).stdout
    assert after == before


def test_engine_answers_on_a_host_without_gpu(host):
    import json

    detect = host.run("oldgpu detect --json")
    assert detect.rc == 0, detect.stderr
    assert json.loads(detect.stdout)["gpus"] == []
    profile = json.loads(host.check_output("oldgpu profile --json"))
    assert profile["name"] == "cpu" and profile["compute_dtype"] == "fp32"
    assert host.file("/opt/verl/engine/current/oldgpu/data/pins.json").is_file
    assert not host.file("/opt/verl/engine/current/oldgpu/__pycache__").exists
