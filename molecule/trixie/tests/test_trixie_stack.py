"""The verl stack and a CPU training job on Debian 13, checked as on Debian 12.

The venv's interpreter is Debian 12's python3.11 (trixie's is 3.13; the engine's choice,
`oldgpu distro`), apt-pinned so that nothing else comes from Debian 12, and its pip
Debian's wheel. Then the jobs scenario's own checks, imported: the venv holds the lock,
the patched tree, and the smoke job (2 PPO steps on the tiny model) trains, checkpoints
and reports under systemd as the unprivileged verl user.
"""

from __future__ import annotations

import json
import sys

from playbook import PROJECT, playbook

sys.path.insert(0, str(PROJECT / "molecule" / "jobs" / "tests"))

# The jobs scenario's checks, collected here too (the smoke job is declared the same way).
from test_jobs import (  # noqa: F401
    first_run,
    test_checkpoints_are_owned_by_verl,
    test_env_file_is_private_to_root_and_the_group,
    test_job_ran_as_verl_and_succeeded,
    test_journal_shows_every_step_with_reward_and_kl,
    test_start_script_and_unit_are_installed,
    test_status_reports_the_job,
    test_unit_passes_systemd_verify_and_scores_5_or_better,
)
from test_stack import (  # noqa: F401
    test_fsdp_workers_import_without_flash_attn,
    test_pip_check_is_clean,
    test_pip_freeze_in_the_host_equals_the_lock,
    test_venv_imports_the_stack_at_the_locked_versions,
    test_venv_is_not_writable_by_verl,
    test_verl_tree_is_patched_and_the_manifest_matches,
)

PY = "/opt/verl/venv/bin/python"
# Installed packages whose installed version only Debian 12 has: the interpreter's four.
FROM_BOOKWORM = (
    "import apt, json; c = apt.Cache(); print(json.dumps(sorted("
    "p.name for p in c if p.is_installed and p.installed.origins and all("
    "o.codename.startswith('bookworm') for o in p.installed.origins if o.archive != 'now'))))"
)


def test_the_venv_runs_debian_12s_python_3_11(host):
    d = json.loads(host.check_output("oldgpu distro --json"))["python"]
    print("oldgpu distro python:", {k: d[k] for k in ("source", "path", "install")})
    assert (d["source"], d["interpreter"]) == ("debian-12", "python3.11")
    assert host.check_output(f"readlink -f {PY}") == "/usr/bin/python3.11"
    version = host.check_output("dpkg-query -W -f '${Version}' python3.11")
    print("python3.11", version)
    assert "deb12" in version  # Debian 12's build (and its security updates)
    # The standard library's C modules link against trixie's libraries (t64 names).
    out = host.check_output(f"{PY} -c 'import ssl, sqlite3, ctypes, lzma, bz2, uuid; print(1)'")
    assert out == "1"
    # pip from Debian's wheel (trixie's python3-pip-whl): python3.11-venv cannot install.
    wheel = host.check_output("dpkg-query -W -f '${Version}' python3-pip-whl").split("+")[0]
    assert host.check_output(f"{PY} -m pip --version").startswith(f"pip {wheel} from /opt/verl/")
    assert not host.package("python3.11-venv").is_installed


def test_nothing_else_comes_from_debian_12(host):
    d = json.loads(host.check_output("oldgpu distro --json"))["python"]["apt"]
    # The role wrote the engine's source and pin, byte for byte.
    assert host.file(d["sources_file"]).content_string == d["sources"]
    assert host.file(d["preferences_file"]).content_string == d["preferences"]
    assert host.file(d["sources_file"]).mode == 0o644
    installed = json.loads(host.check_output(f'python3 -c "{FROM_BOOKWORM}"'))
    print("installed from Debian 12:", installed)
    assert installed == sorted(d["packages"])
    # An upgrade takes nothing from Debian 12 either.
    upgrade = host.check_output("apt-get -s -o Debug::NoLocking=1 dist-upgrade")
    assert "Debian:12" not in upgrade and "bookworm" not in upgrade, upgrade[-2000:]
    # No copy of a replaced file left where apt reads (it warns about each).
    assert not [n for n in host.file("/etc/apt/sources.list.d").listdir() if n.endswith("~")]


def test_an_unreachable_mirror_is_named_and_the_working_source_stays(host):
    name = host.backend.get_hostname()
    d = json.loads(host.check_output("oldgpu distro --json"))["python"]["apt"]
    before = host.file(d["sources_file"]).content_string
    bad = {
        "oldgpu_stages": ["base", "python"],
        "python_env_python_mirror": "http://127.0.0.1:9/debian",
    }
    run = playbook("-e", json.dumps(bad), limit=name)
    assert run.rc != 0
    assert (
        "python-interpreter-unavailable: python3.11 from bookworm at http://127.0.0.1:9/debian"
        in (run.output)
    ), run.output[-3000:]
    # The source went back to the working mirror's (apt update works), no copy left beside it.
    assert host.file(d["sources_file"]).content_string == before
    assert not [n for n in host.file("/etc/apt/sources.list.d").listdir() if n.endswith("~")]
    assert host.run("apt-get update -qq").rc == 0
    assert host.check_output(f"readlink -f {PY}") == "/usr/bin/python3.11"
