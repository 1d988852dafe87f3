"""A LoRA actor's frozen base stored at 16 bits and computed in fp32 (a job's base_dtype).

verl 0.5.0 already loads the actor at ``fsdp_config.model_dtype`` and FSDP's
MixedPrecision(param_dtype=fp32), which the profile sets, upcasts each unit to fp32 just
in time and frees the copy after its forward: that is the mechanism, unchanged. Two sites
make it exact and small (the helpers in ``runtime/compat_base16.py``, for every tree;
with an fp32 model_dtype they change nothing):

- ``actor_module.to(torch_dtype)`` rounds the float32 buffers too (the rotary inv_freq):
  only the parameters move to 16 bits;
- ``get_fsdp_wrap_policy(...)`` leaves the embeddings and lm_head in the root unit, whose
  fp32 copy lives through the whole pass: with a 16-bit base they get units of their own.
"""

from __future__ import annotations

import ast

from oldgpu.patch.compat_module import COMPAT_ALIAS
from oldgpu.patch.sitepatch import SitePatch
from oldgpu.patch.source import Edit, SourceFile, dotted, is_call_to
from oldgpu.patch.verl_0_5_0.base import FSDP_WORKERS, VERSIONS

ACTOR_BUILD = "ActorRolloutRefWorker._build_model_optimizer"


def _compat(function: str) -> str:
    return f"{COMPAT_ALIAS}.{function}"


def _calls(node: ast.AST | None, name: str) -> bool:
    """``node`` is a call of ``name``, whatever its arguments."""
    return isinstance(node, ast.Call) and dotted(node.func) == name


class ModelDtypeParamsOnly(SitePatch):
    name = "base16-params-only"
    description = (
        "the actor moves its parameters, not its float32 buffers (rotary inv_freq), to "
        "fsdp_config.model_dtype when that is 16-bit (a LoRA job's base_dtype)"
    )
    versions = VERSIONS
    sites = ((FSDP_WORKERS, ACTOR_BUILD, 1),)
    MODULE = "actor_module"  # the site's name for the model (another release's may differ)
    what = f"{MODULE}.to(torch_dtype)"
    NEW = f"{_compat('to_model_dtype')}({MODULE}, torch_dtype)"

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            c
            for c in src.in_scope(scope, ast.Call)
            if dotted(c.func) == f"{self.MODULE}.to"
            and [dotted(a) for a in c.args] == ["torch_dtype"]
            and not c.keywords
        ]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            c
            for c in src.in_scope(scope, ast.Call)
            if is_call_to(c, _compat("to_model_dtype"), self.MODULE, "torch_dtype")
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        start, end = src.span(node)
        return (Edit(start, end, self.NEW),), f"{self.what} -> {self.NEW}"


class EmbeddingUnits(SitePatch):
    name = "base16-embedding-units"
    description = (
        "with a 16-bit base the actor's embeddings and untied lm_head are FSDP units of "
        "their own, so their fp32 copy lives only while they compute"
    )
    versions = VERSIONS
    what = "auto_wrap_policy = get_fsdp_wrap_policy(...)"
    sites = ((FSDP_WORKERS, ACTOR_BUILD, 1),)
    WRAP = _compat("embedding_units")
    MODULE = "actor_module"

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            a.value
            for a in src.in_scope(scope, ast.Assign)
            if [dotted(t) for t in a.targets] == ["auto_wrap_policy"]
            and _calls(a.value, "get_fsdp_wrap_policy")
        ]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            a.value
            for a in src.in_scope(scope, ast.Assign)
            if [dotted(t) for t in a.targets] == ["auto_wrap_policy"]
            and _calls(a.value, self.WRAP)
            and len(a.value.args) == 2
            and _calls(a.value.args[0], "get_fsdp_wrap_policy")
            and dotted(a.value.args[1]) == self.MODULE
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        start, end = src.span(node)
        return (
            Edit(start, start, f"{self.WRAP}("),
            Edit(end, end, f", {self.MODULE})"),
        ), f"get_fsdp_wrap_policy(...) -> {self.WRAP}(get_fsdp_wrap_policy(...), {self.MODULE})"


PATCHES = (ModelDtypeParamsOnly(), EmbeddingUnits())
