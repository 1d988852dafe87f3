"""The fp16 patch set for verl 0.5.0: a loss scaler on the actor's and critic's updates,
and the HF rollout on an fp16 copy of the actor (the logits of the response only and
the entropy by rows, which began here, are every profile's: verl_0_5_0/logits.py).

These join only for compute dtype fp16 (the volta and turing profiles), on top of the
dtype/attention set, whose autocast sites already follow the profile's dtype. verl
0.5.0 has no loss scaler: fp16 gradients of small losses underflow and large ones
overflow, which is what users of V100/T4 reported. Upstream added FSDP's
``ShardedGradScaler`` in v0.6.1; this is the same idea written against 0.5.0's code:

- ``loss.backward()`` -> ``oldgpu_compat.scale_loss(self, loss).backward()``;
- in ``_optimizer_step``: unscale before the grad clip, ``scaler.step`` for
  ``optimizer.step()`` (verl already skips on a non-finite grad norm, and
  ``scaler.step`` skips on inf/nan too), ``scaler.update`` after, before the return;
- the update's metrics get ``<role>/grad_scale`` and ``<role>/skipped_steps``.

The HF rollout (``fp16-hf-rollout``): ``HFRollout.generate_sequences`` generates inside
``oldgpu_compat.fp16_rollout(self)``, which swaps the FSDP actor for an fp16 copy cast
once per call (autocast over the fp32 weights re-casts them at every decoding step).

Weights and optimizer state stay fp32 (the profile's Hydra overrides keep FSDP's
param_dtype fp32); only autocast's matmuls run in fp16. The helpers live in
``compat_fp16.py`` and read the compute dtype at run time, so a tree patched for fp16
run with ``OLDGPU_COMPUTE_DTYPE=fp32`` has the scaler disabled (a pass-through).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from oldgpu.patch.compat_module import COMPAT_ALIAS
from oldgpu.patch.options import Options
from oldgpu.patch.sitepatch import Change, Patch, Site, SiteNotFound, VerifyFailed
from oldgpu.patch.source import Edit, SourceFile, dotted, is_call_to
from oldgpu.patch.verl_0_5_0.base import DP_ACTOR, DP_CRITIC, HF_ROLLOUT, VERSIONS


@dataclass(frozen=True)
class _Role:
    file: str
    update: str  # the update method (backward and the metrics it returns)
    step: str  # the optimizer-step method (clip, step)
    optimizer: str  # the attribute holding the optimizer, dotted
    role: str  # metrics prefix


ROLES = (
    _Role(
        DP_ACTOR,
        "DataParallelPPOActor.update_policy",
        "DataParallelPPOActor._optimizer_step",
        "self.actor_optimizer",
        "actor",
    ),
    _Role(
        DP_CRITIC,
        "DataParallelPPOCritic.update_critic",
        "DataParallelPPOCritic._optimizer_step",
        "self.critic_optimizer",
        "critic",
    ),
)


def _c(function: str) -> str:
    return f"{COMPAT_ALIAS}.{function}"


def _expr_call(stmt: ast.stmt, name: str, *args: str) -> bool:
    return isinstance(stmt, ast.Expr) and is_call_to(stmt.value, name, *args)


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and dotted(n.func) == name]


class Fp16LossScaler(Patch):
    name = "fp16-loss-scaler"
    description = (
        "fp16: the actor's and critic's updates scale the loss with FSDP's "
        "ShardedGradScaler, unscale before the grad clip, skip the step on inf/nan, "
        "and report <role>/grad_scale and <role>/skipped_steps"
    )
    versions = VERSIONS
    files = tuple(r.file for r in ROLES)

    def applies(self, options: Options) -> bool:
        return options.compute_dtype == "fp16"

    @staticmethod
    def _function(src: SourceFile, scope: str) -> ast.FunctionDef:
        fn = src.definition(scope)
        if not isinstance(fn, ast.FunctionDef):
            raise SiteNotFound(f"no {scope}")
        return fn

    @staticmethod
    def _returns(fn: ast.FunctionDef, name: str) -> ast.Return:
        last = fn.body[-1]
        if not (isinstance(last, ast.Return) and dotted(last.value) == name):
            raise SiteNotFound(f"{fn.name} does not end with `return {name}`")
        return last

    def _backwards(self, src: SourceFile, scope: str) -> list[ast.Call]:
        return [
            c
            for c in src.in_scope(scope, ast.Call)
            if isinstance(c.func, ast.Attribute) and c.func.attr == "backward"
        ]

    def _clip_index(self, fn: ast.FunctionDef) -> int:
        """The statement that computes ``grad_norm`` (verl's FSDP/FSDP2/plain clip)."""
        found = [
            i
            for i, stmt in enumerate(fn.body)
            if isinstance(stmt, ast.If)
            and any(
                "clip_grad_norm_" in (dotted(c.func) or "")
                for c in ast.walk(stmt)
                if isinstance(c, ast.Call)
            )
        ]
        if len(found) != 1:
            raise SiteNotFound(f"{fn.name}: expected one grad-clip block, found {len(found)}")
        return found[0]

    def plan(self, src: SourceFile, options: Options) -> list[Change]:
        changes = []
        for role in (r for r in ROLES if r.file == src.rel):
            # The update: the one loss.backward(), and the metrics it returns.
            update = self._function(src, role.update)
            backs = self._backwards(src, role.update)
            if len(backs) != 1 or dotted(backs[0].func) != "loss.backward" or backs[0].args:
                raise SiteNotFound(
                    f"{role.update}: expected one `loss.backward()`, found "
                    f"{[src.text(b) for b in backs]}"
                )
            start, end = src.span(backs[0].func.value)
            scaled = f"{_c('scale_loss')}(self, loss)"
            changes.append(
                Change(
                    Site(
                        src.rel,
                        role.update,
                        backs[0].lineno,
                        f"loss.backward() -> {scaled}.backward()",
                    ),
                    (Edit(start, end, scaled),),
                )
            )
            ret = self._returns(update, "metrics")
            at = src.line_start(ret.lineno)
            text = f'{src.indent(ret)}{_c("scaler_metrics")}(self, metrics, "{role.role}")\n'
            changes.append(
                Change(
                    Site(src.rel, role.update, ret.lineno, f"{text.strip()} before the return"),
                    (Edit(at, at, text),),
                )
            )
            # The optimizer step: unscale before the clip, scaler.step, scaler.update.
            step = self._function(src, role.step)
            clip = self._clip_index(step)
            steps = _calls(step, f"{role.optimizer}.step")
            if len(steps) != 1 or steps[0].args or steps[0].keywords:
                raise SiteNotFound(f"{role.step}: expected one `{role.optimizer}.step()`")
            first = step.body[clip]
            at = src.line_start(first.lineno)
            unscale = f"{src.indent(first)}{_c('unscale_grads')}(self, {role.optimizer})\n"
            s_start, s_end = src.span(steps[0])
            new_step = f"{_c('scaler_step')}(self, {role.optimizer})"
            ret = self._returns(step, "grad_norm")
            r_at = src.line_start(ret.lineno)
            update_text = f"{src.indent(ret)}{_c('scaler_update')}(self, grad_norm)\n"
            changes.append(
                Change(
                    Site(
                        src.rel,
                        role.step,
                        first.lineno,
                        f"{unscale.strip()} before the grad clip; {role.optimizer}.step() -> "
                        f"{new_step}; {update_text.strip()} before the return",
                    ),
                    (
                        Edit(at, at, unscale),
                        Edit(s_start, s_end, new_step),
                        Edit(r_at, r_at, update_text),
                    ),
                )
            )
        return changes

    def verify(self, src: SourceFile, options: Options, changes: list[Change]) -> None:
        for role in (r for r in ROLES if r.file == src.rel):
            backs = self._backwards(src, role.update)
            if len(backs) != 1 or not is_call_to(
                backs[0].func.value, _c("scale_loss"), "self", "loss"
            ):
                raise VerifyFailed(f"{role.update}: the backward is not on the scaled loss")
            update = self._function(src, role.update)
            call = getattr(update.body[-2], "value", None)
            if not (
                isinstance(call, ast.Call)
                and dotted(call.func) == _c("scaler_metrics")
                and [dotted(a) for a in call.args[:2]] == ["self", "metrics"]
                and len(call.args) == 3
                and isinstance(call.args[2], ast.Constant)
                and call.args[2].value == role.role
            ):
                raise VerifyFailed(f"{role.update}: no scaler metrics before the return")
            step = self._function(src, role.step)
            body = step.body
            clip = self._clip_index(step)
            if not _expr_call(body[clip - 1], _c("unscale_grads"), "self", role.optimizer):
                raise VerifyFailed(f"{role.step}: the grads are not unscaled before the clip")
            if _calls(step, f"{role.optimizer}.step"):
                raise VerifyFailed(f"{role.step}: a bare {role.optimizer}.step() is left")
            stepped = [
                i
                for i, stmt in enumerate(body)
                if any(
                    is_call_to(c, _c("scaler_step"), "self", role.optimizer)
                    for c in ast.walk(stmt)
                    if isinstance(c, ast.Call)
                )
            ]
            if len(stepped) != 1 or not clip < stepped[0]:
                raise VerifyFailed(f"{role.step}: scaler_step is not after the clip")
            if not (
                isinstance(body[-1], ast.Return)
                and _expr_call(body[-2], _c("scaler_update"), "self", "grad_norm")
                and stepped[0] < len(body) - 2
            ):
                raise VerifyFailed(f"{role.step}: scaler_update is not after the step")


class Fp16HfRollout(Patch):
    name = "fp16-hf-rollout"
    description = (
        "fp16: the HF rollout generates with an fp16 copy of the actor, cast once per "
        "generate_sequences call (training keeps the fp32 weights)"
    )
    versions = VERSIONS
    files = (HF_ROLLOUT,)
    scope = "HFRollout.generate_sequences"
    CONTEXT = f"{COMPAT_ALIAS}.fp16_rollout(self)"

    def applies(self, options: Options) -> bool:
        return options.compute_dtype == "fp16"

    @staticmethod
    def _generates(node: ast.AST) -> bool:
        """``output = [self._generate_minibatch(p) for p in ...]``"""
        return (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.ListComp)
            and isinstance(node.value.elt, ast.Call)
            and dotted(node.value.elt.func) == "self._generate_minibatch"
        )

    def _function(self, src: SourceFile) -> ast.FunctionDef:
        fn = src.definition(self.scope)
        if not isinstance(fn, ast.FunctionDef):
            raise SiteNotFound(f"no {self.scope}")
        return fn

    def plan(self, src: SourceFile, options: Options) -> list[Change]:
        fn = self._function(src)
        found = [s for s in fn.body if self._generates(s)]
        if len(found) != 1 or found[0].lineno != found[0].end_lineno:
            raise SiteNotFound(
                f"{self.scope}: expected one one-line "
                f"`output = [self._generate_minibatch(p) for p in ...]`, found {len(found)}"
            )
        stmt = found[0]
        at = src.line_start(stmt.lineno)
        indent = src.indent(stmt)
        text = f"{indent}with {self.CONTEXT}:  # oldgpu: generate on fp16 weights\n    "
        site = Site(
            src.rel,
            self.scope,
            stmt.lineno,
            f"the minibatches are generated inside `with {self.CONTEXT}:`",
        )
        return [Change(site, (Edit(at, at, text),))]

    def verify(self, src: SourceFile, options: Options, changes: list[Change]) -> None:
        fn = self._function(src)
        if any(self._generates(s) for s in fn.body):
            raise VerifyFailed(f"{self.scope}: a minibatch is generated outside fp16_rollout")
        blocks = [
            s
            for s in fn.body
            if isinstance(s, ast.With)
            and len(s.items) == 1
            and is_call_to(s.items[0].context_expr, f"{COMPAT_ALIAS}.fp16_rollout", "self")
        ]
        if len(blocks) != 1 or [self._generates(s) for s in blocks[0].body] != [True]:
            raise VerifyFailed(f"{self.scope}: no `with {self.CONTEXT}:` around the generation")


PATCHES: tuple[Patch, ...] = (
    Fp16LossScaler(),
    Fp16HfRollout(),
)
