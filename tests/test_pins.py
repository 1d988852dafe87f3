"""One source of pins: files/pins.json, and the locks derived from it, agree."""

import re
from pathlib import Path

import pytest

from oldgpu import pins

ROOT = Path(__file__).resolve().parents[1]
LOCKS = {v: ROOT / "files/requirements" / f"{v}.lock" for v in ("pypi", "cu118")}


def read_lock(path: Path) -> dict[str, str]:
    entries = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line.strip())
        assert m, f"{path.name}: not an exact pin: {line!r}"
        name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
        assert name not in entries, f"{path.name}: {name} twice"
        entries[name] = m.group(2)
    return entries


def is_cuda_own(name: str) -> bool:
    return bool(re.fullmatch(r"nvidia-.*-cu1[12]", name))


@pytest.mark.parametrize("variant", sorted(LOCKS))
def test_every_pin_is_in_the_lock_at_its_version(variant):
    lock = read_lock(LOCKS[variant])
    local = pins.get(f"torch.variants.{variant}.local_version")
    for name, version in pins.get("python_packages").items():
        want = version + local if name == "torch" else version
        assert lock.get(name) == want, (
            f"{variant}.lock has {name}=={lock.get(name)}, pins say {want}"
        )


def test_both_locks_agree_on_everything_that_is_not_cuda():
    pypi, cu118 = (read_lock(LOCKS[v]) for v in ("pypi", "cu118"))
    common = lambda lock: {  # noqa: E731
        n: v.split("+")[0] for n, v in lock.items() if not is_cuda_own(n)
    }
    assert common(pypi) == common(cu118)


def test_cu118_lock_carries_the_cuda11_runtime_torch_requires():
    cu118 = read_lock(LOCKS["cu118"])
    for name, version in pins.get("torch.variants.cu118.requires").items():
        assert cu118[name] == version
    assert not [n for n in cu118 if n.endswith("-cu12")]


def test_triton_is_the_one_torch_requires_and_not_the_articles():
    assert pins.get("python_packages.triton") == pins.get("torch.triton") == "3.2.0"


def test_verl_tag_matches_version_and_commit_is_full():
    assert pins.get("verl.tag") == "v" + pins.get("verl.version")
    assert re.fullmatch(r"[0-9a-f]{40}", pins.get("verl.commit"))


def test_lock_versions_satisfy_verl_requirements():
    lock = read_lock(LOCKS["pypi"])
    # verl 0.5.0's setup.py: numpy<2, tensordict>=0.8.0,<=0.9.1,!=0.9.0
    assert int(lock["numpy"].split(".")[0]) < 2
    td = tuple(int(x) for x in lock["tensordict"].split("."))
    assert (0, 8, 0) <= td <= (0, 9, 1) and td[:2] + td[2:] != (0, 9, 0)
    assert lock["transformers"].startswith("4.51.")


# -- the vllm lock (hosts whose profile's rollout is vllm) ---------------------------------

VLLM_LOCK = ROOT / "files/requirements" / "vllm.lock"


def test_vllm_lock_has_every_pin_and_vllm_at_its_version():
    lock = read_lock(VLLM_LOCK)
    # vLLM's wheels are built against the default index's torch (CUDA 12.4): no label.
    assert pins.get("vllm.torch_variant") == "pypi"
    local = pins.get("torch.variants.pypi.local_version")
    for name, version in pins.get("python_packages").items():
        want = version + local if name == "torch" else version
        assert lock.get(name) == want, f"vllm.lock has {name}=={lock.get(name)}, pins say {want}"
    assert lock["vllm"] == pins.get("vllm.version")
    # verl 0.5.0's setup.py: vllm>=0.7.3,<=0.8.5.
    v = tuple(int(x) for x in lock["vllm"].split("."))
    assert (0, 7, 3) <= v <= (0, 8, 5)
    # The XFORMERS backend the pre-Ampere profiles name, and CUDA 12's runtime wheels.
    assert "xformers" in lock
    assert [n for n in lock if n.endswith("-cu12")] and not [n for n in lock if n.endswith("-cu11")]


