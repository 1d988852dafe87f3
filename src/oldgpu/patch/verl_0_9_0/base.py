"""The patch set for verl 0.9.0: what a setting cannot fix on a pre-Ampere GPU.

verl 0.9.0 trains through the model engine (``verl/workers/engine_workers.py`` over
``verl/workers/engine/fsdp/transformer_impl.py``); the legacy ``fsdp_workers.py``,
``dp_actor.py`` and ``dp_critic.py`` of 0.5.0 are gone. Most of what stopped 0.5.0 on
Pascal is a setting there (``use_torch_compile``, ``use_remove_padding``,
``override_config.attn_implementation``, ``mixed_precision``; docs/newer-verl.md lists
the overrides). What is left is patched here:

- the FSDP engine's bf16 defaults (the FSDP param dtype when ``mixed_precision`` is
  unset, and the autocast dtype before it is known) follow the profile's compute dtype;
- the HF model config's attention default, and the critic's value-head loading (which
  hard-codes FlashAttention-2 over the config), follow the profile's attention;
- the remove-padding helpers, which the legacy PPO trainer (``trainer.use_v1=false``)
  calls on every batch whatever ``use_remove_padding`` says, fall back to pure torch
  when flash-attn is absent;
- the merged-LoRA weight export to the rollout keeps the compute dtype instead of
  rounding through bf16.

Each site is named by file and enclosing class/function, found in the AST, its shape
checked before it is rewritten, and the result verified after.
"""

from __future__ import annotations

import ast

from oldgpu.patch.compat_module import COMPAT_ALIAS
from oldgpu.patch.options import Options
from oldgpu.patch.sitepatch import Change, Patch, SiteNotFound, SitePatch, VerifyFailed
from oldgpu.patch.source import Edit, SourceFile, dotted, is_call_to, is_constant
from oldgpu.patch.verl_0_5_0 import base as verl_0_5_0

VERSIONS = frozenset({"0.9.0"})

FSDP_ENGINE = "verl/workers/engine/fsdp/transformer_impl.py"
MODEL_CONFIG = "verl/workers/config/model.py"
MODEL_UTILS = "verl/utils/model.py"
ATTENTION_UTILS = "verl/utils/attention_utils.py"

BF16 = "torch.bfloat16"
COMPUTE_DTYPE = f"{COMPAT_ALIAS}.compute_dtype()"


def _compat_call(node: ast.AST | None, function: str) -> bool:
    return is_call_to(node, f"{COMPAT_ALIAS}.{function}")


class Bf16SitePatch(SitePatch):
    """``torch.bfloat16`` at sites of a known shape becomes ``oldgpu_compat.compute_dtype()``.

    Every ``torch.bfloat16`` in a site's scope counts (so verify finds any left over);
    ``shape`` says whether one is where this patch expects it, and what it is, for the
    report. A ``torch.bfloat16`` elsewhere in the scope is a changed tree: refused.
    """

    versions = VERSIONS
    what = BF16

    def shape(self, src: SourceFile, node: ast.AST) -> str | None:
        """The site's code with ``torch.bfloat16`` in it, or None when not the expected shape."""
        raise NotImplementedError

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [n for n in src.in_scope(scope, ast.Attribute) if dotted(n) == BF16]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [n for n in src.in_scope(scope, ast.Call) if _compat_call(n, "compute_dtype")]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        old = self.shape(src, node)
        if old is None:
            raise SiteNotFound(
                f"line {node.lineno}: {BF16} is not in the expected shape ({self.what})"
            )
        start, end = src.span(node)
        return (Edit(start, end, COMPUTE_DTYPE),), f"{old} -> {old.replace(BF16, COMPUTE_DTYPE)}"


def _assigned_to(src: SourceFile, node: ast.AST, target: str) -> bool:
    parent = src.parent(node)
    return (
        isinstance(parent, ast.Assign)
        and parent.value is node
        and [dotted(t) for t in parent.targets] == [target]
    )


