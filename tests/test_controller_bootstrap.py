"""Step 1 of the README's five steps, as a user who is not root.

scripts/bootstrap-controller.sh checks what it needs before it changes anything
(Python >= 3.11, ensurepip, a writable OLDGPU_CACHE and checkout) and stops with a
named error, its fix and its own exit code; scripts/host-packages.sh passes a
non-root user whose packages are there and names the apt command otherwise. Each
test runs the scripts in a copy of the checkout: as `nobody` (setpriv) when the
suite runs as root, else as the user running it. One test runs the whole bootstrap
that way (a new venv from the pip index the machine is configured with).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
AS_ROOT = os.geteuid() == 0
NOBODY = 65534
# What the bootstrap reads: its scripts, the controller's lock and the engine (pip -e).
CHECKOUT = ("scripts", "requirements", "src", "pyproject.toml", "README.md")
SYSTEM_PYTHON = (
    "/usr/bin/python3" if Path("/usr/bin/python3").is_file() else shutil.which("python3")
)

pytestmark = pytest.mark.skipif(
    AS_ROOT and shutil.which("setpriv") is None,
    reason="runs as root without setpriv to drop to nobody",
)


def _own(path: Path) -> None:
    if AS_ROOT:
        for p in [path, *path.rglob("*")]:
            os.lchown(p, NOBODY, NOBODY)


@pytest.fixture
def tmp_path():
    """A temporary directory the unprivileged user can reach (pytest's own is
    under a 0700 directory of the user running the suite)."""
    path = Path(tempfile.mkdtemp(prefix="oldgpu-bootstrap-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def home(tmp_path) -> Path:
    """A home the unprivileged user owns."""
    home = tmp_path / "home"
    home.mkdir()
    _own(home)
    return home


@pytest.fixture
def checkout(tmp_path, home) -> Path:
    """A copy of what the bootstrap reads, owned by the unprivileged user."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in CHECKOUT:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(
                src, repo / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
            )
        else:
            shutil.copy2(src, repo / name)
    _own(repo)
    return repo


def run_unprivileged(script: Path, home: Path, extra_env: dict[str, str], timeout: int = 60):
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
    # The machine's pip and proxy settings (its index, certificates), nothing else of ours.
    env |= {
        k: v for k, v in os.environ.items() if k.startswith("PIP_") or k.lower().endswith("_proxy")
    }
    env |= extra_env
    argv = [str(script)]
    if AS_ROOT:
        argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
    return subprocess.run(
        ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv],
        cwd=script.parents[1],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def bootstrap(checkout: Path, home: Path, **env: str):
    return run_unprivileged(
        checkout / "scripts" / "bootstrap-controller.sh", home, env, timeout=600
    )


def assert_refused(
    proc, code: str, status: int, fix: str, checkout: Path, cache: Path | None = None
):
    assert proc.returncode == status, proc.stdout + proc.stderr
    assert f"{code}:" in proc.stderr
    assert "fix:" in proc.stderr and fix in proc.stderr
    assert "Nothing was changed." in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (checkout / ".venv").exists()
    assert not (checkout / ".collections").exists()
    if cache is not None:
        assert not cache.exists()


@pytest.fixture
def python_shadow(tmp_path) -> Path:
    """A PYTHONPATH directory the tests fill to make the real interpreter look older
    or without ensurepip (what Debian's python3 is without python3-venv)."""
    d = tmp_path / "pythonpath"
    d.mkdir()
    return d


def test_missing_python_is_named(checkout, home, tmp_path):
    cache = tmp_path / "cache"
    proc = bootstrap(checkout, home, OLDGPU_CACHE=str(cache), PYTHON="python3-nonexistent")
    assert_refused(proc, "controller-python-missing", 10, "PYTHON", checkout, cache)


def test_python_older_than_3_11_is_refused(checkout, home, tmp_path, python_shadow):
    # Ubuntu 22.04's python3 is 3.10; ansible-core 2.19 cannot run on it.
    (python_shadow / "sitecustomize.py").write_text(
        "import sys\nsys.version_info = (3, 10, 12, 'final', 0)\n"
    )
    cache = tmp_path / "cache"
    proc = bootstrap(
        checkout, home, OLDGPU_CACHE=str(cache), PYTHON=SYSTEM_PYTHON, PYTHONPATH=str(python_shadow)
    )
    assert_refused(proc, "controller-python-too-old", 11, "PYTHON=python3.11", checkout, cache)
    assert "Python 3.10" in proc.stderr and "Ubuntu 22.04" in proc.stderr


