"""The flake, checked offline (`make nix`; not collected by `make unit`).

No nixpkgs can be fetched here, so the flake is evaluated with its nixpkgs
input replaced by tests/nix/stub-nixpkgs: every output's structure, the pins
it reads, the NixOS module on a test host (options, generated units, env
file, assertions), and a few builds that need only the host's tools (the
module's env file through the engine, the unit package). What only real
nixpkgs can show (`nix flake check`, `nix develop`) is docs/nix.md's first step
for a user with network access.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from tinywheel import make_wheel  # noqa: E402

from oldgpu import driver, lockcheck  # noqa: E402

STUB = ROOT / "tests" / "nix" / "stub-nixpkgs"
SYSTEM = "x86_64-linux"
NIX_CONFIG = "\n".join(
    [
        "experimental-features = nix-command flakes",
        # Offline: no binary cache, no flake registry download.
        "substituters =",
        "flake-registry = /dev/null",
        # Builds (stub derivations only) run as root with the host's /usr/bin.
        "build-users-group =",
        "sandbox = false",
        "warn-dirty = false",
    ]
)


def _env() -> dict[str, str]:
    env = dict(os.environ, NIX_CONFIG=NIX_CONFIG)
    env.pop("NIX_PATH", None)
    return env


def _listed_files() -> list[str]:
    """What a git flake of this checkout holds: tracked files and new ones not ignored."""
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (ROOT / f).exists()})


def _copy_tree(dest: Path) -> Path:
    for rel in _listed_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        src = ROOT / rel
        if src.is_symlink():
            target.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, target)
    return dest


class Flake:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.ref = f"path:{path}"

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = ["nix", *args, "--override-input", "nixpkgs", f"path:{STUB}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), check=False)
        if check and proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return proc

    def eval_json(self, attr: str, apply: str | None = None):
        args = ["eval", "--json", f"{self.ref}#{attr}"]
        if apply:
            args += ["--apply", apply]
        return json.loads(self.run(*args).stdout)

    def eval_raw(self, attr: str) -> str:
        return self.run("eval", "--raw", f"{self.ref}#{attr}").stdout

    def build(self, attr: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("build", "--no-link", "--json", f"{self.ref}#{attr}", check=check)


@pytest.fixture(scope="session", autouse=True)
def _nix_present() -> None:
    if shutil.which("nix") is None or shutil.which("nix-instantiate") is None:
        pytest.fail("nix is not installed: run `make nix` (scripts/nix-checks.sh installs nix-bin)")


@pytest.fixture(scope="session")
def flake(tmp_path_factory) -> Flake:
    return Flake(_copy_tree(tmp_path_factory.mktemp("flake")))


@pytest.fixture
def edited_flake(flake: Flake, tmp_path: Path):
    """A copy of the flake to break on purpose."""

    def make(edit) -> Flake:
        dest = tmp_path / "flake"
        shutil.copytree(flake.path, dest, symlinks=True)
        edit(dest)
        return Flake(dest)

    return make


@pytest.fixture(scope="session")
def pins() -> dict:
    return json.loads((ROOT / "files" / "pins.json").read_text())


@pytest.fixture(scope="session")
def host(flake: Flake) -> dict:
    """The test host's configuration, the parts the module sets."""
    keep = (
        "c: { inherit (c) assertions users environment systemd services hardware;"
        ' nixpkgsConfig = removeAttrs c.nixpkgs.config [ "allowUnfreePredicate" ];'
        " allowUnfree = c.nixpkgs.config.allowUnfreePredicate"
        ' { name = "nvidia-x11-535.216.01-6.6"; };'
        " etc = builtins.mapAttrs (n: e: { inherit (e) mode user group;"
        " text = e.source.text or null; source = toString e.source; }) c.environment.etc;"
        " nvidiaVersion = c.hardware.nvidia.package.version; }"
    )
    doc = flake.eval_json("lib.testHostConfig", apply=keep)
    doc["environment"].pop("etc")
    return doc


def _engine(*args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "oldgpu", *args],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
        cwd=ROOT,
    ).stdout


# --- every file, every output ------------------------------------------------


def test_every_nix_file_parses() -> None:
    files = [f for f in _listed_files() if f.endswith(".nix")]
    assert "flake.nix" in files and "nix/module.nix" in files
    for rel in files:
        proc = subprocess.run(
            ["nix-instantiate", "--parse", rel],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=_env(),
        )
        assert proc.returncode == 0, f"{rel}: {proc.stderr}"


