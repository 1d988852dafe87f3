"""The patch set for verl 0.5.0: what stops its FSDP PPO path on a pre-Ampere GPU.

Every site is named by file and enclosing class/function and found in the AST; each
patch checks after applying that the site has the new shape and that nothing at it
still names bf16 or FlashAttention-2.
"""

from __future__ import annotations

import ast

from oldgpu.patch.compat_module import COMPAT_ALIAS, COMPAT_MODULE, compat_exports
from oldgpu.patch.options import Options
from oldgpu.patch.sitepatch import Change, Patch, Site, SiteNotFound, SitePatch, VerifyFailed
from oldgpu.patch.source import (
    MODULE_SCOPE,
    Edit,
    SourceFile,
    dotted,
    is_call_to,
    is_constant,
    keyword,
)

VERSIONS = frozenset({"0.5.0"})

DP_ACTOR = "verl/workers/actor/dp_actor.py"
DP_CRITIC = "verl/workers/critic/dp_critic.py"
HF_ROLLOUT = "verl/workers/rollout/hf_rollout.py"
FSDP_WORKERS = "verl/workers/fsdp_workers.py"
MODEL_UTILS = "verl/utils/model.py"
ENGINE_IMPL = "verl/workers/engine/fsdp/engine_impl.py"


def _compat_call(node: ast.AST | None, function: str) -> bool:
    return is_call_to(node, f"{COMPAT_ALIAS}.{function}")


class AutocastComputeDtype(SitePatch):
    name = "autocast-compute-dtype"
    description = (
        "torch.autocast(..., dtype=torch.bfloat16) follows the profile's compute dtype "
        "(autocast disabled for fp32)"
    )
    versions = VERSIONS
    what = "torch.autocast(..., dtype=torch.bfloat16)"
    sites = (
        (DP_ACTOR, "DataParallelPPOActor._forward_micro_batch", 1),
        (DP_CRITIC, "DataParallelPPOCritic._forward_micro_batch", 1),
        (HF_ROLLOUT, "HFRollout._generate_minibatch", 1),
        # The optional model-based reward worker runs inside PPO when reward_model.enable.
        (FSDP_WORKERS, "RewardModelWorker._forward_micro_batch", 1),
        (ENGINE_IMPL, "FSDPEngine._forward_micro_batch", 1),
    )
    NEW = f"dtype={COMPAT_ALIAS}.autocast_dtype(), enabled={COMPAT_ALIAS}.autocast_enabled()"

    @staticmethod
    def _autocasts(src: SourceFile, scope: str) -> list[ast.Call]:
        return [c for c in src.in_scope(scope, ast.Call) if dotted(c.func) == "torch.autocast"]

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        # Any bf16 spelling at an autocast counts as left over (dtype keyword or string).
        return [
            c
            for c in self._autocasts(src, scope)
            if any(
                dotted(n) == "torch.bfloat16"
                or (isinstance(n, ast.Constant) and n.value == "bfloat16")
                for n in ast.walk(c)
            )
        ]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            c
            for c in self._autocasts(src, scope)
            if _compat_call(getattr(keyword(c, "dtype"), "value", None), "autocast_dtype")
            and _compat_call(getattr(keyword(c, "enabled"), "value", None), "autocast_enabled")
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        dtype = keyword(node, "dtype")
        if dtype is None or dotted(dtype.value) != "torch.bfloat16" or keyword(node, "enabled"):
            raise SiteNotFound(
                f"line {node.lineno}: torch.autocast is not in the expected shape "
                "(dtype=torch.bfloat16 and no enabled=)"
            )
        start, end = src.span(dtype)
        return (Edit(start, end, self.NEW),), f"torch.autocast: dtype=torch.bfloat16 -> {self.NEW}"


