# --- fp16 profiles ---
# ``oldgpu patch`` appends this to verl/utils/oldgpu_compat.py for compute dtype fp16
# only; the sites of the fp16 patch set (verl_0_5_0_fp16.py) call it. One FSDP
# ShardedGradScaler per actor/critic object, made on first use. The scaler is enabled
# only while the compute dtype is fp16 at run time: OLDGPU_COMPUTE_DTYPE=fp32 on an
# fp16 tree makes every helper a pass-through (the fp32 baseline runs the same code).
# No ``from __future__`` here: this text is not at the top of the module it lands in.

import math

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

_SCALER = "_oldgpu_grad_scaler"
_SKIPPED = "_oldgpu_skipped_steps"


def grad_scaler(owner, device_type: str = "cuda") -> ShardedGradScaler:
    """The scaler of ``owner`` (a verl actor or critic), made on first use."""
    scaler = getattr(owner, _SCALER, None)
    if scaler is None:
        # compute_dtype() is compat.py's, above this text in the module.
        enabled = compute_dtype() == torch.float16  # noqa: F821
        scaler = ShardedGradScaler(device=device_type, enabled=enabled)
        setattr(owner, _SCALER, scaler)
        setattr(owner, _SKIPPED, 0)
    return scaler


def _device_type(optimizer) -> str:
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device.type
    return "cuda"


def scale_loss(owner, loss: torch.Tensor) -> torch.Tensor:
    """The loss times the scale, to call backward on (the loss itself when disabled)."""
    return grad_scaler(owner, loss.device.type).scale(loss)


def unscale_grads(owner, optimizer) -> None:
    """Divide the grads by the scale before they are clipped, and note inf/nan."""
    grad_scaler(owner, _device_type(optimizer)).unscale_(optimizer)


def scaler_step(owner, optimizer) -> None:
    """optimizer.step(), skipped when the unscaled grads held inf/nan."""
    grad_scaler(owner, _device_type(optimizer)).step(optimizer)


def scaler_update(owner, grad_norm) -> None:
    """After each optimizer step (taken or skipped): count a skip and update the scale
    (halved after inf/nan, doubled after growth_interval clean steps)."""
    scaler = grad_scaler(owner)
    if not math.isfinite(float(grad_norm)):
        setattr(owner, _SKIPPED, getattr(owner, _SKIPPED, 0) + 1)
    if scaler.is_enabled():
        scaler.update()


def scaler_metrics(owner, metrics: dict, role: str) -> None:
    """``<role>/grad_scale`` and ``<role>/skipped_steps`` (this update's) into metrics."""
    scaler = grad_scaler(owner)
    metrics[f"{role}/grad_scale"] = [float(scaler.get_scale()) if scaler.is_enabled() else 1.0]
    metrics[f"{role}/skipped_steps"] = [getattr(owner, _SKIPPED, 0)]
    setattr(owner, _SKIPPED, 0)