def test_flake_outputs(flake: Flake) -> None:
    show = json.loads(flake.run("flake", "show", "--json", flake.ref).stdout)
    packages = show["packages"][SYSTEM]
    assert set(packages) >= {
        "default",
        "oldgpu",
        "verl-train",
        "verl-src",
        "verl-patched",
        "unit",
        "host-driver",
        "runtime-libs",
    }
    assert all(p["type"] == "derivation" for p in packages.values())
    assert show["devShells"][SYSTEM]["default"]["type"] == "derivation"
    assert show["nixosModules"]["default"]["type"] == "nixos-module"
    assert show["nixosConfigurations"]["verl-test"]["type"] == "nixos-configuration"
    assert set(show["checks"][SYSTEM]) == {"formatting", "engine-tests", "pins", "module"}
    assert show["formatter"][SYSTEM]["type"] == "derivation"


def test_flake_check_evaluates_every_output(flake: Flake) -> None:
    # Every derivation instantiated, the module's host built to its toplevel
    # (with its assertions), nothing built.
    flake.run("flake", "check", "--no-build", flake.ref)


def test_flake_lock_pins_a_nixos_25_05_revision() -> None:
    lock = json.loads((ROOT / "flake.lock").read_text())
    node = lock["nodes"][lock["nodes"][lock["root"]]["inputs"]["nixpkgs"]]
    assert node["original"] == {
        "owner": "NixOS",
        "ref": "nixos-25.05",
        "repo": "nixpkgs",
        "type": "github",
    }
    assert len(node["locked"]["rev"]) == 40
    assert node["locked"]["narHash"].startswith("sha256-")


# --- versions: from the pins, equal to the locks ------------------------------


def test_versions_come_from_the_pins_file(flake: Flake, pins: dict) -> None:
    assert flake.eval_json("lib.pins") == pins
    versions = flake.eval_json("lib.versions")
    assert versions["python"] == pins["python"]["version"]
    assert versions["cuda"] == pins["cuda"]["version"]
    assert versions["torch"] == pins["torch"]["version"]
    assert versions["verl"] == pins["verl"]["version"]
    assert versions["verlCommit"] == pins["verl"]["commit"]
    assert flake.eval_json("lib.pythonAttr") == "python" + pins["python"]["version"].replace(
        ".", ""
    )
    assert flake.eval_json("lib.cudaPackagesAttr") == "cudaPackages_" + pins["cuda"][
        "version"
    ].replace(".", "_")
    src = flake.eval_json(f"packages.{SYSTEM}.verl-src", apply="s: { inherit (s) owner repo rev; }")
    assert src == {"owner": "volcengine", "repo": "verl", "rev": pins["verl"]["commit"]}
    assert f"verl-patched-{pins['verl']['version']}-pascal-6.1" == flake.eval_json(
        f"packages.{SYSTEM}.verl-patched.name"
    )
    hashes = json.loads((ROOT / "nix" / "source-hashes.json").read_text())
    assert pins["verl"]["commit"] in hashes["verl"]


def test_cuda_package_set_from_the_pins(flake: Flake, pins: dict) -> None:
    config = flake.eval_json(
        "lib.cudaPkgsFor",
        apply=(
            f'f: let c = (f "{SYSTEM}").config; in {{ inherit (c) cudaSupport cudaCapabilities; '
            'cuda = c.allowUnfreePredicate { name = "cuda_nvcc-11.8.89"; '
            'meta.license = { shortName = "CUDA EULA"; free = false; }; }; '
            'driver = c.allowUnfreePredicate { name = "nvidia-x11-535.216.01-6.6.90"; }; '
            'other = c.allowUnfreePredicate { name = "steam-1.0"; '
            'meta.license = { shortName = "unfree"; free = false; }; }; }'
        ),
    )
    assert config == {
        "cudaSupport": True,
        "cudaCapabilities": pins["torch"]["cuda_arch_list"],
        "cuda": True,
        "driver": True,
        "other": False,
    }
    free = flake.eval_json("lib.pkgsFor", apply=f'f: (f "{SYSTEM}").config')
    assert free == {}