class AttnImplementation(SitePatch):
    name = "attn-implementation"
    description = 'attn_implementation="flash_attention_2" follows the profile (sdpa/eager/fa2)'
    versions = VERSIONS
    what = 'attn_implementation="flash_attention_2"'
    sites = (
        # Actor and ref model config.
        (FSDP_WORKERS, "ActorRolloutRefWorker._build_model_optimizer", 1),
        # Critic model config (its weights load through utils/model.py below).
        (FSDP_WORKERS, "CriticWorker._build_critic_model_optimizer", 1),
        (FSDP_WORKERS, "RewardModelWorker._build_model", 1),
        # Critic value-head loading: token-classification model, then the trl fallback.
        (MODEL_UTILS, "load_valuehead_model", 2),
        (ENGINE_IMPL, "FSDPEngine._build_model_optimizer", 1),
    )
    NEW = f"{COMPAT_ALIAS}.attn_implementation()"

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            kw
            for kw in src.in_scope(scope, ast.keyword)
            if kw.arg == "attn_implementation"
            and isinstance(kw.value, ast.Constant)
            and kw.value.value == "flash_attention_2"
        ]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            kw
            for kw in src.in_scope(scope, ast.keyword)
            if kw.arg == "attn_implementation" and _compat_call(kw.value, "attn_implementation")
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        start, end = src.span(node.value)
        return (
            Edit(start, end, self.NEW),
        ), f'attn_implementation="flash_attention_2" -> {self.NEW}'

    def verify(self, src: SourceFile, options: Options, changes: list[Change]) -> None:
        super().verify(src, options, changes)
        for scope, _ in self._scopes(src.rel):
            if any(
                isinstance(n, ast.Constant) and n.value == "flash_attention_2"
                for n in src.in_scope(scope, ast.Constant)
            ):
                raise VerifyFailed(f"{scope}: still names flash_attention_2")


class FlashAttnImportGuard(SitePatch):
    name = "flash-attn-import-guard"
    description = (
        "from flash_attn.bert_padding import ... falls back to pure-torch helpers in "
        f"{COMPAT_MODULE} when flash-attn is absent"
    )
    versions = VERSIONS
    uses_compat = False  # the fallback imports the module by its full name
    what = "unguarded `from flash_attn.bert_padding import ...`"
    sites = (
        (DP_ACTOR, MODULE_SCOPE, 1),
        (DP_CRITIC, MODULE_SCOPE, 1),
        (ENGINE_IMPL, MODULE_SCOPE, 1),
        (FSDP_WORKERS, "RewardModelWorker._forward_micro_batch", 1),
    )

    @staticmethod
    def _imports(src: SourceFile, scope: str) -> list[ast.ImportFrom]:
        return [
            n for n in src.in_scope(scope, ast.ImportFrom) if n.module == "flash_attn.bert_padding"
        ]

    @staticmethod
    def _names(node: ast.ImportFrom) -> list[tuple[str, str | None]]:
        return [(a.name, a.asname) for a in node.names]

    def _guarded(self, src: SourceFile, node: ast.ImportFrom) -> bool:
        parent = src.parent(node)
        if not isinstance(parent, ast.Try) or node not in parent.body:
            return False
        for handler in parent.handlers:
            if dotted(handler.type) != "ImportError":
                continue
            for stmt in handler.body:
                if (
                    isinstance(stmt, ast.ImportFrom)
                    and stmt.module == COMPAT_MODULE
                    and self._names(stmt) == self._names(node)
                ):
                    return True
        return False

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [n for n in self._imports(src, scope) if not self._guarded(src, n)]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [n for n in self._imports(src, scope) if self._guarded(src, n)]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        missing = sorted({name for name, _ in self._names(node)} - compat_exports())
        if missing:
            raise SiteNotFound(
                f"line {node.lineno}: imports {', '.join(missing)}, which {COMPAT_MODULE} lacks"
            )
        indent = src.indent(node)
        start = src.line_start(node.lineno)
        end = src.after_line(node.end_lineno)
        _, node_end = src.span(node)
        if src.data[node_end:end].strip() and not src.data[node_end:end].strip().startswith(b"#"):
            raise SiteNotFound(f"line {node.lineno}: the import shares its line with other code")
        original = src.data[start:end].decode("utf-8")
        if not original.endswith("\n"):
            original += "\n"
        body = "".join(
            f"    {line}" if line.strip() else line for line in original.splitlines(True)
        )
        names = ", ".join(
            name if not alias else f"{name} as {alias}" for name, alias in self._names(node)
        )
        text = (
            f"{indent}try:\n"
            f"{body}"
            f"{indent}except ImportError:  # oldgpu: no flash-attn (pre-Ampere GPU): pure torch\n"
            f"{indent}    from {COMPAT_MODULE} import {names}\n"
        )
        return (Edit(start, end, text),), (
            f"flash_attn.bert_padding import guarded: except ImportError -> from {COMPAT_MODULE}"
        )