class FsdpParamDtypeDefault(Bf16SitePatch):
    """With no ``mixed_precision`` in the engine config, the FSDP engine wraps the model
    with ``MixedPrecision(param_dtype=torch.bfloat16)``: every forward and backward runs in
    bf16, which a Pascal card emulates at a fraction of fp32's rate (and fp16/fp32 is what
    it has). ``fsdp.yaml`` has no ``mixed_precision`` key, so every role (actor, ref,
    critic) gets bf16 unless each is given ``+...mixed_precision.param_dtype=fp32``. The
    default follows the profile instead; an explicit ``mixed_precision`` still wins, and
    verl's own fp16 path (a ShardedGradScaler when param_dtype is fp16) follows from it.
    """

    name = "fsdp-param-dtype-default"
    description = (
        "with mixed_precision unset, the FSDP engine's param dtype is the profile's compute "
        "dtype instead of bf16 (reduce and buffer dtypes stay fp32)"
    )
    what = "`param_dtype = torch.bfloat16` under `if mixed_precision_config is not None: ... else:`"
    sites = ((FSDP_ENGINE, "FSDPEngine._build_fsdp_module", 1),)

    def shape(self, src: SourceFile, node: ast.AST) -> str | None:
        if not _assigned_to(src, node, "param_dtype"):
            return None
        assign = src.parent(node)
        branch = src.parent(assign)
        test = getattr(branch, "test", None)
        unset_branch = (
            isinstance(branch, ast.If)
            and assign in branch.orelse
            and isinstance(test, ast.Compare)
            and dotted(test.left) == "mixed_precision_config"
            and len(test.ops) == 1
            and isinstance(test.ops[0], ast.IsNot)
            and is_constant(test.comparators[0], None)
        )
        return f"param_dtype = {BF16}" if unset_branch else None


class FsdpAutocastDtypeDefault(Bf16SitePatch):
    """The FSDP engine's autocast dtype before ``_build_fsdp_module`` sets it (and for
    subclasses that never call it): bf16 in ``__init__`` and as ``forward_step``'s getattr
    fallback (``FSDPEngineWithLMHead.forward_step``, which the value-head engine inherits).
    ``forward_step`` skips autocast when the dtype is fp32, so with the profile's fp32 these
    defaults mean no autocast at all, as ``_build_fsdp_module`` does."""

    name = "fsdp-autocast-dtype-default"
    description = (
        "the FSDP engine's default autocast dtype (before/without _build_fsdp_module) is the "
        "profile's compute dtype instead of bf16 (fp32: no autocast)"
    )
    what = (
        "`self._autocast_dtype = torch.bfloat16` or "
        '`getattr(self, "_autocast_dtype", torch.bfloat16)`'
    )
    sites = (
        (FSDP_ENGINE, "FSDPEngine.__init__", 1),
        (FSDP_ENGINE, "FSDPEngineWithLMHead.forward_step", 1),
    )

    def shape(self, src: SourceFile, node: ast.AST) -> str | None:
        if _assigned_to(src, node, "self._autocast_dtype"):
            return f"self._autocast_dtype = {BF16}"
        call = src.parent(node)
        if (
            isinstance(call, ast.Call)
            and dotted(call.func) == "getattr"
            and len(call.args) == 3
            and call.args[2] is node
            and dotted(call.args[0]) == "self"
            and is_constant(call.args[1], "_autocast_dtype")
        ):
            return f'getattr(self, "_autocast_dtype", {BF16})'
        return None


class MergedLoraExportDtype(Bf16SitePatch):
    """With ``lora.merge``, the weights the rollout receives are cast to bf16 on the way
    out; an fp32 rollout then samples from a bf16-rounded copy of the policy it trains.
    They keep the compute dtype instead (fp32: no cast)."""

    name = "merged-lora-export-dtype"
    description = (
        "merged-LoRA weights sent to the rollout are cast to the profile's compute dtype, not bf16"
    )
    what = "`.to(torch.bfloat16, non_blocking=True)` on an exported tensor"
    sites = ((FSDP_ENGINE, "FSDPEngine._merged_lora_per_tensor_param", 1),)

    def shape(self, src: SourceFile, node: ast.AST) -> str | None:
        call = src.parent(node)
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "to"
            and call.args == [node]
        ):
            return f".to({BF16}, ...)"
        return None


