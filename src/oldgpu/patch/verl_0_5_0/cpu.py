"""The cpu patch set for verl 0.5.0: what stops its FSDP PPO path on a host without GPU.

These join only for device cpu (``oldgpu patch --profile cpu``), on top of the
dtype/attention set, and only a tree patched for cpu has them: so the sites call the
cpu helpers of ``oldgpu_compat`` unconditionally rather than asking torch at run time
whether there is a GPU (Ray runs the TaskRunner with CUDA_VISIBLE_DEVICES="", so that
question has the wrong answer there even on a GPU host). With them,
``python -m verl.trainer.main_ppo ... trainer.n_gpus_per_node=1 trainer.nnodes=1``
trains on the CPU with no separate ``ray start``.
"""

from __future__ import annotations

import ast

from oldgpu.patch.compat_module import COMPAT_ALIAS
from oldgpu.patch.options import Options
from oldgpu.patch.sitepatch import SiteNotFound, SitePatch
from oldgpu.patch.source import Edit, SourceFile, dotted, is_call_to, keyword
from oldgpu.patch.verl_0_5_0.base import ENGINE_IMPL, FSDP_WORKERS, VERSIONS

DEVICE = "verl/utils/device.py"
FSDP_UTILS = "verl/utils/fsdp_utils.py"
PERFORMANCE = "verl/utils/profiler/performance.py"
MAIN_PPO = "verl/trainer/main_ppo.py"


class CpuSitePatch(SitePatch):
    versions = VERSIONS

    def applies(self, options: Options) -> bool:
        return options.device == "cpu"


def _compat(function: str, *args: str) -> str:
    return f"{COMPAT_ALIAS}.{function}({', '.join(args)})"


def _compat_call_with(node: ast.AST | None, function: str, *args: str) -> bool:
    """``node`` is ``oldgpu_compat.function(*args)``, args given as dotted names."""
    return is_call_to(node, f"{COMPAT_ALIAS}.{function}", *args)


class CpuNcclBackend(CpuSitePatch):
    # PPO's colocated workers initialise torch.distributed in ActorRolloutRefWorker
    # (below); the critic, reward model and new-engine workers call this when they run
    # in a process of their own, and so does initialize_global_process_group.
    name = "cpu-dist-backend"
    description = "get_nccl_backend() returns gloo without a GPU instead of raising"
    what = "`raise RuntimeError(...)` for a device without an nccl backend"
    sites = ((DEVICE, "get_nccl_backend", 1),)
    NEW = _compat("cpu_dist_backend")

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            n
            for n in src.in_scope(scope, ast.Raise)
            if isinstance(n.exc, ast.Call) and dotted(n.exc.func) == "RuntimeError"
        ]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            n
            for n in src.in_scope(scope, ast.Return)
            if _compat_call_with(n.value, "cpu_dist_backend")
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        start, end = src.span(node)
        return (Edit(start, end, f"return {self.NEW}"),), f"raise RuntimeError -> return {self.NEW}"


class CpuGlooBackendString(CpuSitePatch):
    name = "cpu-gloo-backend-string"
    description = (
        'init_process_group(backend=f"cpu:gloo,{device}:{backend}") is plain gloo '
        '(on cpu it reads "cpu:gloo,cpu:gloo", which torch refuses)'
    )
    what = 'backend=f"cpu:gloo,..."'
    sites = ((FSDP_WORKERS, "ActorRolloutRefWorker.__init__", 1),)
    NEW = _compat("cpu_dist_backend")

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            kw
            for kw in src.in_scope(scope, ast.keyword)
            if kw.arg == "backend"
            and isinstance(kw.value, ast.JoinedStr)
            and any(
                isinstance(part, ast.Constant) and str(part.value).startswith("cpu:gloo,")
                for part in kw.value.values
            )
        ]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            kw
            for kw in src.in_scope(scope, ast.keyword)
            if kw.arg == "backend" and _compat_call_with(kw.value, "cpu_dist_backend")
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        start, end = src.span(node.value)
        return (Edit(start, end, self.NEW),), f"backend={src.text(node.value)} -> {self.NEW}"


