"""Build the carry for the lent GPU machine: what it lacks to run verl 0.5.0, small.

The device machine has Python 3.12 and its own (newer) torch, but none of verl's other
dependencies and no network. The device tool copies the git working tree and up to 8
ignored paths (64 MiB in all) per call, so everything goes, xz-compressed, into one
ignored directory, ``.device/carry/`` (name it in the tool's ``carry``):

- ``site.tar.xz``: verl's dependencies, always first on PYTHONPATH (versions from
  ``files/requirements/pypi.lock``): cp312 wheels from the configured pip index,
  installed with ``pip install --no-deps --target`` for Python 3.12; the two sdist-only
  ones (antlr4-python3-runtime, pylatexenc) are built into wheels here.
- ``fallback.tar.xz``: common packages the machine probably has (pyyaml, requests,
  regex, safetensors...), one directory each; ``bench/setup.sh`` adds only those it
  cannot import.
- ``ray.tar.xz``: ray 2.47.1 without its jars, rllib, tune, serve, data, train, llm, air,
  the dashboard's built client and tests, with its ELF files stripped.
- ``verl.tar.xz``: verl 0.5.0 from its sdist, patched with ``oldgpu patch DIR --profile
  pascal`` (the patcher the roles use).
- ``MANIFEST.json``: what is in each, sizes and sha256.

The engine (``src/oldgpu``: the guard and its sitecustomize, the job composer, the
planner) and the start script (``files/bin/verl-train``) are tracked files: they travel
with the working tree, as they are when the call is made, and bench/setup.sh uses them
from there. The limit is on all of it: the tree that travels plus the carry, 64 MiB; the
check below counts both.

Downloads are kept in ``.device/carry-cache/`` (not carried), so a re-pack is quick.

    python3 bench/pack_carry.py [--out .device/carry] [--cache .device/carry-cache]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_run import run_checked

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "files" / "requirements" / "pypi.lock"
SDIST_CACHE = Path(os.environ.get("OLDGPU_CACHE", "/var/cache/oldgpu")) / "sdists"
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
# The device tool's limit on everything that travels: the working tree (tracked and
# untracked-not-ignored files) and the carried paths.
LIMIT_MIB = 64

# Always carried (on PYTHONPATH before the machine's own): what verl 0.5.0 imports on
# the PPO path and its pins, as seen to work there (shared notes), plus accelerate and
# tensordict's cloudpickle which peft and tensordict import.
SITE = (
    "transformers",
    "tokenizers",
    "huggingface-hub",
    "hydra-core",
    "omegaconf",
    "antlr4-python3-runtime",
    "pylatexenc",
    "codetiming",
    "tensordict",
    "pyvers",
    "orjson",
    "importlib-metadata",
    "zipp",
    "datasets",
    "dill",
    "multiprocess",
    "fsspec",
    "torchdata",
    "peft",
    "accelerate",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
)
# A newer verl release's own packages (``--release``), first on PYTHONPATH instead of
# ``site`` for that release's jobs: SITE's names at the release lock's versions, and what
# its rollout path imports without declaring it (docs/newer-verl.md). Ray and the
# fallback packages are shared: the release locks pin the same Ray.
RELEASE_SITE = (
    *SITE,
    "fastapi",
    "starlette",
    "uvicorn",
    "cachetools",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "annotated-doc",
    "typing-inspection",
    "hf-xet",
    "httpx",
    "httpcore",
    "h11",
    "anyio",
    "sniffio",
    "shellingham",
    "typer",
    # fastapi's telemetry imports the API at module level
    "opentelemetry-api",
)
# Added on the machine only where it cannot import them.
FALLBACK = (
    "pyyaml",
    "requests",
    "urllib3",
    "idna",
    "certifi",
    "charset-normalizer",
    "filelock",
    "packaging",
    "tqdm",
    "regex",
    "safetensors",
    "xxhash",
    "psutil",
    "cloudpickle",
    "click",
    "msgpack",
    "protobuf",
    "attrs",
    "typing-extensions",
    "aiohttp",
    "aiosignal",
    "frozenlist",
    "multidict",
    "yarl",
    "propcache",
    "aiohappyeyeballs",
    "jinja2",
    "markupsafe",
    # The jobs log to tensorboard too (torch.utils.tensorboard's writer needs absl).
    "tensorboard",
    "absl-py",
)
# Parts of the carried packages a training run never imports.
DROP = ("tensorboard/webfiles.zip",)
SDIST_ONLY = ("antlr4-python3-runtime", "pylatexenc")
RAY = "ray"
# Parts of ray the PPO path never imports.
RAY_DROP = (
    "ray/jars",
    "ray/rllib",
    "ray/tune",
    "ray/serve",
    "ray/data",
    "ray/train",
    "ray/llm",
    "ray/workflow",
    "ray/dashboard/client/build",
    "ray/tests",
    "ray/core/src/ray/raylet/raylet.debug",
)


def log(msg: str) -> None:
    print(f"[pack] {msg}", flush=True)


def lock_versions(lock: Path = LOCK) -> dict[str, str]:
    out = {}
    for line in lock.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[_norm(name)] = version.strip()
    return out


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"pip failed: {' '.join(cmd)}")


def _platform_args() -> list[str]:
    args = ["--python-version", PYTHON_VERSION, "--implementation", "cp", "--only-binary=:all:"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def fetch(reqs: list[str], wheels: Path) -> None:
    """Download (or build, for the sdist-only ones) a cp312 wheel of each requirement."""
    wheels.mkdir(parents=True, exist_ok=True)
    binary = [r for r in reqs if _norm(r.split("==")[0]) not in SDIST_ONLY]
    sdist = [r for r in reqs if _norm(r.split("==")[0]) in SDIST_ONLY]
    missing = [r for r in binary if not _cached(r, wheels)]
    if missing:
        log(f"downloading {len(missing)} wheels for Python {PYTHON_VERSION}")
        pip("download", "--no-deps", "-d", str(wheels), *_platform_args(), *missing)
    for req in sdist:
        if not _cached(req, wheels):
            log(f"building a wheel of {req} (sdist only)")
            pip("wheel", "--no-deps", "--no-binary", ":all:", "-w", str(wheels), req)


def _cached(req: str, wheels: Path) -> bool:
    name, version = req.split("==")
    stem = f"{_norm(name).replace('-', '_')}-{version}-"
    return any(
        p.name.lower().replace("-", "_").startswith(stem.lower().replace("-", "_"))
        and p.suffix == ".whl"
        for p in wheels.iterdir()
    )


def install(reqs: list[str], wheels: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    pip(
        "install",
        "--no-deps",
        "--no-index",
        "--find-links",
        str(wheels),
        "--target",
        str(target),
        "--no-compile",
        "--upgrade",
        *_platform_args(),
        *reqs,
    )
    shutil.rmtree(target / "bin", ignore_errors=True)  # console scripts: not used


def clean(tree: Path) -> None:
    for cache in list(tree.rglob("__pycache__")):
        shutil.rmtree(cache, ignore_errors=True)
    for pyc in list(tree.rglob("*.pyc")):
        pyc.unlink()


def strip_elf(tree: Path) -> int:
    saved = 0
    strip = shutil.which("strip")
    if not strip:
        log("no strip: ELF files stay as they are")
        return 0
    for path in tree.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        with path.open("rb") as fh:
            if fh.read(4) != b"\x7fELF":
                continue
        before = path.stat().st_size
        subprocess.run([strip, "--strip-unneeded", str(path)], capture_output=True, check=False)
        saved += before - path.stat().st_size
    return saved


def top_level(target: Path) -> list[str]:
    """The importable top-level names a --target directory holds (``google.protobuf`` for a
    namespace package, so that a check imports the real thing)."""
    names = set()
    for entry in target.iterdir():
        if entry.name.endswith((".dist-info", ".data")):
            continue
        if entry.is_dir() and entry.name.isidentifier():
            if (entry / "__init__.py").exists():
                names.add(entry.name)
            else:  # a namespace package: name its packages
                names.update(
                    f"{entry.name}.{sub.name}"
                    for sub in entry.iterdir()
                    if sub.is_dir() and (sub / "__init__.py").exists()
                )
        elif entry.suffix == ".py" and entry.stem.isidentifier():
            names.add(entry.stem)
        elif entry.suffix == ".so":
            names.add(entry.name.split(".", 1)[0])
    return sorted(names)


def archive(src_dir: Path, arcname: str, dest: Path) -> dict[str, object]:
    """tar + xz -9 (multi-threaded), deterministic order and owners."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    with tempfile.TemporaryDirectory() as scratch:
        plain = Path(scratch) / "a.tar"
        with tarfile.open(plain, "w", format=tarfile.PAX_FORMAT) as tar:

            def reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                info.mtime = 0
                return info

            paths = sorted(src_dir.rglob("*"))
            tar.add(src_dir, arcname=arcname, recursive=False, filter=reset)
            for path in paths:
                rel = path.relative_to(src_dir)
                tar.add(path, arcname=f"{arcname}/{rel}", recursive=False, filter=reset)
        with tmp.open("wb") as out:
            subprocess.run(["xz", "-9", "-T0", "-c", str(plain)], stdout=out, check=True)
    os.replace(tmp, dest)
    data = dest.read_bytes()
    return {
        "file": dest.name,
        "bytes": len(data),
        "mib": round(len(data) / 2**20, 2),
        "sha256": hashlib.sha256(data).hexdigest(),
        "unpacked_mib": round(sum(p.stat().st_size for p in paths if p.is_file()) / 2**20, 1),
    }