@pytest.mark.parametrize("variant", ["cu118", "pypi"])
def test_flake_reads_the_locks_the_roles_install(flake: Flake, pins: dict, variant: str) -> None:
    lock = lockcheck.read_lock(ROOT / "files" / "requirements" / f"{variant}.lock")
    assert flake.eval_json(f"lib.locks.{variant}") == lock
    local = pins["torch"]["variants"][variant]["local_version"]
    for name, version in flake.eval_json("lib.versions.pythonPackages").items():
        want = version + (local if name == "torch" else "")
        assert lock[lockcheck.normalise(name)] == want, name


def _break_torch_pin(root: Path) -> None:
    path = root / "files" / "pins.json"
    doc = json.loads(path.read_text())
    doc["torch"]["version"] = doc["python_packages"]["torch"] = "2.6.1"
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _break_lock(root: Path) -> None:
    path = root / "files" / "requirements" / "cu118.lock"
    path.write_text(path.read_text().replace("transformers==4.51.3", "transformers==4.52.0"))


def _break_release_lock(root: Path) -> None:
    path = root / "files" / "requirements" / "verl-0.9.0-cu118.lock"
    path.write_text(path.read_text().replace("transformers==5.10.4", "transformers==5.10.5"))


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            _break_release_lock,
            "transformers: files/pins.json says 5.10.4,"
            " files/requirements/verl-0.9.0-cu118.lock has 5.10.5",
        ),
        (
            _break_torch_pin,
            "torch: files/pins.json says 2.6.1+cu118,"
            " files/requirements/cu118.lock has 2.6.0+cu118",
        ),
        (
            _break_lock,
            "transformers: files/pins.json says 4.51.3, files/requirements/cu118.lock has 4.52.0",
        ),
    ],
    ids=["release-lock", "pin", "lock"],
)
def test_pins_and_locks_that_disagree_fail(edited_flake, edit, needle: str) -> None:
    broken = edited_flake(edit)
    for args in (
        ["eval", "--json", f"{broken.ref}#lib.versions"],
        ["eval", "--raw", f"{broken.ref}#devShells.{SYSTEM}.default.drvPath"],
        ["flake", "check", "--no-build", broken.ref],
    ):
        proc = broken.run(*args, check=False)
        assert proc.returncode != 0, args
        assert "the pins and the locks the roles install disagree" in proc.stderr
        assert needle in proc.stderr


# --- the NixOS module ---------------------------------------------------------


def test_engine_data_is_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "nix_engine_data.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_job_options_are_the_engines_fields(flake: Flake) -> None:
    fields = json.loads(_engine("job", "fields", "--json"))
    job = flake.eval_json("lib.testHostConfig.services.verl-train.jobs.smoke")
    assert set(job) == {f["name"] for f in fields} | {"secretsFile"}
    given = json.loads((ROOT / "tests" / "nix" / "test-job.json").read_text())
    for f in fields:
        assert job[f["name"]] == given.get(f["name"], f["default"]), f["name"]


def test_env_file_is_what_the_engine_renders(flake: Flake, host: dict) -> None:
    expected = _engine("job", "env", "tests/nix/test-job.json")
    etc = host["etc"]["verl/jobs/smoke.env"]
    assert etc["text"] == expected
    assert (etc["mode"], etc["user"], etc["group"]) == ("0640", "root", "verl")
    # Built: the engine renders the job from the module's JSON and the build
    # compares its text with Nix's (then the check compares both with the engine).
    flake.build(f"checks.{SYSTEM}.module")
    assert Path(etc["source"]).read_text() == expected


def test_unit_is_the_file_the_role_installs(flake: Flake, host: dict) -> None:
    # The verl_jobs role copies roles/verl_jobs/files/verl-train@.service
    # (a link to files/systemd/) verbatim to /etc/systemd/system.
    role_file = (ROOT / "roles" / "verl_jobs" / "files" / "verl-train@.service").read_bytes()
    (unit,) = host["systemd"]["packages"]
    built = json.loads(flake.build(f"packages.{SYSTEM}.unit").stdout)[0]["outputs"]["out"]
    assert unit == built
    assert (Path(built) / "lib/systemd/system/verl-train@.service").read_bytes() == role_file
    assert sorted(p.name for p in (Path(built) / "lib/systemd/system").iterdir()) == [
        "verl-train@.service"
    ]