class CpuTorchDevice(CpuSitePatch):
    name = "cpu-torch-device"
    description = (
        "get_torch_device() on cpu is a shim with torch.cuda's memory, RNG and device API "
        "(torch.cpu lacks memory_allocated, mem_get_info, get_rng_state, ...)"
    )
    what = "getattr(torch, device_name)"
    sites = ((DEVICE, "get_torch_device", 1),)
    NEW = _compat("torch_device_module", "device_name")

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            c
            for c in src.in_scope(scope, ast.Call)
            if dotted(c.func) == "getattr"
            and [dotted(a) for a in c.args] == ["torch", "device_name"]
        ]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            c
            for c in src.in_scope(scope, ast.Call)
            if _compat_call_with(c, "torch_device_module", "device_name")
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        start, end = src.span(node)
        return (Edit(start, end, self.NEW),), f"getattr(torch, device_name) -> {self.NEW}"


class CpuSyncModuleStates(CpuSitePatch):
    name = "cpu-sync-module-states"
    description = (
        "FSDP(sync_module_states=True) is off on cpu: FSDP refuses to broadcast CPU "
        "modules (cpu-no-meta-init has every rank load the weights instead)"
    )
    what = "sync_module_states=True"
    sites = (
        (FSDP_WORKERS, "ActorRolloutRefWorker._build_model_optimizer", 1),
        (FSDP_WORKERS, "CriticWorker._build_critic_model_optimizer", 1),
        (FSDP_WORKERS, "RewardModelWorker._build_model", 1),
        (ENGINE_IMPL, "FSDPEngine._build_model_optimizer", 1),
    )
    NEW = _compat("sync_module_states")

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            kw
            for kw in src.in_scope(scope, ast.keyword)
            if kw.arg == "sync_module_states"
            and isinstance(kw.value, ast.Constant)
            and kw.value.value is True
        ]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            kw
            for kw in src.in_scope(scope, ast.keyword)
            if kw.arg == "sync_module_states" and _compat_call_with(kw.value, "sync_module_states")
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        start, end = src.span(node.value)
        return (Edit(start, end, self.NEW),), f"sync_module_states=True -> {self.NEW}"


class CpuNoMetaInit(CpuSitePatch):
    """Meta-tensor init on ranks != 0 relies on FSDP broadcasting rank 0's weights.

    verl loads the weights on rank 0 only, builds the other ranks' models on the meta
    device and lets FSDP(param_init_fn=init_fn) give them uninitialised storage, which
    sync_module_states=True then overwrites. Without the broadcast (off on cpu, above)
    those ranks would train from garbage: every rank loads the checkpoint instead.
    """

    name = "cpu-no-meta-init"
    description = (
        "get_init_weight_context_manager builds on the meta device only where FSDP "
        "broadcasts rank 0's weights (not on cpu): every rank loads the checkpoint"
    )
    what = "`if use_meta_tensor:`"
    sites = ((FSDP_UTILS, "get_init_weight_context_manager", 1),)
    NEW = f"use_meta_tensor and {_compat('sync_module_states')}"

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            n
            for n in src.in_scope(scope, ast.If)
            if isinstance(n.test, ast.Name) and n.test.id == "use_meta_tensor"
        ]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            n
            for n in src.in_scope(scope, ast.If)
            if isinstance(n.test, ast.BoolOp)
            and isinstance(n.test.op, ast.And)
            and len(n.test.values) == 2
            and dotted(n.test.values[0]) == "use_meta_tensor"
            and _compat_call_with(n.test.values[1], "sync_module_states")
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        start, end = src.span(node.test)
        return (Edit(start, end, self.NEW),), f"if use_meta_tensor: -> if {self.NEW}:"


