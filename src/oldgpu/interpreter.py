"""Where the training venv's interpreter comes from, per Debian release (``oldgpu distro``).

The locks are made for one Python (files/pins.json python.version, 3.11). They cannot
be made for Debian 13's 3.13: verl 0.5.0 requires numpy < 2 and numpy 1.26.4 has no
3.13 build (every other pin has a 3.13 wheel or is pure Python). So, in this order:

1. the release's own python3, when it is the locks' (Debian 12);
2. an interpreter the operator names (python_env_python);
3. the Debian release that packages it, from the host's own mirror (Debian 13 takes
   Debian 12's python3.11): Debian's build, with Debian 12's security updates, and
   nothing else from that release: apt is pinned so that only the interpreter's four
   packages come from it (every other package of it at priority -1). They install
   beside trixie's libraries (its t64 libraries provide the old names on 64-bit
   architectures). Debian 12's python3.11-venv does not (it needs python3-distutils,
   which trixie's python3 conflicts with), so the venv gets its pip from trixie's
   python3-pip-whl, the wheel trixie's own ensurepip installs (``oldgpu venv``);
4. otherwise ``python-interpreter-unavailable``, before anything changes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from oldgpu import pins

APT_DIR = Path("/etc/apt")
SOURCES_FILE = "/etc/apt/sources.list.d/oldgpu-python.sources"
PREFERENCES_FILE = "/etc/apt/preferences.d/oldgpu-python.pref"
# Debian's wheel of pip (the one its ensurepip installs): the venv's pip where the
# interpreter has no ensurepip of its own.
PIP_WHEEL_PACKAGE = "python3-pip-whl"
_ONE_LINE = re.compile(r"^\s*deb\s+(?:\[(?P<opts>[^\]]*)\]\s+)?(?P<uri>\S+)\s+(?P<suite>\S+)")


def packages(version: str) -> list[str]:
    """Debian's packages of CPython ``version`` that a venv needs (no -venv, no -dev)."""
    v = version
    return [f"python{v}", f"python{v}-minimal", f"libpython{v}-minimal", f"libpython{v}-stdlib"]


def _deb822(text: str) -> Iterable[dict[str, str]]:
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for line in stanza.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line[0].isspace() and key:  # a continuation line
                fields[key] += " " + line.strip()
                continue
            key, _, value = line.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
        if (
            fields.get("enabled", "yes").lower() != "no"
            and "deb" in fields.get("types", "").split()
        ):
            yield fields