def test_units_and_paths_the_module_adds(flake: Flake, host: dict) -> None:
    services = host["systemd"]["services"]
    template = services["verl-train@"]
    assert template["overrideStrategy"] == "asDropin"
    env = template["environment"]
    verl = flake.eval_json(f"packages.{SYSTEM}.verl-patched.outPath")
    engine = flake.eval_json(f"packages.{SYSTEM}.oldgpu.outPath")
    assert env["VERL_DIR"] == verl
    assert env["OLDGPU_BIN"] == f"{engine}/bin/oldgpu"
    assert env["VERL_VENV"] == "/opt/verl/venv"
    assert template["wants"] == template["after"] == ["verl-venv.service"]
    job = services["verl-train@smoke"]
    assert job["overrideStrategy"] == "asDropin"
    assert job["restartTriggers"] == [host["etc"]["verl/jobs/smoke.env"]["source"]]
    assert job["wantedBy"] == []  # the test job is enabled: false
    venv = services["verl-venv"]
    assert "--no-index" in venv["script"] and "/srv/wheelhouse" in venv["script"]
    # The engine builds, verifies (lock-check, pip check) and links the venv.
    assert "oldgpu venv ensure /nix/store/" in venv["script"]
    assert "--link /opt/verl/venv --venvs /opt/verl/venvs" in venv["script"]
    start = flake.eval_json(f"packages.{SYSTEM}.verl-train.outPath")
    rules = host["systemd"]["tmpfiles"]["rules"]
    assert f"L+ /opt/verl/bin/verl-train - - - - {start}/bin/verl-train" in rules
    assert "d /etc/verl/jobs 0750 root verl -" in rules
    assert "d /var/lib/verl 0750 verl verl -" in rules
    assert host["users"]["users"]["verl"]["isSystemUser"] is True
    assert [a for a in host["assertions"] if not a["assertion"]] == []


def test_enabled_job_starts_at_boot(flake: Flake) -> None:
    wanted = flake.eval_json(
        "lib.testHostWith",
        apply=(
            "f: (f [ ({ lib, ... }:"
            " { services.verl-train.jobs.smoke.enabled = lib.mkForce true; }) ])"
            '.config.systemd.services."verl-train@smoke".wantedBy'
        ),
    )
    assert wanted == ["multi-user.target"]


def test_driver_for_pascal(host: dict) -> None:
    nvidia = host["hardware"]["nvidia"]
    assert nvidia["open"] is False
    assert host["nvidiaVersion"].startswith("535.")  # the engine's default branch
    assert nvidia["nvidiaPersistenced"] is True
    assert host["services"]["xserver"]["videoDrivers"] == ["nvidia"]
    assert host["hardware"]["graphics"]["enable"] is True
    assert host["nixpkgsConfig"]["nvidia"]["acceptLicense"] is True
    assert host["allowUnfree"] is True


@pytest.mark.parametrize(
    ("module", "needle"),
    [
        ("{ hardware.nvidia.open = true; }", "NVIDIA's open kernel modules need Turing or newer"),
        (
            '{ lib, ... }: { services.verl-train.gpu.architecture = lib.mkForce "kepler";'
            " services.verl-train.nvidia.branch = 535; }",
            "driver branch 535 does not drive kepler GPUs",
        ),
        ("{ services.verl-train.nvidia.branch = 580; }", "no NVIDIA driver of branch 580"),
        (
            '{ lib, ... }: { services.verl-train.python.wheelhouse = lib.mkForce ""; }',
            "services.verl-train.python.torchIndexUrl is empty",
        ),
        (
            '{ services.verl-train.jobs."Bad!" = { model_path = "/m"; train_files = "/t";'
            ' val_files = "/v"; total_steps = 1; }; }',
            "job name 'Bad!' must be 1-32 of a-z 0-9 _ -",
        ),
        (
            '{ services.verl-train.verlReleases = [ "0.6.1" ]; }',
            'verl-version-unknown: services.verl-train.verlReleases = ["0.6.1"]',
        ),
        (
            '{ services.verl-train.verlReleases = [ "0.5.0" ]; }',
            "the default release 0.5.0 is always installed",
        ),
        (
            '{ lib, ... }: { services.verl-train.jobs.smoke.verl_version = lib.mkForce "0.9.0"; }',
            "job-verl-release-missing in job smoke: verl_version 0.9.0",
        ),
    ],
    ids=[
        "open-on-pascal",
        "kepler-535",
        "no-580-in-25.05",
        "no-torch-index",
        "job-name",
        "release-unknown",
        "release-default",
        "job-release-missing",
    ],
)
def test_module_refuses(flake: Flake, module: str, needle: str) -> None:
    proc = flake.run(
        "eval",
        "--raw",
        f"{flake.ref}#lib.testHostWith",
        "--apply",
        f"f: (f [ ({module}) ]).config.system.build.toplevel.drvPath",
        check=False,
    )
    assert proc.returncode != 0
    assert needle in proc.stderr


