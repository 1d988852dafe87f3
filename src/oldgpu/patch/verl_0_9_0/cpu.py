"""The cpu patch set for verl 0.9.0: what stops its FSDP engine on a host without GPU.

0.9.0 asks a platform object for the device, its torch module, the collective backend
and the Ray resource (``verl.plugin.platform``); a cpu platform registered from outside
the tree (``oldgpu.verl_plugin.cpu_platform``, ``VERL_PLATFORM=cpu``) answers those, so
the 0.5.0 set's ``get_nccl_backend``/``get_torch_device``/``ray.init`` rewrites are not
needed here. What a platform cannot answer is patched, for device cpu only
(``oldgpu patch --profile cpu``), on top of the 0.9.0 set:

- the workers' process group asks for ``cpu:gloo,{device}:{backend}``, which on cpu
  reads ``cpu:gloo,cpu:gloo``: torch refuses a device type twice;
- each weight sync moves FSDP1's flat parameters to ``f"{device}:{device_id}"``, which
  on cpu reads ``cpu:cpu``;
- the workers average the loss with ``ReduceOp.AVG``, which gloo refuses before
  torch 2.8;
- FSDP (strategy ``fsdp``) is built with ``sync_module_states=True``, which FSDP refuses
  for modules on the CPU; with it off, no rank may start from meta tensors (every rank
  loads the checkpoint), and the forward-only (ref) model's
  ``CPUOffload(offload_params=True)``, which pins memory, is off too.
"""

from __future__ import annotations

import ast

from oldgpu.patch.compat_module import COMPAT_ALIAS
from oldgpu.patch.sitepatch import SiteNotFound
from oldgpu.patch.source import Edit, SourceFile, dotted, is_call_to, keyword
from oldgpu.patch.verl_0_5_0 import cpu as cpu050
from oldgpu.patch.verl_0_9_0.base import FSDP_ENGINE, VERSIONS

DISTRIBUTED = "verl/utils/distributed.py"
ENGINE_WORKERS = "verl/workers/engine_workers.py"
FSDP_UTILS = "verl/utils/fsdp_utils.py"


class _FStringToCompat(cpu050.CpuSitePatch):
    """An f-string naming a device, at a site of a known shape (``old_nodes``), becomes
    the call ``oldgpu_compat.<HELPER>()``."""

    versions = VERSIONS
    HELPER = ""

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            n for n in src.in_scope(scope, ast.Call) if cpu050._compat_call_with(n, self.HELPER)
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        new = cpu050._compat(self.HELPER)
        start, end = src.span(node)
        return (Edit(start, end, new),), f"{src.text(node)} -> {new}"


class CpuGlooBackendString(_FStringToCompat):
    name = "cpu-gloo-backend-string"
    description = (
        'initialize_global_process_group_ray\'s default backend f"cpu:gloo,{device}:{backend}" '
        'is plain gloo (on cpu it reads "cpu:gloo,cpu:gloo", which torch refuses)'
    )
    what = 'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"'
    sites = ((DISTRIBUTED, "initialize_global_process_group_ray", 1),)
    HELPER = "cpu_dist_backend"

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            n
            for n in src.in_scope(scope, ast.JoinedStr)
            if n.values
            and isinstance(n.values[0], ast.Constant)
            and str(n.values[0].value).startswith("cpu:gloo,")
        ]


class CpuFsdpLoadDevice(_FStringToCompat):
    """``get_per_tensor_param`` (every weight sync with strategy ``fsdp``) calls
    ``load_fsdp_model_to_gpu``, which moves each flat parameter to
    ``torch.device(f"{get_device_name()}:{device_id}")``: ``cpu:cpu`` on the cpu platform
    (its device id is ``cpu``: verl also moves tensors with ``.to(get_device_id())``,
    where an index would mean a GPU), which torch refuses."""

    name = "cpu-fsdp-load-device"
    description = (
        'load_fsdp_model_to_gpu\'s f"{get_device_name()}:{device_id}" is "cpu" on cpu '
        '(it reads "cpu:cpu", which torch refuses)'
    )
    what = 'f"{get_device_name()}:{device_id}"'
    sites = ((FSDP_UTILS, "load_fsdp_model_to_gpu", 1),)
    HELPER = "cpu_device"

    def old_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            n
            for n in src.in_scope(scope, ast.JoinedStr)
            if len(n.values) == 3
            and isinstance(n.values[0], ast.FormattedValue)
            and is_call_to(n.values[0].value, "get_device_name")
            and isinstance(n.values[1], ast.Constant)
            and n.values[1].value == ":"
            and isinstance(n.values[2], ast.FormattedValue)
        ]


class CpuSyncModuleStates(cpu050.CpuSyncModuleStates):
    versions = VERSIONS
    sites = ((FSDP_ENGINE, "FSDPEngine._build_fsdp_module", 1),)


class CpuNoMetaInit(cpu050.CpuNoMetaInit):
    versions = VERSIONS
    sites = ((FSDP_UTILS, "get_init_weight_context_manager", 1),)


class CpuNoParamOffload(cpu050.CpuNoParamOffload):
    description = (
        "the forward-only (ref) model's FSDP CPUOffload(offload_params=True) is off on cpu "
        "(it pins memory, which needs CUDA)"
    )
    versions = VERSIONS
    # `if self.engine_config.forward_only: cpu_offload = CPUOffload(offload_params=True)`
    sites = ((FSDP_ENGINE, "FSDPEngine._build_fsdp_module", 1),)


class CpuLossAllReduce(cpu050.CpuTimingAllReduce):
    """The workers' loss is averaged over the data-parallel group with ``ReduceOp.AVG``,
    which gloo refuses before torch 2.8 (the 0.9.0 lock's torch is 2.7.1): the compat
    module's sum divided by the group's size, the group kept."""

    name = "cpu-loss-all-reduce"
    description = (
        "_postprocess_output's all_reduce(loss, op=ReduceOp.AVG, group=dp_group) is a sum "
        "divided by the group's size (gloo has no AVG before torch 2.8)"
    )
    versions = VERSIONS
    sites = ((ENGINE_WORKERS, "TrainingWorker._postprocess_output", 1),)

    def new_nodes(self, src: SourceFile, scope: str) -> list[ast.AST]:
        return [
            c
            for c in src.in_scope(scope, ast.Call)
            if dotted(c.func) == f"{COMPAT_ALIAS}.all_reduce_avg"
            and len(c.args) == 1
            and [k.arg for k in c.keywords] == ["group"]
        ]

    def rewrite(self, src: SourceFile, node: ast.AST) -> tuple[tuple[Edit, ...], str]:
        group = keyword(node, "group")
        if len(node.args) != 1 or group is None or len(node.keywords) != 2:
            raise SiteNotFound(
                f"line {node.lineno}: all_reduce is not in the expected shape "
                "(tensor, op=AVG, group=...)"
            )
        tensor, group_text = src.text(node.args[0]), src.text(group.value)
        new = f"{COMPAT_ALIAS}.all_reduce_avg({tensor}, group={group_text})"
        start, end = src.span(node)
        return (Edit(start, end, new),), f"all_reduce({tensor}, op=ReduceOp.AVG, ...) -> {new}"


PATCHES: tuple[cpu050.CpuSitePatch, ...] = (
    CpuGlooBackendString(),
    CpuFsdpLoadDevice(),
    CpuSyncModuleStates(),
    CpuNoMetaInit(),
    CpuNoParamOffload(),
    CpuLossAllReduce(),
)
