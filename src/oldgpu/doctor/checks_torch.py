"""The checks of the venv's packages: the torch build's kernels, triton, flash-attn."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from oldgpu import detect, pins, profile, verl_release
from oldgpu.doctor.common import Check, ccs_of, gpus_of, probe_of
from oldgpu.output import EngineError
from oldgpu.versions import compare_versions, version_tuple


def satisfies(version: str, specifier: str) -> bool:
    """``version`` against a PEP 440-ish specifier (``==3.2.0``, ``>=3.1,<3.3``, ``==3.*``)."""
    public = str(version).split("+", 1)[0]
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        match = re.fullmatch(r"(===|==|!=|~=|>=|<=|>|<)\s*(\S+)", clause)
        if not match:
            return False
        op, want = match.groups()
        if op in ("==", "!=") and want.endswith(".*"):
            prefix = version_tuple(want[:-2])
            same = version_tuple(public)[: len(prefix)] == prefix
            if same != (op == "=="):
                return False
            continue
        if op == "===":
            if str(version) != want:
                return False
            continue
        c = compare_versions(public, want.split("+", 1)[0])
        ok = {
            "==": c == 0 and ("+" not in want or str(version) == want),
            "!=": c != 0,
            ">=": c >= 0,
            "<=": c <= 0,
            ">": c > 0,
            "<": c < 0,
            "~=": c >= 0
            and version_tuple(public)[: len(version_tuple(want)) - 1] == version_tuple(want)[:-1],
        }[op]
        if not ok:
            return False
    return True


def parse_requirement(text: str) -> dict[str, str]:
    """``triton (==3.2.0) ; platform_system == "Linux"`` -> name, specifier, marker."""
    req, _, marker = text.partition(";")
    match = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[[^\]]*\])?\s*\(?\s*([^)]*?)\s*\)?\s*$", req)
    name, spec = (match.group(1), match.group(2)) if match else (req.strip(), "")
    return {"name": name.lower().replace("_", "-"), "specifier": spec, "marker": marker.strip()}


def _marker_applies(marker: str, probe: Mapping[str, Any]) -> bool:
    """The ``platform_system``/``platform_machine`` terms of an ``and``-only marker."""
    if not marker or " or " in marker:
        return True
    seen = {"platform_system": probe.get("system"), "platform_machine": probe.get("machine")}
    for key, want in re.findall(
        r"(platform_system|platform_machine)\s*==\s*['\"]([^'\"]+)", marker
    ):
        if seen.get(key) and seen[key] != want:
            return False
    return True


def arch_entries(arch_list: Sequence[str]) -> tuple[list[str], list[tuple[int, int]]]:
    """torch's ``sm_61``/``compute_90`` entries as SASS ``"6.1"`` strings and PTX tuples."""
    sass: list[str] = []
    ptx: list[tuple[int, int]] = []
    for entry in arch_list:
        match = re.fullmatch(r"(sm|compute)_(\d+)([a-z]?)", entry.strip())
        if not match:
            continue
        kind, digits, suffix = match.groups()
        major, minor = int(digits[:-1] or 0), int(digits[-1])
        if kind == "sm":
            sass.append(f"{major}.{minor}")
        elif not suffix:  # compute_90a PTX is not forward compatible
            ptx.append((major, minor))
    return sass, ptx


def kernel_coverage(cc: str, arch_list: Sequence[str]) -> dict[str, Any] | None:
    """What code of a torch build runs on ``cc``: SASS (profile.torch_kernels), else PTX."""
    sass, ptx = arch_entries(arch_list)
    sm = profile.torch_kernels(cc, sass)
    if sm:
        return {"kind": "sass", "code": sm}
    want = detect.cc_tuple(cc)
    usable = [p for p in ptx if p <= want]
    if usable:
        best = max(usable)
        return {"kind": "ptx", "code": f"compute_{best[0]}{best[1]}"}
    return None