RELEASE_HOST = (
    'f: let c = (f [ ({ lib, ... }: { services.verl-train.verlReleases = [ "0.9.0" ];'
    ' services.verl-train.jobs.smoke.verl_version = lib.mkForce "0.9.0"; }) ]).config; in'
    " { rules = c.systemd.tmpfiles.rules; script = c.systemd.services.verl-venv.script;"
    ' env = c.systemd.services."verl-train@".environment;'
    " failed = map (a: a.message) (builtins.filter (a: !a.assertion) c.assertions); }"
)


def test_a_release_is_laid_down_from_the_pins(flake: Flake, pins: dict) -> None:
    """services.verl-train.verlReleases = [ "0.9.0" ]: the release's venv from its own lock
    and its sdist (the pinned sha256) patched for the profile, in the engine's places, and
    the variables a job's verl_version reads them from."""
    from oldgpu import paths, verl_release

    rel = pins["verl_releases"]["0.9.0"]
    tree = flake.eval_json(
        "lib.packagesFor",
        apply=(
            'f: let t = (f "x86_64-linux").verlReleaseFor "0.9.0" "pascal"; in'
            " { out = t.outPath; inherit (t) name profile version;"
            " sha256 = t.src.sha256; src = t.src.name; drv = t.drvPath; }"
        ),
    )
    assert tree["sha256"] == rel["sdist_sha256"]
    assert tree["src"] == "verl-0.9.0.tar.gz"
    assert (tree["name"], tree["profile"], tree["version"]) == (
        "verl-patched-0.9.0-pascal-6.1", "pascal-6.1", "0.9.0",
    )  # fmt: skip
    drv = subprocess.run(
        ["nix", "show-derivation", tree["drv"]], capture_output=True, text=True, env=_env()
    )
    script = json.loads(drv.stdout)[tree["drv"]]["args"][-1]
    assert "oldgpu patch $out --profile pascal-6.1 --check" in script

    host = flake.eval_json("lib.testHostWith", apply=RELEASE_HOST)
    assert host["failed"] == []  # the job on 0.9.0 is accepted: the host carries it
    where = json.loads(_engine("paths", "--json"))["releases"]["0.9.0"]
    assert where == paths.releases()["0.9.0"]
    assert f"L+ {where['verl_dir']} - - - - {tree['out']}" in host["rules"]
    assert f"d {where['venvs_dir']} 0755 root root -" in host["rules"]
    line = next(x for x in host["script"].splitlines() if f"--link {where['venv_dir']}" in x)
    lock = line.split()[3]
    assert lock.startswith("/nix/store/") and lock.endswith("-verl-0.9.0-cu118.lock")
    assert Path(lock).read_text() == (ROOT / "files/requirements/verl-0.9.0-cu118.lock").read_text()
    assert f"--venvs {where['venvs_dir']}" in line
    # the same sources as the default's venv (here the test host's wheelhouse)
    assert host["script"].count("'--no-index' '--wheelhouse' '/srv/wheelhouse'") == 2
    # the default's venv still first, with its own lock
    assert "--link /opt/verl/venv --venvs /opt/verl/venvs" in host["script"]
    # a job's verl_version picks the release's tree and venv from the unit's variables
    picked = verl_release.dirs("0.9.0", host["env"])
    assert picked == {"venv": where["venv_dir"], "tree": tree["out"]}
    assert verl_release.dirs("0.5.0", host["env"])["tree"] == host["env"]["VERL_DIR"]