class RewardModelDtype(SitePatch):
    name = "reward-model-dtype"
    description = "the model-based reward worker loads its weights in the compute dtype, not bf16"
    versions = VERSIONS
    what = "torch.bfloat16"
    sites = ((FSDP_WORKERS, "RewardModelWorker._build_model", 2),)  # torch_dtype=, .to()
    NEW = f"{COMPAT_ALIAS}.compute_dtype()"

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [n for n in src.in_scope(scope, ast.Attribute) if dotted(n) == "torch.bfloat16"]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [n for n in src.in_scope(scope, ast.Call) if _compat_call(n, "compute_dtype")]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        start, end = src.span(node)
        parent = src.parent(node)
        if isinstance(parent, ast.keyword):
            old, new = f"{parent.arg}=torch.bfloat16", f"{parent.arg}={self.NEW}"
        else:
            func = dotted(getattr(parent, "func", None))
            old, new = f"{func}(torch.bfloat16)", f"{func}({self.NEW})"
        return (Edit(start, end, self.NEW),), f"{old} -> {new}"


class HfRolloutOneSequence(SitePatch):
    """verl 0.5.0's HF rollout samples rollout.n² responses per prompt.

    The trainer repeats the generation batch ``rollout.n`` times before it calls the
    rollout (ray_trainer.fit, ``gen_batch.repeat(...)``), and the HF rollout asks
    ``generate`` for ``num_return_sequences=config.n`` on top: with n=2 the batch union
    fails ("Two tensor dict must have identical batch size ... [8] and [16]"). vLLM's
    rollout sets n=1 ("already repeat in ray_trainer"); so does this. An upstream bug,
    not a device one: it joins every profile's set.
    """

    name = "hf-rollout-one-sequence"
    description = (
        "the HF rollout's sampling asks generate for one sequence per prompt "
        "(the trainer already repeated the batch rollout.n times)"
    )
    versions = VERSIONS
    uses_compat = False
    what = '"num_return_sequences": self.config.n'
    sites = ((HF_ROLLOUT, "HFRollout._generate_minibatch", 1),)
    KEY = "num_return_sequences"

    def _entries(self, src: SourceFile, scope: str) -> list[tuple[ast.expr, ast.expr]]:
        """(key, value) of every ``"num_return_sequences": ...`` dict entry in scope."""
        return [
            (k, v)
            for d in src.in_scope(scope, ast.Dict)
            for k, v in zip(d.keys, d.values, strict=True)
            if is_constant(k, self.KEY)
        ]

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [v for _, v in self._entries(src, scope) if dotted(v) == "self.config.n"]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [v for _, v in self._entries(src, scope) if is_constant(v, 1)]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        start, end = src.span(node)
        return (Edit(start, end, "1"),), f'"{self.KEY}": self.config.n -> "{self.KEY}": 1'

    def verify(self, src: SourceFile, options: Options, changes: list[Change]) -> None:
        # The validation branch already says 1, so count every entry, not only ours:
        # none left asking for more than one, and the patched ones among them.
        for scope, count in self._scopes(src.rel):
            if self.old_nodes(src, scope):
                raise VerifyFailed(f"{scope}: {self.what} left after patching")
            entries = self._entries(src, scope)
            other = [v for _, v in entries if not is_constant(v, 1)]
            if other:
                raise VerifyFailed(f"{scope}: {self.KEY} is not 1 at line {other[0].lineno}")
            if len(entries) < count:
                raise VerifyFailed(f"{scope}: expected {count} patched sites")