def test_vllm_lock_agrees_with_the_pypi_lock_on_the_stack():
    # Transitive packages may differ (vLLM pins its own, e.g. opentelemetry); the
    # stack verl runs on may not.
    pypi, vllm = read_lock(LOCKS["pypi"]), read_lock(VLLM_LOCK)
    for name in (*pins.get("python_packages"), "nvidia-cudnn-cu12", "nvidia-nccl-cu12"):
        assert vllm[name] == pypi[name], name


def test_vllm_cuda_is_the_pypi_torch_build():
    assert pins.get("vllm.cuda") == "12.4"
    assert "CUDA 12.4" in pins.get("torch.variants.pypi.description")


# -- the locks of the newer verl releases (pins.verl_releases) -----------------------------

RELEASES = sorted(pins.get("verl_releases"))


def release(version: str) -> dict:
    # (not pins.get: the version's dots are not keys)
    return pins.load()["verl_releases"][version]


def release_locks(version: str) -> dict[str, Path]:
    lock = release(version)["lock"]
    return {
        "pypi": ROOT / "files/requirements" / f"{lock}.lock",
        "cu118": ROOT / "files/requirements" / f"{lock}-cu118.lock",
    }


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("variant", ["pypi", "cu118"])
def test_every_release_pin_is_in_its_lock_at_its_version(version, variant):
    lock = read_lock(release_locks(version)[variant])
    local = release(version)["torch"]["variants"][variant]["local_version"]
    for name, version_ in release(version)["python_packages"].items():
        want = version_ + local if name == "torch" else version_
        assert lock.get(name) == want, f"{variant}: {name}=={lock.get(name)}, pins say {want}"
    assert "verl" not in lock  # installed from the patched tree


@pytest.mark.parametrize("version", RELEASES)
def test_a_releases_two_locks_agree_on_everything_that_is_not_cuda(version):
    pypi, cu118 = (read_lock(p) for p in release_locks(version).values())
    common = lambda lock: {  # noqa: E731
        n: v.split("+")[0] for n, v in lock.items() if not is_cuda_own(n)
    }
    assert common(pypi) == common(cu118)
    for name, version_ in release(version)["torch"]["variants"]["cu118"]["requires"].items():
        assert cu118[name] == version_
    assert not [n for n in cu118 if n.endswith("-cu12")]
    assert [n for n in pypi if n.endswith("-cu12")] and not [n for n in pypi if n.endswith("-cu11")]


@pytest.mark.parametrize("version", RELEASES)
def test_a_release_and_its_triton_are_the_ones_torch_requires(version):
    torch, packages = release(version)["torch"], release(version)["python_packages"]
    assert packages["torch"] == torch["version"] and packages["triton"] == torch["triton"]


@pytest.mark.parametrize("version", RELEASES)
def test_a_release_runs_the_same_ray_as_the_default(version):
    # One Ray cluster runs one Ray version; a host's releases share its ray-head/worker units.
    assert read_lock(release_locks(version)["pypi"])["ray"] == pins.get("python_packages.ray")


def test_the_0_9_0_lock_satisfies_verl_0_9_0_and_its_rollout_path():
    lock = read_lock(release_locks("0.9.0")["pypi"])
    # verl 0.9.0's setup.py: numpy>=2, tensordict>=0.8.0,<=0.10.0,!=0.9.0,
    # transformers>=5.5.3,!=5.6.0,<5.11, pyarrow>=19, ray[default]>=2.41.
    assert int(lock["numpy"].split(".")[0]) >= 2
    td = tuple(int(x) for x in lock["tensordict"].split("."))
    assert (0, 8, 0) <= td <= (0, 10, 0) and td[:2] != (0, 9)
    tf = tuple(int(x) for x in lock["transformers"].split("."))
    assert (5, 5, 3) <= tf < (5, 11) and tf[:2] != (5, 6)
    assert int(lock["pyarrow"].split(".")[0]) >= 19
    # transformers 5 needs torch.float8_e8m0fnu (torch 2.7+); P40s need a build with sm_60
    # (2.7's cu118 build is the newest with CUDA 11).
    assert tuple(int(x) for x in lock["torch"].split(".")[:2]) == (2, 7)
    # Imported on the rollout path, not declared by verl; no vLLM, no flash-attn.
    for name in ("fastapi", "uvicorn", "cachetools"):
        assert name in lock, name
    for name in ("vllm", "flash-attn", "transferqueue"):
        assert name not in lock, name