def test_a_job_the_engine_refuses_does_not_build(flake: Flake) -> None:
    drv = flake.run(
        "eval",
        "--raw",
        f"{flake.ref}#lib.testHostWith",
        "--apply",
        "f: (f [ ({ lib, ... }: { services.verl-train.jobs.smoke.save_freq = lib.mkForce 0; }) ])"
        '.config.environment.etc."verl/jobs/smoke.env".source.drvPath',
    ).stdout
    proc = subprocess.run(
        ["nix-store", "--realise", drv], capture_output=True, text=True, env=_env()
    )
    assert proc.returncode != 0
    assert "save_freq: 0 must be at least 1" in proc.stderr


# --- the dev shell ------------------------------------------------------------


def test_dev_shell(flake: Flake) -> None:
    shell = flake.eval_json(
        f"devShells.{SYSTEM}.default",
        apply=(
            "s: { inherit (s) name shellHook OLDGPU_RUNTIME_LIBS; python = s.OLDGPU_PYTHON;"
            " verl = toString s.VERL_DIR; locks = toString s.OLDGPU_LOCKS;"
            " packages = map (p: p.name) s.packages; }"
        ),
    )
    assert shell["shellHook"] == (ROOT / "nix" / "shell-hook.sh").read_text()
    assert shell["verl"] == flake.eval_json(f"packages.{SYSTEM}.verl-patched.outPath")
    # The shell carries the repository's locks as they are (vllm.lock too: the volta
    # and turing profiles' stack, which the shell's venv does not install).
    locks = sorted(p.name for p in (ROOT / "files" / "requirements").glob("*.lock"))
    assert {"cu118.lock", "pypi.lock"} <= set(locks)
    assert sorted(p.name for p in Path(shell["locks"]).iterdir()) == locks
    assert (Path(shell["locks"]) / "cu118.lock").read_bytes() == (
        ROOT / "files/requirements/cu118.lock"
    ).read_bytes()
    assert "cudatoolkit-11.8-stub" in shell["packages"]  # from the CUDA package set
    assert {"oldgpu-0.1.0", "oldgpu-host-driver"} <= set(shell["packages"])


def _fake_tools(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "oldgpu-host-driver").unlink(missing_ok=True)
    (bin_dir / "oldgpu-host-driver").symlink_to(ROOT / "nix" / "host-driver.sh")
    engine = bin_dir / "oldgpu"
    engine.write_text(
        "#!/bin/sh\n"
        f'exec {sys.executable} -I -c \'import sys; sys.path.insert(0, "{ROOT / "src"}");'
        ' from oldgpu.cli import main; sys.exit(main())\' "$@"\n'
    )
    engine.chmod(0o755)
    return bin_dir


def test_host_driver_found_and_isolated(tmp_path: Path) -> None:
    drv = tmp_path / "drv"
    drv.mkdir()
    for name in ("libcuda.so.535.216.01", "libnvidia-ml.so.535.216.01", "libc.so.6"):
        (drv / name).write_text("")
    (drv / "libcuda.so.1").symlink_to("libcuda.so.535.216.01")
    env = dict(
        os.environ,
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        OLDGPU_DRIVER_SEARCH_PATH=f"{tmp_path / 'none'}:{drv}",
    )
    out = subprocess.run(
        [str(ROOT / "nix" / "host-driver.sh")], capture_output=True, text=True, env=env, check=True
    ).stdout.strip()
    # Only the driver's own libraries: never the host's C library.
    assert sorted(p.name for p in Path(out).iterdir()) == [
        "libcuda.so.1",
        "libcuda.so.535.216.01",
        "libnvidia-ml.so.535.216.01",
    ]
    assert (Path(out) / "libcuda.so.1").resolve() == (drv / "libcuda.so.535.216.01").resolve()