class HfRolloutLoraWrap(SitePatch):
    """verl 0.5.0 drops the FSDP wrap policy for the HF rollout, LoRA's too.

    ``get_fsdp_wrap_policy(is_lora=True)`` puts every trainable LoRA leaf in an FSDP
    unit of its own, apart from the frozen base weights; for ``rollout.name == "hf"``
    the actor's policy is then set to None (a TODO about a hang with Gemma), so the
    whole model is one flat parameter and FSDP refuses it ("Must flatten tensors with
    uniform `requires_grad` when `use_orig_params=False`"). ``use_orig_params=True``
    would start, but FSDP then keeps gradient memory for the frozen base weights
    too, and ``layered_summon_lora_params`` (the checkpoint's
    lora_adapter/) finds no nested unit and saves an empty adapter. So with LoRA the
    policy stays, as it does for vLLM; without LoRA nothing changes.
    """

    name = "hf-rollout-lora-wrap"
    description = (
        "with LoRA the actor keeps verl's LoRA wrap policy under the HF rollout "
        "(adapters and frozen base weights in separate FSDP units)"
    )
    versions = VERSIONS
    uses_compat = False
    what = '`if self._is_rollout and self.config.rollout.name == "hf":` dropping the wrap policy'
    sites = ((FSDP_WORKERS, "ActorRolloutRefWorker._build_model_optimizer", 1),)
    FLAG = "self._is_lora"

    @staticmethod
    def _drops_policy(node: ast.If) -> bool:
        return any(
            isinstance(s, ast.Assign)
            and [dotted(t) for t in s.targets] == ["auto_wrap_policy"]
            and is_constant(s.value, None)
            for s in node.body
        )

    def _hf_ifs(self, src: SourceFile, scope: str) -> list[ast.If]:
        """``if self._is_rollout and self.config.rollout.name == "hf" [and ...]:`` that
        set ``auto_wrap_policy = None``."""
        found = []
        for node in src.in_scope(scope, ast.If):
            test = node.test
            if not (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And)):
                continue
            first, second = test.values[:2]
            hf = (
                isinstance(second, ast.Compare)
                and dotted(second.left) == "self.config.rollout.name"
                and len(second.comparators) == 1
                and is_constant(second.comparators[0], "hf")
            )
            if dotted(first) == "self._is_rollout" and hf and self._drops_policy(node):
                found.append(node)
        return found

    def _not_lora(self, node: ast.AST) -> bool:
        return (
            isinstance(node, ast.UnaryOp)
            and isinstance(node.op, ast.Not)
            and dotted(node.operand) == self.FLAG
        )

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [n for n in self._hf_ifs(src, scope) if len(n.test.values) == 2]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            n
            for n in self._hf_ifs(src, scope)
            if len(n.test.values) == 3 and self._not_lora(n.test.values[2])
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        # The flag the new condition reads must exist on the worker.
        init = src.definition("ActorRolloutRefWorker.__init__")
        if init is None or not any(
            isinstance(s, ast.Assign) and [dotted(t) for t in s.targets] == [self.FLAG]
            for s in ast.walk(init)
        ):
            raise SiteNotFound(f"ActorRolloutRefWorker.__init__ does not set {self.FLAG}")
        _, end = src.span(node.test)
        text = f" and not {self.FLAG}"
        return (Edit(end, end, text),), f'rollout.name == "hf" -> rollout.name == "hf"{text}'


