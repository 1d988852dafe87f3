"""A parsed Python file that patches locate sites in and edit by byte span.

Sites are found by code structure (the AST, scoped by the enclosing class and
function), never by line number. Edits are byte spans into the original file, so
everything outside a site stays byte-identical (ast offsets are UTF-8 bytes).
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass

MODULE_SCOPE = "<module>"


@dataclass(frozen=True)
class Edit:
    """Replace ``data[start:end]`` with ``text``; start == end inserts."""

    start: int
    end: int
    text: str


class SourceFile:
    def __init__(self, rel: str, data: bytes) -> None:
        self.rel = rel
        self.data = data
        self.tree = ast.parse(data, filename=rel)  # SyntaxError is the caller's to name
        self._line_starts = [0]
        pos = data.find(b"\n")
        while pos != -1:
            self._line_starts.append(pos + 1)
            pos = data.find(b"\n", pos + 1)
        self._scope: dict[int, str] = {}
        self._parent: dict[int, ast.AST] = {}
        self._defs: dict[str, ast.AST] = {}
        self._index(self.tree, MODULE_SCOPE)

    def _index(self, node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            self._parent[id(child)] = node
            self._scope[id(child)] = scope
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = child.name if scope == MODULE_SCOPE else f"{scope}.{child.name}"
                self._defs.setdefault(inner, child)
                self._index(child, inner)
            else:
                self._index(child, scope)

    # --- where things are ---

    def scope(self, node: ast.AST) -> str:
        """Qualified name of the innermost class/function holding ``node``."""
        return self._scope.get(id(node), MODULE_SCOPE)

    def parent(self, node: ast.AST) -> ast.AST | None:
        return self._parent.get(id(node))

    def in_scope(self, scope: str, kind: type | tuple[type, ...]) -> list:
        """Every node of ``kind`` whose innermost enclosing def/class is ``scope``."""
        return [n for n in ast.walk(self.tree) if isinstance(n, kind) and self.scope(n) == scope]

    def definition(self, qualname: str) -> ast.AST | None:
        """The class or function called ``qualname`` (e.g. ``Worker.generate``)."""
        return self._defs.get(qualname)

    def has_scope(self, qualname: str) -> bool:
        return qualname == MODULE_SCOPE or qualname in self._defs

    # --- byte offsets ---

    def offset(self, lineno: int, col: int) -> int:
        return self._line_starts[lineno - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (
            self.offset(node.lineno, node.col_offset),
            self.offset(node.end_lineno, node.end_col_offset),
        )

    def text(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.data[start:end].decode("utf-8")

    def line_start(self, lineno: int) -> int:
        return self._line_starts[lineno - 1]

    def after_line(self, lineno: int) -> int:
        """Offset just past line ``lineno`` (its newline included)."""
        return self._line_starts[lineno] if lineno < len(self._line_starts) else len(self.data)

    def ends_with_newline(self, lineno: int) -> bool:
        return lineno < len(self._line_starts)

    def indent(self, node: ast.stmt) -> str:
        """The whitespace before a statement that starts its own line."""
        start = self.line_start(node.lineno)
        prefix = self.data[start : start + node.col_offset].decode("utf-8")
        if prefix.strip():
            raise ValueError(f"{self.rel}:{node.lineno}: statement does not start its line")
        return prefix


def apply_edits(data: bytes, edits: list[Edit]) -> bytes:
    """Apply non-overlapping edits (all spans refer to ``data``)."""
    ordered = sorted(edits, key=lambda e: (e.start, e.end))
    for before, after in itertools.pairwise(ordered):
        if after.start < before.end:
            raise ValueError(f"overlapping edits at bytes {before.start}-{before.end}")
    out = []
    pos = 0
    for edit in ordered:
        out.append(data[pos : edit.start])
        out.append(edit.text.encode("utf-8"))
        pos = edit.end
    out.append(data[pos:])
    return b"".join(out)


def dotted(node: ast.AST | None) -> str | None:
    """``torch.bfloat16`` for Attribute(Name(torch), bfloat16); None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def keyword(call: ast.Call, name: str) -> ast.keyword | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw
    return None


def is_call_to(node: ast.AST | None, name: str, *args: str) -> bool:
    """``node`` is ``name(*args)`` with no keywords, args given as dotted names."""
    return (
        isinstance(node, ast.Call)
        and dotted(node.func) == name
        and not node.keywords
        and [dotted(a) for a in node.args] == list(args)
    )
