"""Driver branch selection over the GPU table, as the nvidia_driver role relies on it.

tests/test_profile.py covers the single-GPU basics; these add the issue's rules
for every architecture, mixed hosts, the invalid requests, and the JSON error
contract that roles/oldgpu_engine/tasks/profile.yml turns into a failed play.
"""

from __future__ import annotations

import pytest
from conftest import cli_runner

from oldgpu import profile
from oldgpu.output import EngineError

# The table: Kepler -> 470; Maxwell/Pascal/Volta -> 535 or 580 with the
# proprietary modules (470 still allowed); 580 is their last branch.
EXPECTED = {
    "kepler": ([470], 470, ["proprietary"]),
    "maxwell": ([470, 535, 550, 580], 535, ["proprietary"]),
    "pascal": ([470, 535, 550, 580], 535, ["proprietary"]),
    "volta": ([470, 535, 550, 580], 535, ["proprietary"]),
    "turing": ([470, 535, 550, 580], 535, ["proprietary", "open"]),
    "ampere": ([470, 535, 550, 580], 535, ["proprietary", "open"]),
    "ada": ([535, 550, 580], 535, ["proprietary", "open"]),
    "hopper": ([535, 550, 580], 535, ["proprietary", "open"]),
    "blackwell": ([580], 580, ["open"]),
}
PRE_TURING = ["kepler", "maxwell", "pascal", "volta"]


def gpu(arch: str) -> dict[str, str | None]:
    return {"architecture": arch, "compute_capability": profile.PROFILES[arch].cc}


def select(*archs: str, branch: int | None = None, flavour: str | None = None) -> dict:
    return profile.select_driver([gpu(a) for a in archs], branch, flavour)


def error(*archs: str, branch: int | None = None, flavour: str | None = None) -> EngineError:
    with pytest.raises(EngineError) as exc:
        select(*archs, branch=branch, flavour=flavour)
    return exc.value


def test_the_table_covers_every_gpu_architecture():
    assert set(EXPECTED) == set(profile.PROFILES) - {"cpu"}


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_each_architecture(arch):
    branches, default, flavours = EXPECTED[arch]
    d = select(arch)
    assert (d["branches"], d["default"], d["selected"]) == (branches, default, default)
    assert d["flavours"] == [f for f in flavours if f in profile.BRANCH_FLAVOURS[default]]
    assert d["flavour"] == flavours[0]
    assert d["required"] is True


@pytest.mark.parametrize("arch", ["maxwell", "pascal", "volta"])
@pytest.mark.parametrize("branch", [470, 535, 550, 580])
def test_every_supported_branch_may_be_asked_for(arch, branch):
    d = select(arch, branch=branch)
    assert (d["selected"], d["flavour"]) == (branch, "proprietary")


@pytest.mark.parametrize(
    ("arch", "branch"),
    [(a, b) for a in PRE_TURING for b in [None, *EXPECTED[a][0]]],
)
def test_open_modules_before_turing_stop_with_a_named_error(arch, branch):
    exc = error(arch, branch=branch, flavour="open")
    assert exc.name == "open-modules-unsupported"
    assert "Turing" in exc.message and arch in exc.message


@pytest.mark.parametrize(
    ("arch", "branch"),
    [("kepler", 535), ("kepler", 580), ("ada", 470), ("hopper", 470), ("blackwell", 535)],
)
def test_a_branch_the_gpu_cannot_use_is_refused(arch, branch):
    exc = error(arch, branch=branch)
    assert exc.name == "driver-branch-unsupported"
    assert str(EXPECTED[arch][0]) in exc.message  # it says what to choose instead


@pytest.mark.parametrize("branch", [390, 545, 590])
def test_a_branch_the_project_does_not_install_is_refused(branch):
    assert error("pascal", branch=branch).name == "driver-branch-unknown"


def test_an_unknown_flavour_is_refused():
    assert error("turing", flavour="closed").name == "driver-flavour-unknown"


# -- mixed hosts: a branch (and flavour) that drives every GPU ----------------------


