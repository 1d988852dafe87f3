"""Which patches a verl version gets, found without a hand-kept list.

A version's patch set is a module of this package named ``verl_<x>_<y>_<z>.py``, or
``verl_<x>_<y>_<z>_<what>.py`` for a set that joins only for some options (the cpu
set); it exports ``PATCHES``, a tuple of ``Patch``, and each patch's ``versions`` says
which verl versions it is for (so one module may serve several). Adding a file is all
it takes: modules are read in name order, so a base set comes before its additions.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re

from oldgpu.output import EngineError
from oldgpu.patch.options import Options
from oldgpu.patch.sitepatch import Patch

PATCH_SET_MODULE = re.compile(r"verl_\d+_\d+_\d+(_\w+)?")


def patch_set_modules() -> list[str]:
    """The patch set modules of this package, by name."""
    package = importlib.import_module(__package__)
    return sorted(
        f"{__package__}.{info.name}"
        for info in pkgutil.iter_modules(package.__path__)
        if PATCH_SET_MODULE.fullmatch(info.name)
    )


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
