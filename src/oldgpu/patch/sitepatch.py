"""What a patch is, for any verl version: ``Patch`` (one change, found and verified in
the AST) and ``SitePatch`` (a patch made of like sites), with the records they return
and the two ways they fail. Version sets (``verl_<x>_<y>_<z>*.py``) build on these."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from oldgpu.patch.options import Options
from oldgpu.patch.source import Edit, SourceFile


@dataclass(frozen=True)
class Site:
    """One place a patch changed, for people: the line is the original's, informative only."""

    file: str
    function: str
    line: int
    change: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "function": self.function,
            "line": self.line,
            "change": self.change,
        }


@dataclass(frozen=True)
class Change:
    site: Site
    edits: tuple[Edit, ...]


class SiteNotFound(Exception):
    """The code a patch expects is not there (or not in the shape it expects)."""


class VerifyFailed(Exception):
    """A patched file does not have the shape the patch meant to give it."""


class Patch:
    """One change to verl, applied to every site it finds in ``files``.

    Subclasses set the class attributes and implement ``plan`` (find the sites in the
    original, return the edits) and ``verify`` (check the patched file).
    """

    name: str = ""
    description: str = ""
    versions: frozenset[str] = frozenset()
    files: tuple[str, ...] = ()
    # The patched sites refer to ``oldgpu_compat``: the file needs the module-level import.
    uses_compat: bool = True

    def applies(self, options: Options) -> bool:
        return True

    def plan(self, src: SourceFile, options: Options) -> list[Change]:
        raise NotImplementedError

    def verify(self, src: SourceFile, options: Options, changes: list[Change]) -> None:
        raise NotImplementedError


class SitePatch(Patch):
    """A patch made of like sites: ``(file, scope, count)`` with old and new shapes.

    Subclasses say what the old shape is (``old_nodes``), how to rewrite one node
    (``rewrite``) and what the new shape is (``new_nodes``). Planning requires exactly
    ``count`` old nodes per scope; verifying requires none left and ``count`` new ones.
    """

    sites: tuple[tuple[str, str, int], ...] = ()
    what: str = ""  # the old shape, for messages

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        if cls.sites:
            cls.files = tuple(dict.fromkeys(rel for rel, _, _ in cls.sites))

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        raise NotImplementedError

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        raise NotImplementedError

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        raise NotImplementedError

    def _scopes(self, rel: str) -> list[tuple[str, int]]:
        return [(scope, count) for file, scope, count in self.sites if file == rel]

    def plan(self, src: SourceFile, options: Options) -> list[Change]:
        changes = []
        for scope, count in self._scopes(src.rel):
            if not src.has_scope(scope):
                raise SiteNotFound(f"no {scope} (looking for {self.what})")
            nodes = sorted(self.old_nodes(src, scope), key=lambda n: (n.lineno, n.col_offset))
            if len(nodes) != count:
                raise SiteNotFound(
                    f"{scope}: expected {count} {self.what}, found {len(nodes)}"
                    + (" (site not found)" if not nodes else " (site ambiguous)")
                )
            for node in nodes:
                edits, change = self.rewrite(src, node)
                changes.append(Change(Site(src.rel, scope, node.lineno, change), edits))
        return changes

    def verify(self, src: SourceFile, options: Options, changes: list[Change]) -> None:
        for scope, count in self._scopes(src.rel):
            left = self.old_nodes(src, scope)
            if left:
                raise VerifyFailed(f"{scope}: {len(left)} {self.what} left after patching")
            new = self.new_nodes(src, scope)
            if len(new) != count:
                raise VerifyFailed(f"{scope}: expected {count} patched sites, found {len(new)}")