def pinned_torch(facts: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The torch the venv should hold: the pins of the verl release its tree is (the
    manifest's verl_version: a host carries several, oldgpu.verl_release), else the
    default release's."""
    manifest = ((facts or {}).get("verl") or {}).get("manifest") or {}
    version = manifest.get("verl_version")
    if version and version != verl_release.default():
        try:
            torch = verl_release.release(str(version)).get("torch")
        except EngineError:
            torch = None
        if torch:
            return {"version": torch["version"], "triton": torch["triton"], "release": version}
    return {
        "version": pins.get("torch.version"),
        "triton": pins.get("torch.triton"),
        "release": verl_release.default(),
    }


def _torch_fix(facts: Mapping[str, Any] | None = None) -> str:
    want = pinned_torch(facts)
    build = f"torch=={want['version']}+{pins.get('torch.variant')}"
    if want["release"] != verl_release.default():
        build += f" (verl {want['release']}'s lock)"
    return (
        f"install the project's lock into the venv (python_env role): {build} from "
        f"PyTorch's {pins.get('torch.variant')} wheel index, set as python_env_torch_index_url "
        "(kernels for "
        f"sm_{pins.get('torch.cuda_arch_list')[0].replace('.', '')} and up)"
    )


def check_torch_build(facts: Mapping[str, Any], prof: Mapping[str, Any] | None) -> dict[str, Any]:
    c = Check("torch-build")
    probe = probe_of(facts)
    if "error" in probe:
        return c.add(
            "fail",
            f"cannot probe the venv: {probe['error']}",
            "pass --python the venv's interpreter (VENV/bin/python)",
        ).result()
    t = probe.get("torch") or {}
    if not t.get("importable"):
        seen = f"{probe.get('python')} cannot import torch: {t.get('error')}"
        return c.add("fail", seen, _torch_fix(facts)).result()
    version, cuda = t.get("version"), t.get("cuda")
    arch_list = list(t.get("arch_list") or [])
    c.details = {
        "version": version,
        "cuda": cuda,
        "cuda_available": t.get("cuda_available"),
        "device_count": t.get("device_count"),
        "arch_list": arch_list,
        "kernels": {},
    }
    build = f"torch {version} (CUDA {cuda or 'none'})"
    want = pinned_torch(facts)
    pinned_version, variant = want["version"], pins.get("torch.variant")
    if str(version).split("+", 1)[0] != pinned_version:
        of = "" if want["release"] == verl_release.default() else f" of verl {want['release']}"
        cuda_job = prof and prof["device"] == "cuda"
        c.add(
            "warn",
            f"{build} is not the pinned torch {pinned_version}{of}",
            _torch_fix(facts) if cuda_job else "install the project's lock",
        )
    if prof is None or prof["device"] == "cpu":
        return c.add("ok", f"{build}: the cpu profile needs no CUDA kernels").result()
    if not cuda:
        return c.add("fail", f"{build} is a CPU-only build", _torch_fix(facts)).result()
    if version_tuple(cuda)[:2] != version_tuple(pins.get("cuda.version"))[:2]:
        c.add(
            "warn",
            f"{build}: not the pinned +{variant} build (CUDA {pins.get('cuda.version')})",
            _torch_fix(facts),
        )
    ccs = list(dict.fromkeys(ccs_of(gpus_of(facts)) or [prof["compute_capability"]]))
    drv = facts.get("driver") or {}
    if not arch_list:
        c.add("warn", f"{build}: cannot read its kernel arch list", "")
    for cc in ccs:
        if not arch_list:
            break
        cover = kernel_coverage(cc, arch_list)
        c.details["kernels"][cc] = cover
        listed = " ".join(arch_list)
        if cover is None:
            c.add(
                "fail",
                f"{build} has no kernels for CC {cc} (built for {listed}): 'no kernel image is "
                "available for execution on the device'",
                _torch_fix(facts) + "; cu128 and newer builds dropped Pascal",
            )
        elif cover["kind"] == "ptx":
            full = pins.get("cuda.min_driver")
            old = drv.get("version") and compare_versions(drv["version"], full) < 0
            c.add(
                "fail" if old else "warn",
                f"CC {cc} runs {build} only through {cover['code']} PTX (JIT-compiled at "
                "start-up" + (f"; driver {drv['version']} cannot JIT it" if old else "") + ")",
                _torch_fix(facts),
            )
        else:
            c.add("ok", f"CC {cc} runs the {cover['code']} code of {build}")
    if not t.get("cuda_available"):
        why = (
            t.get("cuda_error")
            or "; ".join(t.get("warnings") or [])
            or "torch found no usable CUDA device"
        )
        c.add(
            "fail",
            f"torch.cuda.is_available() is False ({why[:300]})",
            "load the driver (see the driver check) and check CUDA_VISIBLE_DEVICES",
        )
    for d in t.get("devices") or []:
        if d.get("kernel_ok") is False:
            c.add(
                "fail",
                f"a test kernel on cuda:{d.get('index')} failed: {d.get('kernel_error')}",
                _torch_fix(facts),
            )
    driven = [g for g in gpus_of(facts) if g.get("index") is not None]
    count = t.get("device_count") or 0
    visible = (facts.get("env") or {}).get("CUDA_VISIBLE_DEVICES")
    if t.get("cuda_available") and count != len(driven) and visible is None:
        c.add(
            "warn",
            f"torch sees {count} device(s), detect {len(driven)}",
            "check that every GPU is driven by the loaded driver",
        )
    return c.result()


def check_triton(facts: Mapping[str, Any], prof: Mapping[str, Any] | None) -> dict[str, Any]:
    c = Check("triton")
    probe = probe_of(facts)
    t = probe.get("torch") or {}
    if "error" in probe or not t.get("importable"):
        return c.add("skip", "no torch in the venv (see torch-build)").result()
    dists = probe.get("distributions") or {}
    torch_version = t.get("version")
    reqs = [parse_requirement(r) for r in probe.get("torch_requires_triton") or []]
    reqs = [r for r in reqs if _marker_applies(r["marker"], probe)]
    c.details = {"installed": dists.get("triton"), "requires": reqs}
    if not reqs:
        want = pinned_torch(facts)
        pinned = want["triton"]
        if str(torch_version).split("+", 1)[0] == want["version"] and t.get("cuda"):
            reqs = [{"name": "triton", "specifier": f"=={pinned}", "marker": ""}]
        else:
            have = dists.get("triton")
            return c.add(
                "ok",
                f"torch {torch_version} requires no triton"
                + (f" (triton {have} installed)" if have else ""),
            ).result()
    for req in reqs:
        name, spec = req["name"], req["specifier"]
        have = dists.get(name)
        want = f"{name}{spec}"
        if have is None:
            c.add(
                "fail",
                f"torch {torch_version} requires {want}; it is not installed",
                f"pip install '{want}' (the project's lock has it)",
            )
        elif spec and not satisfies(have, spec):
            seen = f"{name} {have} installed; torch {torch_version} requires {want}"
            if have == "2.3.1":
                seen += " (2.3.1 is the seed article's pick: it goes with torch 2.3, not 2.6)"
            c.add("fail", seen, f"pip install '{want}' (the project's lock has it)")
        else:
            c.add("ok", f"{name} {have}, as torch {torch_version} requires ({want})")
    if prof and prof["device"] == "cuda" and not prof["torch_compile"]:
        c.add(
            "ok",
            "Triton refuses CC < 7.0: the profile keeps torch.compile, liger and fused kernels off",
        )
    if dists.get("triton-pascal"):
        c.add(
            "warn",
            f"triton-pascal {dists['triton-pascal']} is installed too: it ships the same "
            "`triton` module",
            "pip uninstall triton-pascal (the project runs no Triton kernels on Pascal)",
        )
    return c.result()


def check_flash_attn(facts: Mapping[str, Any], prof: Mapping[str, Any] | None) -> dict[str, Any]:
    c = Check("flash-attn")
    probe = probe_of(facts)
    if "error" in probe:
        return c.add("skip", "cannot probe the venv (see torch-build)").result()
    if prof is None:
        return c.add("skip", "no profile (see gpu-capability)").result()
    where = (probe.get("modules") or {}).get("flash_attn")
    version = (probe.get("distributions") or {}).get("flash-attn")
    present = where is not None
    c.details = {"importable": present, "origin": where, "version": version}
    label = f"flash-attn {version or '(version unknown)'} at {where}" if present else ""
    attn_env = (facts.get("env") or {}).get("OLDGPU_ATTN_IMPLEMENTATION")
    if present and not prof["flash_attn_allowed"]:
        c.add(
            "fail",
            f"{label} is importable on profile {prof['name']} (FlashAttention-2 needs CC >= 8.0)",
            "verl's log-prob path would use its Triton cross-entropy kernel; "
            "pip uninstall flash-attn",
        )
    elif present:
        c.add("ok", f"{label}; profile {prof['name']} may use it")
    elif prof["flash_attn_allowed"] and prof["attn_implementation"] == "flash_attention_2":
        c.add(
            "warn",
            f"flash-attn is not installed; profile {prof['name']} uses flash_attention_2",
            "pip install flash-attn, or patch verl with --attn-implementation sdpa",
        )
    else:
        c.add("ok", f"flash-attn not installed ({prof['attn_implementation']} attention)")
    if attn_env == "flash_attention_2" and not prof["flash_attn_allowed"]:
        c.add(
            "fail",
            "OLDGPU_ATTN_IMPLEMENTATION=flash_attention_2 is set on a GPU without FlashAttention-2",
            f"unset OLDGPU_ATTN_IMPLEMENTATION (or set it to {prof['attn_implementation']})",
        )
    return c.result()


def check_vllm(facts: Mapping[str, Any], prof: Mapping[str, Any] | None) -> dict[str, Any]:
    """vLLM where the profile's rollout is vllm (the pinned version verl 0.5.0 accepts),
    and why there is none on a card below compute capability 7.0."""
    c = Check("vllm")
    probe = probe_of(facts)
    if "error" in probe:
        return c.add("skip", "cannot probe the venv (see torch-build)").result()
    if prof is None:
        return c.add("skip", "no profile (see gpu-capability)").result()
    version = (probe.get("distributions") or {}).get("vllm")
    want = str(pins.get("vllm.version"))
    c.details = {"version": version, "pinned": want, "rollout": prof["rollout"]}
    cc = prof.get("compute_capability") or "no GPU"
    if not prof["vllm_allowed"]:
        why = (
            f"vLLM needs compute capability {pins.get('vllm.min_compute_capability')} "
            f"and this is {cc} (profile {prof['name']}): verl 0.5.0's HF rollout"
        )
        if version:
            c.add("warn", f"vLLM {version} is installed but cannot run here; {why}",
                  "pip uninstall vllm (nothing here uses it)")  # fmt: skip
        else:
            c.add("ok", f"no vLLM: {why}")
    elif version and version != want:
        c.add(
            "fail",
            f"vLLM {version} is installed; verl 0.5.0 takes {want} (>=0.7.3,<=0.8.5)",
            "converge python_env (its vllm lock)",
        )
    elif version:
        c.add("ok", f"vLLM {version} ({prof['rollout']} rollout on profile {prof['name']})")
    elif prof["rollout"] == "vllm":
        c.add(
            "warn",
            f"vLLM is not installed; profile {prof['name']}'s rollout is vllm",
            "converge python_env (it installs the vllm lock on this profile), or set the "
            "job's rollout: hf",
        )
    else:
        c.add("ok", f"no vLLM ({prof['rollout']} rollout)")
    return c.result()