class CpuNoParamOffload(CpuSitePatch):
    name = "cpu-no-param-offload"
    description = (
        "the ref (and reward) model's FSDP CPUOffload(offload_params=True) is off on cpu "
        "(it pins memory, which needs CUDA)"
    )
    what = "CPUOffload(offload_params=True)"
    sites = (
        # `cpu_offload = None if role == "actor" else CPUOffload(...)`: the ref model.
        (FSDP_WORKERS, "ActorRolloutRefWorker._build_model_optimizer", 1),
        (FSDP_WORKERS, "RewardModelWorker._build_model", 1),
    )
    NEW = _compat("fsdp_param_offload")

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            c
            for c in src.in_scope(scope, ast.Call)
            if dotted(c.func) == "CPUOffload"
            and any(
                kw.arg == "offload_params" and getattr(kw.value, "value", None) is True
                for kw in c.keywords
            )
        ]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            c for c in src.in_scope(scope, ast.Call) if _compat_call_with(c, "fsdp_param_offload")
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        if node.args or len(node.keywords) != 1:
            raise SiteNotFound(
                f"line {node.lineno}: CPUOffload takes more than offload_params=True here"
            )
        start, end = src.span(node)
        return (Edit(start, end, self.NEW),), f"CPUOffload(offload_params=True) -> {self.NEW}"


class CpuTimingAllReduce(CpuSitePatch):
    name = "cpu-timing-all-reduce"
    description = (
        "reduce_timing's all_reduce(op=ReduceOp.AVG) is a sum divided by the world size "
        "(torch 2.6's gloo has no AVG)"
    )
    what = "torch.distributed.all_reduce(..., op=torch.distributed.ReduceOp.AVG)"
    sites = ((PERFORMANCE, "reduce_timing", 1),)

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            c
            for c in src.in_scope(scope, ast.Call)
            if dotted(c.func) in ("torch.distributed.all_reduce", "dist.all_reduce")
            and (dotted(getattr(keyword(c, "op"), "value", None)) or "").endswith("ReduceOp.AVG")
        ]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            c
            for c in src.in_scope(scope, ast.Call)
            if dotted(c.func) == f"{COMPAT_ALIAS}.all_reduce_avg"
            and len(c.args) == 1
            and not c.keywords
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        if len(node.args) != 1 or len(node.keywords) != 1:
            raise SiteNotFound(
                f"line {node.lineno}: all_reduce is not in the expected shape (tensor, op=AVG)"
            )
        tensor = src.text(node.args[0])
        new = _compat("all_reduce_avg", tensor)
        start, end = src.span(node)
        return (Edit(start, end, new),), f"all_reduce({tensor}, op=ReduceOp.AVG) -> {new}"


class CpuRayResources(CpuSitePatch):
    name = "cpu-ray-resources"
    description = (
        "main_ppo's ray.init advertises trainer.n_gpus_per_node GPUs (and, for "
        "trainer.device=cpu, as many `cpu` resources), so verl's placement groups place "
        "on a host without GPU"
    )
    what = "ray.init(...) without num_gpus="
    sites = ((MAIN_PPO, "run_ppo", 1),)
    KEYWORDS = (
        ("num_gpus", _compat("ray_num_gpus", "config")),
        ("resources", _compat("ray_resources", "config")),
    )

    @staticmethod
    def _inits(src: SourceFile, scope: str) -> list[ast.Call]:
        return [c for c in src.in_scope(scope, ast.Call) if dotted(c.func) == "ray.init"]

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [c for c in self._inits(src, scope) if keyword(c, "num_gpus") is None]

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            c
            for c in self._inits(src, scope)
            if all(
                _compat_call_with(getattr(keyword(c, name), "value", None), fn, "config")
                for name, fn in (("num_gpus", "ray_num_gpus"), ("resources", "ray_resources"))
            )
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        if node.args or not node.keywords or keyword(node, "resources") is not None:
            raise SiteNotFound(f"line {node.lineno}: ray.init is not in the expected shape")
        first = node.keywords[0]
        pos = src.offset(first.lineno, first.col_offset)
        prefix = src.data[src.line_start(first.lineno) : pos].decode("utf-8")
        # One keyword per line stays so; an inline call gets inline keywords.
        sep = f"\n{prefix}" if not prefix.strip() else " "
        added = [f"{name}={value}" for name, value in self.KEYWORDS]
        text = "".join(f"{kw},{sep}" for kw in added)
        return (Edit(pos, pos, text),), f"ray.init(...) -> ray.init({', '.join(added)}, ...)"


PATCHES: tuple[SitePatch, ...] = (
    CpuNcclBackend(),
    CpuGlooBackendString(),
    CpuTorchDevice(),
    CpuSyncModuleStates(),
    CpuNoMetaInit(),
    CpuNoParamOffload(),
    CpuTimingAllReduce(),
    CpuRayResources(),
)