class HfRolloutParamOffload(Patch):
    """verl 0.5.0's HF rollout never reloads offloaded actor parameters.

    With actor.fsdp_config.param_offload=True, ``summon_full_params`` in the HF rollout
    fails (``Expects tensor to be on the compute device cuda:0, was on cpu``): the vLLM
    and SGLang sharding managers load the actor around generation, the HF one (a bare
    BaseShardingManager) does not. Do what update_actor/compute_log_prob do.
    """

    name = "hf-rollout-param-offload"
    description = (
        "generate_sequences loads the offloaded actor to the GPU before an hf rollout and "
        "offloads it after"
    )
    versions = VERSIONS
    uses_compat = False
    files = (FSDP_WORKERS,)
    scope = "ActorRolloutRefWorker.generate_sequences"
    flag = "oldgpu_reload_actor"
    helpers = ("load_fsdp_model_to_gpu", "offload_fsdp_model_to_cpu", "log_gpu_memory_usage")

    def _function(self, src: SourceFile) -> ast.FunctionDef:
        fn = src.definition(self.scope)
        if not isinstance(fn, ast.FunctionDef):
            raise SiteNotFound(f"no {self.scope}")
        return fn

    @staticmethod
    def _generation_block(fn: ast.FunctionDef) -> tuple[int, ast.With]:
        found = [
            (i, stmt)
            for i, stmt in enumerate(fn.body)
            if isinstance(stmt, ast.With)
            and any(
                dotted(item.context_expr) == "self.rollout_sharding_manager" for item in stmt.items
            )
            and any(
                isinstance(n, ast.Call) and dotted(n.func) == "self.rollout.generate_sequences"
                for n in ast.walk(stmt)
            )
        ]
        if len(found) != 1:
            raise SiteNotFound(
                "expected one `with self.rollout_sharding_manager:` block around "
                f"self.rollout.generate_sequences, found {len(found)}"
            )
        return found[0]

    def plan(self, src: SourceFile, options: Options) -> list[Change]:
        fn = self._function(src)
        _, block = self._generation_block(fn)
        if any(
            isinstance(n, ast.Call) and dotted(n.func) in self.helpers[:2] for n in ast.walk(fn)
        ):
            raise SiteNotFound(f"{self.scope} already loads/offloads the actor (fixed upstream?)")
        imported = {
            alias.asname or alias.name
            for node in src.tree.body
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        missing = [h for h in self.helpers if h not in imported]
        if missing:
            raise SiteNotFound(f"module does not import {', '.join(missing)}")
        indent = src.indent(block)
        before = src.line_start(block.lineno)
        after = src.after_line(block.end_lineno)
        load = (
            f"{indent}# oldgpu: nothing reloads an offloaded actor for the hf rollout\n"
            f'{indent}{self.flag} = self._is_offload_param and self.config.rollout.name == "hf"\n'
            f"{indent}if {self.flag}:\n"
            f"{indent}    load_fsdp_model_to_gpu(self.actor_module_fsdp)\n"
        )
        offload = (
            f"{indent}if {self.flag}:\n"
            f"{indent}    offload_fsdp_model_to_cpu(self.actor_module_fsdp)\n"
            f"{indent}    log_gpu_memory_usage(\n"
            f'{indent}        "After offload actor model during generate_sequences",\n'
            f"{indent}        logger=logger,\n"
            f"{indent}    )\n"
        )
        lead = "" if src.ends_with_newline(block.end_lineno) else "\n"
        site = Site(
            src.rel,
            self.scope,
            block.lineno,
            "load_fsdp_model_to_gpu(self.actor_module_fsdp) before the rollout block and "
            "offload_fsdp_model_to_cpu after it, when param_offload and rollout.name == 'hf'",
        )
        return [Change(site, (Edit(before, before, load), Edit(after, after, lead + offload)))]

    def verify(self, src: SourceFile, options: Options, changes: list[Change]) -> None:
        fn = self._function(src)
        try:
            i, _ = self._generation_block(fn)
        except SiteNotFound as exc:
            raise VerifyFailed(str(exc)) from exc

        def guarded_call(stmt: ast.stmt | None, helper: str) -> bool:
            return (
                isinstance(stmt, ast.If)
                and isinstance(stmt.test, ast.Name)
                and stmt.test.id == self.flag
                and isinstance(stmt.body[0], ast.Expr)
                and is_call_to(stmt.body[0].value, helper, "self.actor_module_fsdp")
            )

        body = fn.body
        flag_set = (
            i >= 2
            and isinstance(body[i - 2], ast.Assign)
            and [dotted(t) for t in body[i - 2].targets] == [self.flag]
        )
        if not (flag_set and guarded_call(body[i - 1], "load_fsdp_model_to_gpu")):
            raise VerifyFailed(
                f"{self.scope}: no guarded load_fsdp_model_to_gpu before the rollout"
            )
        if not (i + 1 < len(body) and guarded_call(body[i + 1], "offload_fsdp_model_to_cpu")):
            raise VerifyFailed(
                f"{self.scope}: no guarded offload_fsdp_model_to_cpu after the rollout"
            )


PATCHES: tuple[Patch, ...] = (
    AutocastComputeDtype(),
    AttnImplementation(),
    FlashAttnImportGuard(),
    RewardModelDtype(),
    HfRolloutParamOffload(),
    HfRolloutOneSequence(),
    HfRolloutLoraWrap(),
)
