"""Import hooks: arm the guard when torch or triton finish importing; hide flash-attn."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

from oldgpu.guard.policy import BLOCKED_DISTRIBUTIONS, BLOCKED_MODULES
from oldgpu.guard.state import _STATE, _patch, record


def _is_blocked_module(fullname: str) -> bool:
    root = fullname.split(".", 1)[0]
    return root in BLOCKED_MODULES


def _norm_dist(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


class _PostImportHooks(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a module (torch, triton) finished importing."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _STATE.import_hooks or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _HookedLoader(spec.loader, fullname)
        return spec


class _HookedLoader:
    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            module.__loader__ = self._loader
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self._loader
        for callback in _STATE.import_hooks.pop(self._name, []):
            _run_hook(callback, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _run_hook(callback: Callable[[Any], None], module: Any) -> None:
    try:
        callback(module)
    except Exception as exc:  # never break the import itself
        sys.stderr.write(f"oldgpu guard: arming after `import {module.__name__}` failed: {exc!r}\n")
        record("arm-failed", module=module.__name__, error=repr(exc))


def _when_imported(name: str, callback: Callable[[Any], None]) -> None:
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is not None and not getattr(spec, "_initializing", False):
        _run_hook(callback, module)
        return
    _STATE.import_hooks.setdefault(name, []).append(callback)


# -- flash-attn: not installed, as far as anyone can tell -------------------------------


def _block_flash_attn() -> None:
    path_finder = importlib.machinery.PathFinder
    original = path_finder.find_spec  # a bound classmethod

    def find_spec(cls: Any, fullname: str, path: Any = None, target: Any = None) -> Any:
        if _is_blocked_module(fullname):
            if fullname not in _STATE.blocked_seen:
                _STATE.blocked_seen.add(fullname)
                record("blocked-import", module=fullname)
            return None
        return original(fullname, path, target)

    _patch(path_finder, "find_spec", classmethod(find_spec))
    import importlib.metadata as metadata

    dist = metadata.Distribution
    original_from_name = dist.from_name  # bound classmethod

    def from_name(cls: Any, name: str) -> Any:
        if _norm_dist(name) in {_norm_dist(n) for n in BLOCKED_DISTRIBUTIONS}:
            raise metadata.PackageNotFoundError(name)
        return original_from_name(name)

    _patch(dist, "from_name", classmethod(from_name))
    for name in list(sys.modules):
        if _is_blocked_module(name):
            record("preimported", module=name)
            del sys.modules[name]