def release_lock(version: str) -> Path:
    """A newer release's lock (pins.verl_releases.<v>.lock, the default index's variant:
    the machine's own torch is used, only the pure-Python closure travels)."""
    pins = json.loads((ROOT / "files" / "pins.json").read_text())
    name = pins["verl_releases"][version]["lock"]
    return ROOT / "files" / "requirements" / f"{name}.lock"


def patched_verl(work: Path, version: str) -> Path:
    sdist = SDIST_CACHE / f"verl-{version}.tar.gz"
    if not sdist.exists():
        raise SystemExit(f"{sdist} missing: run the engine's tests once (they fetch it)")
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(work, filter="data")
        else:  # Python without extraction filters
            tar.extractall(work)
    tree = work / f"verl-{version}"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    argv = [sys.executable, "-m", "oldgpu", "patch", str(tree), "--profile", "pascal", "--json"]
    patched = run_checked(argv, env, "oldgpu patch")
    out = work / "verl-tree"
    out.mkdir()
    shutil.copytree(tree / "verl", out / "verl")
    # The originals of the patched files: the doctor's patch check reads them.
    shutil.copytree(tree / ".oldgpu-originals", out / ".oldgpu-originals")
    for name in (".oldgpu-patch.json", "PKG-INFO", "LICENSE"):
        if (tree / name).exists():
            shutil.copy2(tree / name, out / name)
    doc = json.loads(patched)
    log(
        f"verl {doc['verl_version']} patched ({doc['options']['compute_dtype']}, "
        f"{doc['options']['attn_implementation']}): "
        + ", ".join(sorted({p["name"] for p in doc["patches"]} if doc.get("patches") else []))
    )
    return out


