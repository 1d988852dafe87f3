# --- cpu profile ---
# ``oldgpu patch`` appends this to verl/utils/oldgpu_compat.py (the rest of which is
# compat.py) for device cpu only; the sites of the cpu patch set (verl_0_5_0/cpu.py)
# call it. A tree patched for cpu runs without a GPU: nothing here asks whether there
# is one (Ray hides the GPUs from the TaskRunner, so asking there would lie anyway).
# No ``from __future__`` here: this text is not at the top of the module it lands in.

import os
import resource

import torch

CPU_DIST_BACKEND = "gloo"


def cpu_dist_backend() -> str:
    """torch.distributed's backend without a GPU (verl 0.5.0 raises for cpu, or asks for
    ``cpu:gloo,cpu:gloo``, which torch refuses: one device type twice)."""
    return CPU_DIST_BACKEND


def sync_module_states() -> bool:
    """FSDP(sync_module_states=...): off; FSDP refuses to broadcast modules that live on
    the CPU. So no rank may rely on it: every rank loads the weights (no meta init)."""
    return False


def fsdp_param_offload() -> None:
    """FSDP(cpu_offload=...) for the ref and reward models: none. The parameters are in
    host memory already, and FSDP's offload pins memory, which needs CUDA."""
    return None


def cpu_device() -> str:
    """The device verl 0.9.0's FSDP1 loader spells ``f"{get_device_name()}:{device_id}"``:
    on cpu that reads ``cpu:cpu`` (the platform's device id is ``cpu``, because verl
    also moves tensors with ``.to(get_device_id())``, where an index means a GPU)."""
    return "cpu"


def all_reduce_avg(tensor: torch.Tensor, group=None) -> None:
    """all_reduce(op=AVG), in place, for backends without AVG (torch 2.6's gloo): a sum
    divided by the world size."""
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=group)
    tensor /= torch.distributed.get_world_size(group)


def ray_num_gpus(config) -> int | None:
    """GPUs the local Ray cluster advertises: one per worker the job asks for.

    verl's resource pools place every worker in a placement group bundle with one GPU
    (``RayResourcePool(use_gpu=True)``) and check the cluster's GPUs first. On a host
    without one, Ray advertising ``trainer.n_gpus_per_node`` fake GPUs lets those
    bundles be placed; the workers then compute on the CPU (torch sees no CUDA device).
    None when joining a running cluster ($RAY_ADDRESS): it has its resources, and
    ray.init refuses resource arguments then.
    """
    if os.environ.get("RAY_ADDRESS"):
        return None
    return int(config.trainer.n_gpus_per_node)


def ray_resources(config) -> dict[str, float] | None:
    """Custom Ray resources the local cluster advertises: ``cpu`` for trainer.device=cpu.

    With trainer.device=cpu, verl's placement group bundles ask for a resource named
    after the device, ``{"CPU": 1, "cpu": 1}``, which no Ray cluster has: the job would
    wait forever. Its resource check counts GPUs still (``ray_num_gpus``).
    """
    if os.environ.get("RAY_ADDRESS") or str(config.trainer.get("device", "cuda")) != "cpu":
        return None
    return {"cpu": float(config.trainer.n_gpus_per_node)}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _mem_info() -> tuple[int, int]:
    """(available, total) host memory, from /proc/meminfo."""
    fields = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                fields[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    total = fields.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return fields.get("MemAvailable", total), total


class _CpuDevice:
    """What verl calls on ``get_torch_device()``, for the CPU.

    ``torch.cpu`` has the stream/event/device-count part of ``torch.cuda``'s API, not
    the memory and RNG part verl also calls; this adds those. The memory figures are the
    process's resident set (verl logs them as GPU memory), the RNG the CPU generator.
    """

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def set_device(device=None) -> None:
        return None

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_allocated(device=None) -> int:
        return _rss_bytes()

    @staticmethod
    def memory_reserved(device=None) -> int:
        return _rss_bytes()

    @staticmethod
    def max_memory_allocated(device=None) -> int:
        return _peak_rss_bytes()

    @staticmethod
    def max_memory_reserved(device=None) -> int:
        return _peak_rss_bytes()

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        return None  # the kernel's peak RSS cannot be reset

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        return _mem_info()

    @staticmethod
    def get_rng_state(device="cpu") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device="cpu") -> None:
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def initial_seed() -> int:
        return torch.initial_seed()


CPU_DEVICE = _CpuDevice()


def torch_device_module(device_name: str):
    """``get_torch_device()``: torch's module for the device, the shim above for cpu."""
    if device_name == "cpu":
        return CPU_DEVICE
    return getattr(torch, device_name)