class HfConfigAttnDefault(SitePatch):
    """``HFModelConfig`` builds every role's HF config (actor, ref, critic, reward model
    and the rollout's model config) with ``attn_implementation`` from ``override_config``,
    default ``flash_attention_2``, which needs flash-attn and CC 8.0. The default follows
    the profile; ``override_config.attn_implementation`` still wins."""

    name = "hf-config-attn-default"
    description = (
        "HFModelConfig's attn_implementation default (when override_config has none) follows "
        'the profile instead of "flash_attention_2"'
    )
    versions = VERSIONS
    what = 'self.override_config.get("attn_implementation", "flash_attention_2")'
    sites = ((MODEL_CONFIG, "HFModelConfig.__post_init__", 1),)
    NEW = f"{COMPAT_ALIAS}.attn_implementation()"

    @staticmethod
    def _gets(src: SourceFile, scope: str) -> list[ast.Call]:
        return [
            c
            for c in src.in_scope(scope, ast.Call)
            if dotted(c.func) == "self.override_config.get"
            and len(c.args) == 2
            and not c.keywords
            and is_constant(c.args[0], "attn_implementation")
        ]

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [c for c in self._gets(src, scope) if is_constant(c.args[1], "flash_attention_2")]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [c for c in self._gets(src, scope) if _compat_call(c.args[1], "attn_implementation")]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        start, end = src.span(node.args[1])
        return (Edit(start, end, self.NEW),), (
            f'override_config.get("attn_implementation", "flash_attention_2") -> '
            f'override_config.get("attn_implementation", {self.NEW})'
        )

    def verify(self, src: SourceFile, options: Options, changes: list[Change]) -> None:
        super().verify(src, options, changes)
        for scope, _ in self._scopes(src.rel):
            if any(is_constant(n, "flash_attention_2") for n in src.in_scope(scope, ast.Constant)):
                raise VerifyFailed(f"{scope}: still names flash_attention_2")


class ValueheadAttnImplementation(verl_0_5_0.AttnImplementation):
    """The critic's value-head model is loaded with ``attn_implementation=
    "flash_attention_2"`` passed over the config, so no override reaches it (and without
    flash-attn the token-classification load fails into the trl fallback, which passes it
    again)."""

    description = (
        "the critic's value-head loading passes the profile's attention, not flash_attention_2"
    )
    versions = VERSIONS
    # AutoModelForTokenClassification, then the trl fallback's base model.
    sites = ((MODEL_UTILS, "load_valuehead_model", 2),)


class PaddingHelpersFallback(verl_0_5_0.FlashAttnImportGuard):
    """verl's remove-padding helpers (``verl/utils/attention_utils.py``) import
    ``flash_attn.bert_padding`` on the first call on anything but an NPU. The legacy PPO
    trainer (``trainer.use_v1=false``, ``ray_trainer.py``) calls them on every batch
    (``left_right_2_no_padding`` in ``_compute_old_log_prob``, ``_compute_ref_log_prob``,
    ``_compute_values``, ``_update_actor``, ``_update_critic``) whatever
    ``use_remove_padding`` says, so without flash-attn its first step fails. The import
    falls back to the compat module's pure-torch helpers."""

    description = (
        "the remove-padding helpers' `from flash_attn.bert_padding import ...` falls back to "
        "pure-torch helpers in the compat module when flash-attn is absent"
    )
    versions = VERSIONS
    sites = ((ATTENTION_UTILS, "_get_attention_functions", 1),)


PATCHES: tuple[Patch, ...] = (
    FsdpParamDtypeDefault(),
    FsdpAutocastDtypeDefault(),
    MergedLoraExportDtype(),
    HfConfigAttnDefault(),
    ValueheadAttnImplementation(),
    PaddingHelpersFallback(),
)