def host_entries(apt_dir: Path | None = None) -> list[dict[str, Any]]:
    """The host's apt entries of binary packages (default: APT_DIR's): uris, suites, signed_by."""
    apt_dir = apt_dir or APT_DIR
    out: list[dict[str, Any]] = []
    files = [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*"))]
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if path.name.endswith(".sources"):
            for f in _deb822(text):
                out.append(
                    {
                        "uris": f.get("uris", "").split(),
                        "suites": f.get("suites", "").split(),
                        "signed_by": f.get("signed-by", ""),
                    }
                )
        elif path.name == "sources.list" or path.name.endswith(".list"):
            for line in text.splitlines():
                m = _ONE_LINE.match(line)
                if m:
                    opts = dict(o.split("=", 1) for o in (m["opts"] or "").split() if "=" in o)
                    out.append(
                        {
                            "uris": [m["uri"]],
                            "suites": [m["suite"]],
                            "signed_by": opts.get("signed-by", ""),
                        }
                    )
    return out


def host_mirrors(codename: str, entries: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The mirrors the host's own release comes from: its archive's and its security's."""
    found: dict[str, Any] = {"archive": None, "security": None, "signed_by": ""}
    for e in entries:
        for suite in e["suites"]:
            kind = {
                codename: "archive",
                f"{codename}-updates": "archive",
                f"{codename}-security": "security",
            }.get(suite)
            if kind and e["uris"] and found[kind] is None:
                found[kind] = e["uris"][0].rstrip("/")
                found["signed_by"] = found["signed_by"] or e["signed_by"]
    return found


def _stanza(uri: str, suite: str, signed_by: str) -> str:
    lines = ["Types: deb", f"URIs: {uri}", f"Suites: {suite}", "Components: main"]
    return "\n".join(lines + ([f"Signed-By: {signed_by}"] if signed_by else [])) + "\n"


def apt_files(
    donor: Any, version: str, mirror: str, security: str | None, signed_by: str
) -> dict[str, str]:
    """The deb822 source and the pin that take only ``version``'s packages from ``donor``."""
    suites = [(mirror, donor.codename)] + (
        [(security, f"{donor.codename}-security")] if security else []
    )
    head = (
        f"# oldgpu (python_env): {donor.name}'s python{version} for the training venv;\n"
        f"# only its packages are taken from here ({PREFERENCES_FILE}).\n"
    )
    source = head + "\n".join(_stanza(u, s, signed_by) for u, s in suites)
    names = " ".join(packages(version))
    pref = [f"# oldgpu (python_env): nothing but python{version} from {donor.name}.\n"]
    for _, suite in suites:
        pref.append(f"Package: *\nPin: release n={suite}\nPin-Priority: -1\n")
        pref.append(f"Package: {names}\nPin: release n={suite}\nPin-Priority: 500\n")
    return {"sources": source, "preferences": "\n".join(pref)}


def _unavailable(release: Any, want: str, why: str, fix: str = "") -> dict[str, Any]:
    return {
        "version": want,
        "source": "missing",
        "path": None,
        "interpreter": None,
        "install": [],
        "apt": None,
        "error": "python-interpreter-unavailable",
        "message": (
            f"{release.name}'s python3 is {release.system_python} and the locks are made for "
            f"{want} (verl 0.5.0 needs numpy < 2, and numpy 1.26.4 has no "
            f"{release.system_python} build); {why}: set {fix}python_env_python to an installed "
            f"CPython {want} (a relocatable build unpacked from your mirror, pyenv's, Nix's)"
        ),
    }


def choose(
    release: Any,
    releases: Mapping[str, Any],
    given: str | None = None,
    *,
    apt: bool = True,
    mirror: str | None = None,
    security_mirror: str | None = None,
    entries: Iterable[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The interpreter the venv is built with, and what the roles install for it."""
    want = str(pins.get("python.version"))
    command = f"python{want}"  # the venv key's interpreter: the same on both releases
    if release.system_python == want:
        return {
            "version": want,
            "source": "system",
            "path": f"/usr/bin/{command}",
            "interpreter": command,
            "install": [command, f"{command}-venv"],
            "apt": None,
        }
    if given:
        return {
            "version": want,
            "source": "given",
            "path": given,
            "interpreter": given,
            "install": [],
            "apt": None,
        }
    donor = next((r for r in releases.values() if r.system_python == want), None)
    if donor is None:
        return _unavailable(release, want, f"no supported Debian release packages python{want}")
    if not apt:
        why = f"python_env_python_apt is off (it would take {donor.name}'s python{want})"
        return _unavailable(release, want, why, "python_env_python_apt: true, or ")
    host = host_mirrors(release.codename, host_entries() if entries is None else entries)
    archive = (mirror or "").rstrip("/") or host["archive"]
    if not archive:
        why = f"the host's apt sources name no {release.codename} mirror to take {donor.name}'s"
        fix = "python_env_python_mirror to a Debian mirror, or "
        return _unavailable(release, want, f"{why} python{want} from", fix)
    security = (security_mirror or "").rstrip("/") or host["security"]
    return {
        "version": want,
        "source": donor.key,
        "path": f"/usr/bin/{command}",
        "interpreter": command,
        "install": [command, PIP_WHEEL_PACKAGE],
        "apt": {
            "release": donor.key,
            "codename": donor.codename,
            "packages": packages(want),
            "mirror": archive,
            "security_mirror": security,
            "sources_file": SOURCES_FILE,
            "preferences_file": PREFERENCES_FILE,
            **apt_files(donor, want, archive, security, host["signed_by"]),
        },
    }
