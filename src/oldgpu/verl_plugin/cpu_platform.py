"""verl's platform for a host without GPU (``VERL_PLATFORM=cpu``), for CPU proof runs.

verl 0.9.0 asks one platform object (``verl.plugin.platform``) for the device name, the
torch device module, the collective backend and the Ray resource; it ships CUDA, NPU
and ROCm only, and falls back to CUDA. What the 0.5.0 cpu patch set rewrote in verl's
source (``get_nccl_backend``, ``get_torch_device``) is a platform here, registered
through verl's own ``PlatformRegistry`` from outside its tree.

- device ``cpu``, collectives over gloo, the torch module a shim with ``torch.cuda``'s
  memory/RNG calls (``oldgpu.patch.runtime.compat_cpu``: the same one the 0.5.0 cpu set uses);
- Ray resource ``GPU``: verl's resource pools count and place GPUs only, so a CPU job
  advertises fake ones (``+ray_kwargs.ray_init.num_gpus=N``); a CPU torch ignores the
  ``CUDA_VISIBLE_DEVICES`` Ray then sets.
- never auto-detected (``is_platform_available`` is False): only ``VERL_PLATFORM=cpu``
  selects it, so a GPU job whose driver runs on a host without GPU keeps verl's CUDA
  fallback.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

NAME = "cpu"


def platform_class() -> type:
    """The platform class (built on first use: it subclasses verl's ``PlatformBase``)."""
    from verl.plugin.platform import PlatformBase

    from oldgpu.patch.runtime.compat_cpu import CPU_DEVICE, CPU_DIST_BACKEND

    class PlatformCPU(PlatformBase):
        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> Any:
            return CPU_DEVICE

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return False

        def current_device(self) -> str:
            # verl moves tensors with .to(get_device_id()): an index would mean cuda:N.
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            CPU_DEVICE.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            CPU_DEVICE.manual_seed_all(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return CPU_DIST_BACKEND

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    return PlatformCPU


def register() -> type:
    from verl.plugin.platform import PlatformRegistry

    return PlatformRegistry.register(platform=NAME)(platform_class())
