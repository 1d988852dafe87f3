"""A LoRA actor's frozen base stored at 16 bits and computed in fp32 (a job's base_dtype),
on verl 0.9.0's FSDP engine.

The mechanism is 0.5.0's (``verl_0_5_0/base16.py``): the engine loads the model at
``fsdp_config.model_dtype`` and FSDP's MixedPrecision(param_dtype=fp32), the profile's,
upcasts one unit at a time just in time. Its two sites are here too, in the engine's
``_build_module`` and ``_build_fsdp_module``, with the same helpers
(``runtime/compat_base16.py``); the rollout (``oldgpu-hf``) generates from this module
(``rollout/colocated.py``), so there is no second copy. 0.9.0 adds a third:

- ``_build_lora_module`` casts the fp32 adapters peft makes to the frozen base's dtype
  ("FSDP requires all params in a flat group to share dtype"), so a bf16 base would
  train bf16 adapters with bf16 gradients and Adam. verl's LoRA wrap policy gives each
  adapter an FSDP unit of its own, where no flat group holds both: the cast stays only
  where a dry run of the wrap finds one that would (``adapter_cast_dtype``).

With an fp32 model_dtype none of them changes anything.
"""

from __future__ import annotations

import ast

from oldgpu.patch.compat_module import COMPAT_ALIAS
from oldgpu.patch.sitepatch import SitePatch
from oldgpu.patch.source import Edit, SourceFile, dotted, is_call_to
from oldgpu.patch.verl_0_5_0 import base16 as base16_050
from oldgpu.patch.verl_0_9_0.base import FSDP_ENGINE, VERSIONS


class ModelDtypeParamsOnly(base16_050.ModelDtypeParamsOnly):
    description = (
        "the FSDP engine moves the model's parameters, not its float32 buffers (rotary "
        "inv_freq), to fsdp_config.model_dtype when that is 16-bit (a LoRA job's base_dtype)"
    )
    versions = VERSIONS
    sites = ((FSDP_ENGINE, "FSDPEngine._build_module", 1),)
    MODULE = "module"
    what = f"{MODULE}.to(torch_dtype)"
    NEW = f"{COMPAT_ALIAS}.to_model_dtype({MODULE}, torch_dtype)"


class EmbeddingUnits(base16_050.EmbeddingUnits):
    description = (
        "with a 16-bit base the FSDP engine's embeddings and untied lm_head are units of "
        "their own, so their fp32 copy lives only while they compute"
    )
    versions = VERSIONS
    sites = ((FSDP_ENGINE, "FSDPEngine._build_fsdp_module", 1),)
    MODULE = "module"


class AdaptersKeepTheirDtype(SitePatch):
    name = "base16-adapters-fp32"
    description = (
        "the LoRA adapters are cast to the frozen base's dtype only where an FSDP flat "
        "group would hold both (verl's LoRA wrap policy gives them units of their own): "
        "with a 16-bit base they stay fp32, their gradients and Adam too"
    )
    versions = VERSIONS
    what = "base_dtype = next(...)"
    sites = ((FSDP_ENGINE, "FSDPEngine._build_lora_module", 1),)
    NEW = f"{COMPAT_ALIAS}.adapter_cast_dtype(module, self.engine_config)"

    def _assigns(self, src: SourceFile, scope: str) -> list[ast.Assign]:
        return [
            a
            for a in src.in_scope(scope, ast.Assign)
            if [dotted(t) for t in a.targets] == ["base_dtype"]
        ]

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        # next((p.dtype for p in module.parameters() if not p.requires_grad), None)
        return [
            a.value
            for a in self._assigns(src, scope)
            if base16_050._calls(a.value, "next")
            and len(a.value.args) == 2
            and isinstance(a.value.args[0], ast.GeneratorExp)
            and is_call_to(a.value.args[0].generators[0].iter, "module.parameters")
            and "requires_grad" in src.text(a.value.args[0])
        ]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            a.value
            for a in self._assigns(src, scope)
            if is_call_to(
                a.value, f"{COMPAT_ALIAS}.adapter_cast_dtype", "module", "self.engine_config"
            )
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        start, end = src.span(node)
        return (Edit(start, end, self.NEW),), f"base_dtype = next(...) -> {self.NEW}"


PATCHES = (ModelDtypeParamsOnly(), EmbeddingUnits(), AdaptersKeepTheirDtype())