def pack_release(
    args: argparse.Namespace,
    work: Path,
    wheels: Path,
    default_versions: dict[str, str],
    archives: dict[str, Any],
) -> None:
    """site-<v> and verl-<v> for a newer release (the default's ray must be its ray)."""
    v = args.release
    lock = args.lock or release_lock(v)
    versions = lock_versions(lock)
    if versions.get("ray") != default_versions.get("ray"):
        raise SystemExit(
            f"verl {v}'s lock pins ray {versions.get('ray')}, the default's "
            f"{default_versions.get('ray')}: the carry shares one ray"
        )
    reqs = [f"{n}=={versions[_norm(n)]}" for n in RELEASE_SITE if _norm(n) in versions]
    fetch(reqs, wheels)
    site = work / f"site-{v}"
    install(reqs, wheels, site)
    for rel in DROP:
        (site / rel).unlink(missing_ok=True)
    clean(site)
    archives[f"site-{v}"] = {
        **archive(site, f"site-{v}", args.out / f"site-{v}.tar.xz"),
        "packages": reqs,
        "lock": str(lock.relative_to(ROOT) if lock.is_relative_to(ROOT) else lock),
    }
    log(f"site-{v}: {archives[f'site-{v}']['mib']} MiB")
    tree = patched_verl(work / f"verl-{v}", v)
    archives[f"verl-{v}"] = {
        **archive(tree, f"verl-tree-{v}", args.out / f"verl-{v}.tar.xz"),
        "verl": v,
        "profile": "pascal",
    }


