"""Which patches a verl version gets, found without a hand-kept list.

Each verl release has a package of its own here, ``verl_<x>_<y>_<z>/``: its module
``base`` holds the set every profile gets, and each other module a set that joins only
for some options (``cpu``, ``fp16``, ``logits``). Every module exports ``PATCHES``, a
tuple of ``Patch``, and each patch's ``versions`` says which verl versions it is for (so
one module may serve several). Adding a file is all it takes: a package's ``base`` is
read first, then its other modules in name order, packages in version order. The
runtime modules the patches drop into verl's tree live apart, in ``runtime/``.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re

from oldgpu.output import EngineError
from oldgpu.patch.options import Options
from oldgpu.patch.sitepatch import Patch

RELEASE_PACKAGE = re.compile(r"verl_(\d+)_(\d+)_(\d+)")
BASE_SET = "base"


def patch_set_modules() -> list[str]:
    """The patch set modules of every release package, each package's base first."""
    package = importlib.import_module(__package__)
    releases = sorted(
        (tuple(int(n) for n in match.groups()), info.name)
        for info in pkgutil.iter_modules(package.__path__)
        if info.ispkg and (match := RELEASE_PACKAGE.fullmatch(info.name))
    )
    found: list[str] = []
    for _, name in releases:
        release = importlib.import_module(f"{__package__}.{name}")
        sets = sorted(
            (info.name != BASE_SET, info.name)
            for info in pkgutil.iter_modules(release.__path__)
            if not info.ispkg and not info.name.startswith("_")
        )
        found.extend(f"{__package__}.{name}.{module}" for _, module in sets)
    return found


@functools.cache
def registry() -> tuple[Patch, ...]:
    found: list[Patch] = []
    for name in patch_set_modules():
        patches = getattr(importlib.import_module(name), "PATCHES", None)
        if not isinstance(patches, tuple) or not all(isinstance(p, Patch) for p in patches):
            raise RuntimeError(f"{name} must export PATCHES, a tuple of Patch instances")
        found.extend(patches)
    return tuple(found)


def supported_versions() -> list[str]:
    return sorted({v for p in registry() for v in p.versions})


def select_patches(version: str, options: Options) -> list[Patch]:
    for_version = [p for p in registry() if version in p.versions]
    if not for_version:
        raise EngineError(
            "verl-version-unsupported",
            f"no patch set for verl {version} (supported: {', '.join(supported_versions())}); "
            "pin verl to a supported version",
        )
    return [p for p in for_version if p.applies(options)]
