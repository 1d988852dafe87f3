"""What the job's unit hides from the job: paths its model and data cannot be under.

``verl-train@.service`` (files/systemd; the package carries it as data/, a link in a
checkout) sandboxes the job. Its settings are read from the unit file itself, so a change
there changes what ``oldgpu job env`` refuses (``job-path-protected``, exit 4) with no
second list to keep in step. What each setting hides is systemd's (systemd.exec(5)):

* ``ProtectHome=yes`` or ``tmpfs``: /home, /root and /run/user are empty (``read-only``
  leaves them readable, which is all a job needs);
* ``PrivateTmp=yes``: /tmp and /var/tmp are the unit's own, empty when it starts;
* ``InaccessiblePaths=`` and ``TemporaryFileSystem=``: the paths they name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import resources

from oldgpu.output import EngineError

CONFIG_INVALID = 4  # settings.CONFIG_INVALID (settings imports this module)
UNIT_NAME = "verl-train@.service"
HOME_DIRS = ("/home", "/root", "/run/user")
TMP_DIRS = ("/tmp", "/var/tmp")
# A prefix systemd allows before a path: "-" (ignore if missing), "+" (relative to root).
PATH_PREFIXES = "-+"


def unit_text() -> str:
    try:
        return (resources.files("oldgpu") / "data" / UNIT_NAME).read_text(encoding="utf-8")
    except OSError as exc:  # a package built without it: the check cannot be made
        raise EngineError(
            "job-unit-file-missing",
            f"the engine's copy of {UNIT_NAME} (oldgpu/data/) cannot be read: {exc.strerror}; "
            "reinstall the engine",
            code=CONFIG_INVALID,
        ) from None


def settings(text: str) -> list[tuple[str, str]]:
    """The unit's ``Key=value`` lines (every occurrence, in order)."""
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")) or "=" not in line:
            continue
        key, _, value = line.partition("=")
        out.append((key.strip(), value.strip()))
    return out


def hidden(text: str | None = None) -> dict[str, str]:
    """Each directory the unit hides -> the setting that hides it (``PrivateTmp=yes``)."""
    out: dict[str, str] = {}
    for key, value in settings(unit_text() if text is None else text):
        if key == "ProtectHome" and value in ("yes", "true", "tmpfs"):
            out.update(dict.fromkeys(HOME_DIRS, f"{key}={value}"))
        elif key == "PrivateTmp" and value in ("yes", "true"):
            out.update(dict.fromkeys(TMP_DIRS, f"{key}={value}"))
        elif key in ("InaccessiblePaths", "TemporaryFileSystem"):
            for item in value.split():
                path = item.lstrip(PATH_PREFIXES).split(":", 1)[0]
                if path.startswith("/"):
                    out[os.path.normpath(path)] = f"{key}={path}"
    return out


def hidden_by(path: str, dirs: Mapping[str, str]) -> tuple[str, str] | None:
    """(the hidden directory, the setting) that ``path`` is under, or None."""
    normal = os.path.normpath(path)
    for root, setting in dirs.items():
        if normal == root or normal.startswith(root.rstrip("/") + "/"):
            return root, setting
    return None


def unit_path_problems(values: Mapping[str, str], text: str | None = None) -> list[str]:
    """A message per path setting (name -> absolute path) the unit would not see."""
    dirs = hidden(text)
    out = []
    for name, value in values.items():
        found = hidden_by(value, dirs) if value else None
        if found:
            root, setting = found
            out.append(
                f"{name}: {value!r} is under {root}, which the job's unit does not see "
                f"({setting} in {UNIT_NAME}); move it, e.g. under /var/lib/verl or /srv"
            )
    return out
