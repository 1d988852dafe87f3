"""The check of the verl tree: patched as its manifest says, and the one the venv imports."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from oldgpu.doctor.common import Check, patch_cmd, probe_of


def check_verl_patch(facts: Mapping[str, Any], prof: Mapping[str, Any] | None) -> dict[str, Any]:
    c = Check("verl-patch")
    v = facts.get("verl")
    origin = (probe_of(facts).get("modules") or {}).get("verl")
    if not v:
        where = f"; the venv imports verl from {origin}" if origin else ""
        return c.add("skip", f"no --verl-dir given{where}").result()
    root = v.get("dir")
    c.details = {
        "dir": root,
        "manifest": v.get("manifest"),
        "modified": v.get("modified"),
        "check": v.get("check"),
        "error": v.get("error"),
        "imported_from": origin,
    }
    manifest = v.get("manifest")
    error = v.get("error")
    if error:
        name, message = error.get("error"), error.get("message", "")
        if name == "tree-modified":
            files = v.get("modified") or []
            what = ", ".join(files) if files else "a patched file"
            c.add(
                "fail",
                f"{root}: hand-modified since oldgpu patched it: {what}",
                f"undo the edit to {what} or start from a fresh verl copy, then run "
                + patch_cmd(v, prof),
            )
        elif name in ("verl-dir-missing", "not-a-verl-tree"):
            c.add(
                "fail",
                f"{name}: {message}",
                "give --verl-dir the verl checkout or sdist root (the directory holding verl/)",
            )
        else:
            c.add("fail", f"{root}: {name}: {message}", f"see the message; {patch_cmd(v, prof)}")
    elif v.get("check_rc") == 0:
        opts = (manifest or {}).get("options") or {}
        # Which release and which patch set: a host may carry several (oldgpu.verl_release).
        names = [p.get("name", "?") for p in (manifest or {}).get("patches") or []]
        c.details["verl_version"] = (manifest or {}).get("verl_version")
        c.details["patch_set"] = names
        c.add(
            "ok",
            f"{root}: verl {(manifest or {}).get('verl_version')} patched as its manifest says "
            f"({opts.get('compute_dtype')}, {opts.get('attn_implementation')}, "
            f"profile {opts.get('profile')}; {len(names)} patches: {', '.join(names)})",
        )
        if prof:
            want = prof["patch_options"]
            differ = {
                k: (opts.get(k), want[k])
                for k in ("compute_dtype", "attn_implementation", "device")
                if opts.get(k, "cuda" if k == "device" else None) != want[k]
            }
            if differ:
                what = ", ".join(f"{k} {a} (profile wants {b})" for k, (a, b) in differ.items())
                c.add(
                    "warn",
                    f"patched with other options than profile {prof['name']}: {what}",
                    f"run {patch_cmd(v, prof)}",
                )
    else:
        files = ", ".join(f["path"] for f in (v.get("check") or {}).get("files", [])[:5])
        if manifest is None:
            c.add(
                "fail",
                f"{root}: verl {(v.get('check') or {}).get('verl_version')} is not patched",
                f"run {patch_cmd(v, prof)}",
            )
        else:
            c.add(
                "fail",
                f"{root}: patched, but not as this engine would patch it now"
                + (f" ({files} would change)" if files else ""),
                f"run {patch_cmd(v, prof)}",
            )
    if origin is not None and root:
        tree = os.path.dirname(os.path.dirname(origin)) if origin else ""
        if os.path.realpath(tree) != os.path.realpath(root):
            c.add(
                "warn",
                f"the venv imports verl from {origin}, not from {root}",
                f"pip install --no-deps -e {root} into the venv",
            )
    elif "error" not in probe_of(facts) and root and not error:
        c.add(
            "warn", "the venv cannot import verl", f"pip install --no-deps -e {root} into the venv"
        )
    return c.result()
