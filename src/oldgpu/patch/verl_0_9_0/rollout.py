"""The rollout patch set for verl 0.9.0, every profile: no weight export for a rollout
that generates from the trainer's own parameters.

verl 0.9.0's worker, on the colocated (``naive``) weight sync, flushes the allocator
(``aggressive_empty_cache``: up to three ``gc.collect`` and ``empty_cache`` rounds),
builds the engine's state dict of every parameter (``get_per_tensor_param``; on FSDP1
that runs FSDP's state-dict machinery over the whole model), hands it to the rollout and
flushes again. ``oldgpu-hf`` with ``weights: trainer`` (rollout/colocated.py) reads none
of it: it generates from the module the trainer trains. Measured on the lent H200
(docs/newer-verl.md), that sync still took 0.88-1.12 s a step, which verl 0.5.0's HF
rollout does not spend, and the flushes hand the allocator's cache back to the driver
just before the rollout needs it again.

- ``shared-weights-sync``: in ``ActorRolloutRefWorker.update_weights``, before the
  ``naive`` path's ``set_expandable_segments(False)``, a rollout that says it shares
  the trainer's weights (``oldgpu_compat.shares_trainer_weights``) gets
  ``oldgpu_compat.stamp_shared_weights`` instead: the same wake-ups (``weights``, then
  ``kv_cache``), the step stamped through ``update_weights`` with nothing in it, and
  the allocator left as verl's own path leaves it (expandable segments on). Every other
  rollout (vLLM, SGLang, ``oldgpu-hf`` with ``weights: copy``) takes verl's path.
"""

from __future__ import annotations

import ast

from oldgpu.patch.compat_module import COMPAT_ALIAS
from oldgpu.patch.options import Options
from oldgpu.patch.sitepatch import Change, Patch, Site, SiteNotFound, VerifyFailed
from oldgpu.patch.source import Edit, SourceFile, dotted
from oldgpu.patch.verl_0_9_0.base import VERSIONS

ENGINE_WORKERS = "verl/workers/engine_workers.py"


def _is_call_stmt(node: ast.stmt, name: str, arg: object) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and dotted(node.value.func) == name
        and len(node.value.args) == 1
        and isinstance(node.value.args[0], ast.Constant)
        and node.value.args[0].value is arg
    )


class SharedWeightsSync(Patch):
    name = "shared-weights-sync"
    description = (
        "a rollout that generates from the trainer's own parameters gets its wake-ups and "
        "the step's stamp, not verl's state dict of every parameter and its cache flushes"
    )
    versions = VERSIONS
    files = (ENGINE_WORKERS,)
    scope = "ActorRolloutRefWorker.update_weights"
    ANCHOR = "set_expandable_segments"
    CHECK = f"{COMPAT_ALIAS}.shares_trainer_weights"
    STAMP = f"{COMPAT_ALIAS}.stamp_shared_weights"

    def _body(self, src: SourceFile) -> list[ast.stmt]:
        fn = src.definition(self.scope)
        if not isinstance(fn, ast.AsyncFunctionDef):
            raise SiteNotFound(f"no async {self.scope}")
        args = [a.arg for a in fn.args.args]
        if args[:2] != ["self", "global_steps"]:
            raise SiteNotFound(f"{self.scope}: expected (self, global_steps, ...), got {args}")
        return fn.body

    def _anchor(self, body: list[ast.stmt]) -> int:
        found = [i for i, s in enumerate(body) if _is_call_stmt(s, self.ANCHOR, False)]
        if len(found) != 1:
            raise SiteNotFound(
                f"{self.scope}: expected one `{self.ANCHOR}(False)` opening the naive sync, "
                f"found {len(found)}"
            )
        # The naive path reads the weights after it: its state dict is what we skip.
        rest = ast.unparse(ast.Module(body=body[found[0] :], type_ignores=[]))
        if "get_per_tensor_param" not in rest or "self.rollout.update_weights" not in rest:
            raise SiteNotFound(f"{self.scope}: the naive sync no longer exports the weights")
        return found[0]

    def plan(self, src: SourceFile, options: Options) -> list[Change]:
        body = self._body(src)
        anchor = body[self._anchor(body)]
        indent = src.indent(anchor)
        text = (
            f"{indent}if {self.CHECK}(self.rollout):\n"
            f"{indent}    return await {self.STAMP}(self, global_steps)\n"
        )
        at = src.line_start(anchor.lineno)
        return [
            Change(
                Site(src.rel, self.scope, anchor.lineno, f"{self.STAMP} for a shared rollout"),
                (Edit(at, at, text),),
            )
        ]

    def verify(self, src: SourceFile, options: Options, changes: list[Change]) -> None:
        body = self._body(src)
        i = self._anchor(body)
        guard = body[i - 1] if i else None
        ok = (
            isinstance(guard, ast.If)
            and not guard.orelse
            and ast.unparse(guard.test) == f"{self.CHECK}(self.rollout)"
            and len(guard.body) == 1
            and ast.unparse(guard.body[0]) == f"return await {self.STAMP}(self, global_steps)"
        )
        if not ok:
            raise VerifyFailed(f"{self.scope}: no {self.STAMP} before `{self.ANCHOR}(False)`")


PATCHES: tuple[Patch, ...] = (SharedWeightsSync(),)