def test_python_without_ensurepip_is_refused(checkout, home, tmp_path, python_shadow):
    (python_shadow / "ensurepip").mkdir()
    (python_shadow / "ensurepip" / "__init__.py").write_text(
        "raise ImportError('no python3-venv')\n"
    )
    cache = tmp_path / "cache"
    proc = bootstrap(
        checkout, home, OLDGPU_CACHE=str(cache), PYTHON=SYSTEM_PYTHON, PYTHONPATH=str(python_shadow)
    )
    assert_refused(
        proc, "controller-python-venv-missing", 12, "apt-get install python3-venv", checkout, cache
    )


def test_unwritable_cache_is_refused(checkout, home, tmp_path):
    # The default /var/cache/oldgpu, as a user who is not root: a directory it cannot write.
    locked = tmp_path / "root-owned"
    locked.mkdir(mode=0o755)
    if not AS_ROOT:
        locked.chmod(0o555)
    cache = locked / "oldgpu"
    proc = bootstrap(checkout, home, OLDGPU_CACHE=str(cache), PYTHON=SYSTEM_PYTHON)
    assert_refused(proc, "controller-cache-unwritable", 13, "OLDGPU_CACHE=", checkout, cache)


def test_unwritable_checkout_is_refused(checkout, home, tmp_path):
    if AS_ROOT:
        os.chown(checkout, 0, 0)
    else:
        checkout.chmod(0o555)
    cache = tmp_path / "cache"
    proc = bootstrap(checkout, home, OLDGPU_CACHE=str(cache), PYTHON=SYSTEM_PYTHON)
    checkout.chmod(0o755)
    assert_refused(proc, "controller-checkout-unwritable", 14, "OLDGPU_VENV", checkout, cache)


def test_bootstrap_as_a_user_with_its_own_cache(checkout, home, tmp_path):
    """The README's step 1 as a user who is not root: a fresh venv with the pinned
    tools, the ansible wheel in OLDGPU_CACHE, the collections in the checkout;
    the second run changes nothing."""
    cache = tmp_path / "cache"
    cache.mkdir()
    _own(cache)
    proc = bootstrap(checkout, home, OLDGPU_CACHE=str(cache), PYTHON=SYSTEM_PYTHON)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    venv = checkout / ".venv"
    for tool in ("ansible-playbook", "ansible-inventory", "oldgpu"):
        assert (venv / "bin" / tool).is_file(), tool
    assert list((cache / "wheels").glob("ansible-*/ansible-*.whl"))
    assert list((checkout / ".collections").glob(".from-ansible-*"))
    assert (checkout / ".collections" / "ansible_collections" / "community" / "general").is_dir()
    if AS_ROOT:
        assert (venv / "bin" / "python").lstat().st_uid == NOBODY

    again = bootstrap(checkout, home, OLDGPU_CACHE=str(cache), PYTHON=SYSTEM_PYTHON)
    assert again.returncode == 0, again.stderr
    assert "venv up to date" in again.stdout and "collections up to date" in again.stdout


def _dpkg_query_without(tmp_path: Path, package: str) -> Path:
    """dpkg-query as the machine's, except that PACKAGE reads as not installed."""
    real = shutil.which("dpkg-query")
    assert real, "dpkg-query"
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    exe = shim / "dpkg-query"
    exe.write_text(
        "#!/bin/sh\n"
        f'for a in "$@"; do [ "$a" = {package} ] && '
        '{ printf "unknown ok not-installed"; exit 0; }; done\n'
        f'exec {real} "$@"\n'
    )
    exe.chmod(0o755)
    return shim


@pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not a Debian/Ubuntu controller")
def test_host_packages_as_a_user(checkout, home, tmp_path):
    script = checkout / "scripts" / "host-packages.sh"
    installed = run_unprivileged(script, home, {})
    assert installed.returncode == 0, installed.stderr  # make bootstrap installed them, as root

    shim = _dpkg_query_without(tmp_path, "debootstrap")
    proc = run_unprivileged(script, home, {"PATH": f"{shim}:/usr/local/bin:/usr/bin:/bin"})
    assert proc.returncode == 15, proc.stdout + proc.stderr
    assert "host-packages-missing: debootstrap not installed" in proc.stderr
    assert "apt-get install --no-install-recommends debootstrap" in proc.stderr
    assert "Nothing was changed." in proc.stderr