@pytest.mark.parametrize(
    ("archs", "branches", "selected"),
    [
        (("pascal", "volta"), [470, 535, 550, 580], 535),  # both default to Debian's 535
        (("pascal", "pascal"), [470, 535, 550, 580], 535),
        (("kepler", "pascal"), [470], 470),  # Kepler's last branch drives Pascal too
        (("kepler", "ampere"), [470], 470),
        (("maxwell", "hopper"), [535, 550, 580], 535),
        (("hopper", "blackwell"), [580], 580),  # the newest branch both take
        (("ada", "blackwell"), [580], 580),
    ],
)
def test_mixed_hosts(archs, branches, selected):
    d = select(*archs)
    assert (d["branches"], d["selected"]) == (branches, selected)


def test_mixed_pre_turing_and_turing_take_the_proprietary_modules():
    d = select("pascal", "turing")
    assert (d["flavour"], d["flavours"]) == ("proprietary", ["proprietary"])
    assert error("pascal", "turing", flavour="open").name == "open-modules-unsupported"


def test_mixed_turing_and_ampere_may_take_the_open_modules():
    assert select("turing", "ampere", flavour="open")["flavour"] == "open"


def test_mixed_host_branch_request_is_checked_against_every_gpu():
    assert select("pascal", "volta", branch=470)["selected"] == 470
    exc = error("kepler", "pascal", branch=535)
    assert exc.name == "driver-branch-unsupported" and "[470]" in exc.message


@pytest.mark.parametrize(
    ("archs", "name"),
    [
        (("kepler", "ada"), "no-common-driver-branch"),
        (("kepler", "hopper"), "no-common-driver-branch"),
        (("kepler", "blackwell"), "no-common-driver-branch"),
        (("pascal", "blackwell"), "no-common-driver-flavour"),  # 580 shared, modules not
    ],
)
def test_mixed_hosts_no_driver_drives(archs, name):
    exc = error(*archs)
    assert exc.name == name
    for arch in archs:
        assert arch in exc.message


def test_no_gpu_installs_the_default_and_requires_nothing():
    d = select()
    assert (d["required"], d["selected"], d["flavour"]) == (False, 535, "proprietary")
    # Nothing to contradict: any branch, either flavour (the role then checks what
    # the distribution packages).
    assert select(branch=470)["selected"] == 470
    assert select(branch=580, flavour="open")["flavour"] == "open"


# -- the JSON contract the Ansible role reads ---------------------------------------


@pytest.fixture
def run_cli(monkeypatch, capsys):
    return cli_runner(monkeypatch, capsys, ("oldgpu.detect", "oldgpu.profile"), "profile", "--json")


@pytest.mark.parametrize(
    ("argv", "selected", "flavour"),
    [
        (["--arch", "pascal"], 535, "proprietary"),
        (["--arch", "pascal", "--driver-branch", "470"], 470, "proprietary"),
        (["--arch", "pascal", "--driver-branch", "580"], 580, "proprietary"),
        (["--arch", "kepler"], 470, "proprietary"),
        (["--arch", "turing", "--driver-flavour", "open"], 535, "open"),
    ],
)
def test_cli_answers_what_the_role_installs(run_cli, argv, selected, flavour):
    code, p, _ = run_cli(*argv)
    assert code == 0
    assert (p["driver"]["selected"], p["driver"]["flavour"]) == (selected, flavour)


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["--arch", "pascal", "--driver-flavour", "open"], "open-modules-unsupported"),
        (["--arch", "kepler", "--driver-branch", "535"], "driver-branch-unsupported"),
        (["--arch", "pascal", "--driver-branch", "545"], "driver-branch-unknown"),
        (
            ["--arch", "pascal", "--driver-branch", "470", "--distro", "debian-13"],
            "driver-branch-not-packaged",
        ),
    ],
)
def test_cli_errors_are_json_with_a_name_and_a_message(run_cli, argv, name):
    code, p, err = run_cli(*argv)
    assert code == EngineError.code != 0
    assert set(p) == {"error", "message"}  # what the role's fail task reads
    assert p["error"] == name and p["message"]
    assert name in err