def tree_bytes() -> int:
    """The size of the working tree the device tool sends: tracked files and untracked
    ones git does not ignore."""
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    )
    total = 0
    for name in proc.stdout.decode().split("\0"):
        path = ROOT / name
        if name and path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".device" / "carry")
    parser.add_argument("--cache", type=Path, default=ROOT / ".device" / "carry-cache")
    parser.add_argument("--only", nargs="*", help="rebuild only these archives (site, ...)")
    parser.add_argument(
        "--release",
        help="also pack this newer verl release: site-<v>.tar.xz (its lock's packages) and "
        "verl-<v>.tar.xz (its sdist patched for pascal), beside the default's archives",
    )
    parser.add_argument("--lock", type=Path, help="the release's lock (default: its pins')")
    args = parser.parse_args()
    versions = lock_versions()
    wheels = args.cache / "wheels"
    want = set(args.only or ("site", "fallback", "ray", "verl"))
    if args.release:
        want = set(args.only or (f"site-{args.release}", f"verl-{args.release}"))

    def req(name: str) -> str:
        return f"{name}=={versions[_norm(name)]}"

    manifest_path = args.out / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest.update(
        {
            "python": PYTHON_VERSION,
            "platforms": list(PLATFORMS),
            "packed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    )
    archives = manifest.setdefault("archives", {})
    with tempfile.TemporaryDirectory(prefix="oldgpu-carry-") as scratch:
        work = Path(scratch)
        if "site" in want:
            reqs = [req(n) for n in SITE]
            fetch(reqs, wheels)
            site = work / "site"
            install(reqs, wheels, site)
            clean(site)
            archives["site"] = {**archive(site, "site", args.out / "site.tar.xz"), "packages": reqs}
            log(f"site: {archives['site']['mib']} MiB")
        if "fallback" in want:
            reqs = [req(n) for n in FALLBACK]
            fetch(reqs, wheels)
            root = work / "fallback"
            index = {}
            for r in reqs:
                target = root / _norm(r.split("==")[0])
                install([r], wheels, target)
                for rel in DROP:
                    (target / rel).unlink(missing_ok=True)
                clean(target)
                index[_norm(r.split("==")[0])] = {"requirement": r, "modules": top_level(target)}
            (root / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
            archives["fallback"] = {
                **archive(root, "fallback", args.out / "fallback.tar.xz"),
                "packages": reqs,
            }
            log(f"fallback: {archives['fallback']['mib']} MiB")
        if "ray" in want:
            r = req(RAY)
            fetch([r], wheels)
            target = work / "ray"
            install([r], wheels, target)
            for rel in RAY_DROP:
                shutil.rmtree(target / rel, ignore_errors=True)
            for tests in list((target / "ray").rglob("tests")):
                if tests.is_dir():
                    shutil.rmtree(tests, ignore_errors=True)
            clean(target)
            saved = strip_elf(target)
            archives["ray"] = {
                **archive(target, "ray", args.out / "ray.tar.xz"),
                "packages": [r],
                "dropped": [*list(RAY_DROP), "*/tests"],
                "stripped_mib": round(saved / 2**20, 1),
            }
            log(f"ray: {archives['ray']['mib']} MiB (strip saved {saved / 2**20:.0f} MiB)")
        if "verl" in want:
            version = (
                versions.get("verl")
                or json.loads((ROOT / "files" / "pins.json").read_text())["verl"]["version"]
            )
            tree = patched_verl(work, version)
            archives["verl"] = {
                **archive(tree, "verl-tree", args.out / "verl.tar.xz"),
                "verl": version,
                "profile": "pascal",
            }
        if args.release and want & {f"site-{args.release}", f"verl-{args.release}"}:
            pack_release(args, work, wheels, versions, archives)
    archives.pop("engine", None)  # from an older pack: the engine travels with the tree
    (args.out / "engine.tar.xz").unlink(missing_ok=True)
    total = sum(a["bytes"] for a in archives.values())
    tree = tree_bytes()
    manifest["total_mib"] = round(total / 2**20, 2)
    manifest["tree_mib"] = round(tree / 2**20, 2)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    for _name, a in sorted(archives.items()):
        log(f"{a['file']:18} {a['mib']:7.2f} MiB  (unpacked {a['unpacked_mib']} MiB)")
    log(
        f"carry {manifest['total_mib']} MiB in {args.out}; the working tree that travels "
        f"with it {manifest['tree_mib']} MiB; together {(total + tree) / 2**20:.2f} MiB"
    )
    if total + tree > LIMIT_MIB * 2**20:
        raise SystemExit(
            f"the carry and the tree are {(total + tree) / 2**20:.1f} MiB, over {LIMIT_MIB} MiB"
        )


if __name__ == "__main__":
    main()