def test_host_driver_missing_says_so(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        OLDGPU_DRIVER_SEARCH_PATH=str(tmp_path / "none"),
        OLDGPU_MIN_DRIVER="520.61.05",
    )
    proc = subprocess.run(
        [str(ROOT / "nix" / "host-driver.sh")], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 1
    assert "no NVIDIA driver library (libcuda.so.1) found" in proc.stderr
    assert "OLDGPU_LIBCUDA_DIR" in proc.stderr and "520.61.05" in proc.stderr


def _host_driver_fit(tmp_path: Path, proc_version: str) -> subprocess.CompletedProcess[str]:
    drv = tmp_path / "drv"
    drv.mkdir(exist_ok=True)
    (drv / "libcuda.so.1").write_text("")
    proc = tmp_path / "version"
    proc.write_text(proc_version)
    env = dict(
        os.environ,
        PATH=f"{_fake_tools(tmp_path)}:{os.environ['PATH']}",
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        OLDGPU_LIBCUDA_DIR=str(drv),
        OLDGPU_PROC_DRIVER_VERSION=str(proc),
    )
    return subprocess.run(
        [str(ROOT / "nix" / "host-driver.sh")], capture_output=True, text=True, env=env, check=True
    )


def test_host_driver_says_what_the_engine_says_of_an_old_driver(tmp_path: Path) -> None:
    proc = _host_driver_fit(
        tmp_path, "NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.256.02  Thu May  2 2024\n"
    )
    message = driver.cuda_fit("470.256.02", source="loaded module")["message"]
    assert "minor-version compatibility" in message
    assert proc.stderr == f"oldgpu-host-driver: {message}\n"
    assert Path(proc.stdout.strip(), "libcuda.so.1").exists()


def test_host_driver_is_quiet_about_a_driver_that_fits(tmp_path: Path) -> None:
    proc = _host_driver_fit(
        tmp_path, "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.216.01  Wed Oct 2 2024\n"
    )
    assert proc.stderr == ""


def test_host_driver_says_when_the_engine_cannot_judge(tmp_path: Path) -> None:
    proc = _host_driver_fit(tmp_path, "not the driver's version line\n")
    assert "how the driver fits CUDA is unknown" in proc.stderr


def _hook(tmp_path: Path, locks: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    script = (
        f"source {ROOT / 'nix' / 'shell-hook.sh'}\n"
        'echo "VENV=${VERL_VENV:-} PYTHONPATH=${PYTHONPATH:-} LD=${LD_LIBRARY_PATH:-}"\n'
    )
    env = dict(
        os.environ,
        PATH=f"{_fake_tools(tmp_path)}:{os.environ['PATH']}",
        HOME=str(tmp_path),
        OLDGPU_PYTHON=sys.executable,
        OLDGPU_LOCKS=str(locks),
        OLDGPU_RUNTIME_LIBS="/runtime-libs",
        VERL_DIR="/verl-patched",
        OLDGPU_DRIVER_SEARCH_PATH=str(tmp_path / "none"),
        **extra,
    )
    for key in ("VIRTUAL_ENV", "PYTHONPATH", "OLDGPU_TORCH_INDEX_URL", "OLDGPU_WHEELHOUSE"):
        if key not in extra:
            env.pop(key, None)
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env)


def test_shell_hook_asks_for_the_cu118_index(tmp_path: Path) -> None:
    proc = _hook(tmp_path, ROOT / "files" / "requirements")
    assert proc.returncode == 0
    assert "Set OLDGPU_TORCH_INDEX_URL" in proc.stderr
    assert "VENV= " in proc.stdout
    assert "LD=/runtime-libs" in proc.stdout  # no driver here: the shell still works on CPU
    assert not (tmp_path / ".cache" / "oldgpu" / "venvs").exists()


def test_shell_hook_builds_and_checks_the_venv(tmp_path: Path) -> None:
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / "pypi.lock").write_text("# the hook's steps, offline\ntinyapp==1.0\n")
    make_wheel(tmp_path / "wheels", "tinyapp", "1.0")
    wheels = str(tmp_path / "wheels")
    proc = _hook(tmp_path, locks, OLDGPU_LOCK_VARIANT="pypi", OLDGPU_WHEELHOUSE=wheels)
    assert proc.returncode == 0, proc.stderr
    # Built, verified and linked by `oldgpu venv ensure`: no build marker left.
    base = tmp_path / ".cache" / "oldgpu" / "venvs" / "pypi"
    (venv,) = (p for p in (base / "venvs").iterdir() if not p.name.startswith("."))
    assert os.readlink(base / "venv") == str(venv)
    assert not list((base / "venvs").glob(".*.building"))
    assert f"VENV={venv} PYTHONPATH=/verl-patched " in proc.stdout
    # Entering again reuses it.
    again = _hook(tmp_path, locks, OLDGPU_LOCK_VARIANT="pypi", OLDGPU_WHEELHOUSE=wheels)
    assert "building" not in again.stderr
    assert f"VENV={venv} " in again.stdout
