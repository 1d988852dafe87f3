"""The compat module oldgpu adds to the tree (``verl/utils/oldgpu_compat.py``): its name,
its rendering with the profile's values baked in, and the import that patched files need.
Its source is ``runtime/compat.py`` with ``runtime/compat_logits.py``,
``runtime/compat_base16.py`` and ``runtime/compat_rollout.py`` (and ``compat_cpu.py`` for
cpu trees, ``compat_fp16.py`` for fp16 ones)."""

from __future__ import annotations

import ast
import json
from importlib import resources

from oldgpu.patch.options import Options
from oldgpu.patch.sitepatch import Site, SiteNotFound, VerifyFailed
from oldgpu.patch.source import MODULE_SCOPE, Edit, SourceFile, apply_edits

COMPAT_REL = "verl/utils/oldgpu_compat.py"
COMPAT_MODULE = "verl.utils.oldgpu_compat"
COMPAT_ALIAS = "oldgpu_compat"
COMPAT_IMPORT = "from verl.utils import oldgpu_compat"


def compat_source() -> str:
    return (resources.files("oldgpu.patch.runtime") / "compat.py").read_text(encoding="utf-8")


def compat_exports() -> set[str]:
    """The names the compat module's ``__all__`` lists."""
    tree = SourceFile(COMPAT_REL, compat_source().encode("utf-8")).tree
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "__all__" for t in node.targets
        ):
            return {elt.value for elt in node.value.elts}
    raise RuntimeError("compat.py has no __all__")


def render_compat(options: Options) -> bytes:
    """The compat module with the profile's values baked in (by AST, not by text search)."""
    data = compat_source().encode("utf-8")
    src = SourceFile(COMPAT_REL, data)
    baked = {
        "BAKED_COMPUTE_DTYPE": options.compute_dtype,
        "BAKED_ATTN_IMPLEMENTATION": options.attn_implementation,
    }
    edits = []
    for node in src.tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = getattr(node.targets[0], "id", None)
            if name in baked:
                start, end = src.span(node.value)
                edits.append(Edit(start, end, json.dumps(baked.pop(name))))
    if baked:
        raise RuntimeError(f"compat.py lacks {sorted(baked)}")
    rendered = apply_edits(data, edits)
    # the logits patch set's helpers (verl_0_5_0/logits.py), for every tree
    logits = (resources.files("oldgpu.patch.runtime") / "compat_logits.py").read_bytes()
    rendered = rendered.rstrip(b"\n") + b"\n\n\n" + logits
    # a LoRA actor's 16-bit base (verl_0_5_0/base16.py), for every tree
    base16 = (resources.files("oldgpu.patch.runtime") / "compat_base16.py").read_bytes()
    rendered = rendered.rstrip(b"\n") + b"\n\n\n" + base16
    # the rollout patch set's weight-sync stamp (verl_0_9_0/rollout.py), for every tree
    rollout = (resources.files("oldgpu.patch.runtime") / "compat_rollout.py").read_bytes()
    rendered = rendered.rstrip(b"\n") + b"\n\n\n" + rollout
    if options.device == "cpu":  # the cpu patch set's helpers, for cpu trees only
        cpu = (resources.files("oldgpu.patch.runtime") / "compat_cpu.py").read_bytes()
        rendered = rendered.rstrip(b"\n") + b"\n\n\n" + cpu
    if options.compute_dtype == "fp16":  # the fp16 patch set's loss scaler
        fp16 = (resources.files("oldgpu.patch.runtime") / "compat_fp16.py").read_bytes()
        rendered = rendered.rstrip(b"\n") + b"\n\n\n" + fp16
    return rendered


def compat_import_edit(src: SourceFile) -> tuple[Edit, Site]:
    """Insert the compat import after the module's last top-level import (before any def)."""
    last = None
    for node in src.tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            break
        if isinstance(node, ast.Import | ast.ImportFrom):
            last = node
        if isinstance(node, ast.Import | ast.ImportFrom) and COMPAT_ALIAS in {
            a.asname or a.name for a in node.names
        }:
            raise SiteNotFound(f"already imports {COMPAT_ALIAS}")
    if last is None:
        raise SiteNotFound("no module-level import block to add the compat import to")
    pos = src.after_line(last.end_lineno)
    lead = "" if src.ends_with_newline(last.end_lineno) else "\n"
    text = f"{lead}{COMPAT_IMPORT}  # oldgpu: the profile's dtype and attention\n"
    site = Site(src.rel, MODULE_SCOPE, last.end_lineno + 1, f"added `{COMPAT_IMPORT}`")
    return Edit(pos, pos, text), site


def verify_compat_import(src: SourceFile) -> None:
    hits = [
        n
        for n in src.tree.body
        if isinstance(n, ast.ImportFrom)
        and n.module == "verl.utils"
        and [a.name for a in n.names] == [COMPAT_ALIAS]
    ]
    if len(hits) != 1:
        raise VerifyFailed(f"expected one module-level `{COMPAT_IMPORT}`, found {len(hits)}")
