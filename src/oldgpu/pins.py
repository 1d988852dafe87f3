"""The project's one source of pinned versions (files/pins.json).

Ansible reads the same file with ``from_json``, Nix with ``builtins.fromJSON``;
this module is the engine's only way in, so nothing here re-types a version.
"""

from __future__ import annotations

import json
import os
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

ENV_VAR = "OLDGPU_PINS"


class PinsError(RuntimeError):
    """The pins file is missing or malformed."""


def pins_path() -> Path:
    """Where the pins come from: $OLDGPU_PINS, else the copy shipped in the package."""
    override = os.environ.get(ENV_VAR)
    if override:
        return Path(override)
    # In a source checkout this is a symlink to files/pins.json; in a wheel, a copy.
    return Path(str(resources.files("oldgpu") / "data" / "pins.json"))


@cache
def _load(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise PinsError(f"pins file not found: {path} (set {ENV_VAR})") from exc
    except json.JSONDecodeError as exc:
        raise PinsError(f"pins file {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("schema") != 1:
        raise PinsError(f"pins file {path}: expected an object with schema 1")
    return data


def load() -> dict[str, Any]:
    """The parsed pins (cached per path)."""
    return _load(str(pins_path()))


def get(dotted: str) -> Any:
    """One pin by dotted key, e.g. ``get("torch.version")``."""
    node: Any = load()
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise PinsError(f"pin {dotted!r} is not in {pins_path()}")
        node = node[part]
    return node
