"""What the checks share: a check's findings, the profile judged against, the facts' parts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from oldgpu import detect, profile
from oldgpu.output import EngineError

STATUSES = ("skip", "ok", "warn", "fail")  # in rising severity


class Check:
    """Findings of one check: the worst status wins; fixes of warn/fail findings kept."""

    def __init__(self, check_id: str) -> None:
        self.id = check_id
        self.items: list[tuple[str, str, str]] = []
        self.details: dict[str, Any] = {}

    def add(self, status: str, seen: str, fix: str = "") -> Check:
        self.items.append((status, seen, fix))
        return self

    def result(self) -> dict[str, Any]:
        items = self.items or [("skip", "nothing to check", "")]
        status = max((s for s, _, _ in items), key=STATUSES.index)
        fixes = dict.fromkeys(f for s, _, f in items if f and s in ("warn", "fail"))
        return {
            "id": self.id,
            "status": status,
            "seen": "; ".join(seen for _, seen, _ in items),
            "fix": "; ".join(fixes),
            "details": self.details,
        }


def resolve_profile(facts: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The profile the checks judge against, or None and why not."""
    request = facts.get("request") or {}
    try:
        if request.get("arch"):
            return profile.profile_for_arch(request["arch"]), None
        if request.get("cc"):
            return profile.profile_for_cc(request["cc"]), None
        return profile.profile_for_gpus((facts.get("detect") or {}).get("gpus", [])), None
    except EngineError as exc:
        return None, str(exc)


def gpus_of(facts: Mapping[str, Any]) -> list[dict[str, Any]]:
    """detect's GPUs; torch's devices when detect found none."""
    found = list((facts.get("detect") or {}).get("gpus", []))
    if found:
        return found
    out = []
    for d in torch_of(facts).get("devices") or []:
        cc = d.get("capability")
        out.append(
            {
                "index": d.get("index"),
                "name": d.get("name"),
                "compute_capability": cc,
                "architecture": detect.arch_for_cc(cc) if cc else None,
                "source": "torch",
            }
        )
    return out


def probe_of(facts: Mapping[str, Any]) -> dict[str, Any]:
    return facts.get("probe") or {"error": "no probe facts"}


def torch_of(facts: Mapping[str, Any]) -> dict[str, Any]:
    return probe_of(facts).get("torch") or {}


def gpu_label(g: Mapping[str, Any]) -> str:
    index = "-" if g.get("index") is None else g["index"]
    return f"GPU {index} {g.get('name') or '?'}"


def min_cc(ccs: Sequence[str]) -> str | None:
    return min(ccs, key=detect.cc_tuple) if ccs else None


def ccs_of(gpus: Sequence[Mapping[str, Any]]) -> list[str]:
    return [g["compute_capability"] for g in gpus if g.get("compute_capability")]


def expects_gpu(prof: Mapping[str, Any] | None, gpus: Sequence[Any]) -> bool:
    return prof["device"] == "cuda" if prof else bool(gpus)


def patch_cmd(v: Mapping[str, Any], prof: Mapping[str, Any] | None) -> str:
    return f"oldgpu patch {v.get('dir')}" + (f" --profile {prof['name']}" if prof else "")
