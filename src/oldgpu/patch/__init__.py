"""``oldgpu patch DIR``: patch a verl checkout (or unpacked sdist) for a profile.

How it works:

- Each ``Patch`` names the verl versions it is for, the files it edits, finds its sites
  by code structure (the AST, scoped by class and function) and checks the result
  itself after it is applied. ``applies(options)`` lets profile-specific patch sets (a
  ``cpu`` profile, say) join only for that profile.
- The patched content is always computed from the originals: pristine files, or the
  copies kept in ``DIR/.oldgpu-originals/`` after the first patch. So a second patch
  with the same options finds nothing to do, and patching with other options (eager
  instead of sdpa, say) is revert-then-apply in one atomic step.
- Sites call into ``verl/utils/oldgpu_compat.py``, written into the tree with the
  profile's compute dtype and attention implementation baked in; the environment
  variables OLDGPU_COMPUTE_DTYPE and OLDGPU_ATTN_IMPLEMENTATION override them at run
  time, so a card swap needs no re-patch.
- ``DIR/.oldgpu-patch.json`` records the engine and verl versions, the options, and per
  file the original and patched sha256. A file matching neither is a hand edit: the
  patcher refuses to touch the tree.
- All or nothing: every new content is computed and verified in memory, then a
  journal (``DIR/.oldgpu-patch.journal``) records every write before the first one;
  the files are staged as temporary files and renamed into place, the manifest last.
  A failed write rolls back the ones done; a run killed halfway is finished or undone
  by the next run (patch, revert or check), so the tree is always the old one or the
  new one, byte for byte.

Where each part lives: ``options.py`` (what a run is for), ``sitepatch.py`` (what a
patch is), ``registry.py`` (which patches a version gets: one package per release,
``verl_<x>_<y>_<z>/``, its ``base`` set and the sets that join for some options, found
by name), ``runtime/`` (the modules dropped into verl's tree), ``compat_module.py``
(renders them as the one module added to the tree),
``manifest.py`` (the tree's records), ``plans.py`` (the new bytes, verified),
``transaction.py`` (writing them all or nothing) and ``cli.py``.
"""

from __future__ import annotations

from oldgpu.patch.cli import add_parser, run
from oldgpu.patch.compat_module import COMPAT_REL
from oldgpu.patch.manifest import MANIFEST_NAME, ORIGINALS_DIR
from oldgpu.patch.options import Options
from oldgpu.patch.plans import Plan, plan_patch, plan_revert
from oldgpu.patch.registry import select_patches, supported_versions
from oldgpu.patch.transaction import commit

__all__ = [
    "COMPAT_REL",
    "MANIFEST_NAME",
    "ORIGINALS_DIR",
    "Options",
    "Plan",
    "add_parser",
    "commit",
    "plan_patch",
    "plan_revert",
    "run",
    "select_patches",
    "supported_versions",
]
