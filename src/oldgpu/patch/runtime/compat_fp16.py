# --- fp16 profiles ---
# ``oldgpu patch`` appends this to verl/utils/oldgpu_compat.py for compute dtype fp16
# only; the sites of the fp16 patch set (verl_0_5_0/fp16.py) call it. One FSDP
# ShardedGradScaler per actor/critic object, made on first use, and the HF rollout's
# fp16 copy of the actor. Both act only while the compute dtype is fp16 at run time:
# OLDGPU_COMPUTE_DTYPE=fp32 on an fp16 tree makes every helper a pass-through (the fp32
# baseline runs the same code).
# No ``from __future__`` here: this text is not at the top of the module it lands in.

import contextlib
import copy
import math
import warnings

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as _FSDP
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim.optimizer import _global_optimizer_post_hooks

_SCALER = "_oldgpu_grad_scaler"
_SKIPPED = "_oldgpu_skipped_steps"
_OPTIMIZER = "_oldgpu_optimizer"
# FSDP's and activation checkpointing's wrapper names inside a parameter's path.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


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
    setattr(owner, _OPTIMIZER, optimizer)
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
        _skipped_step_hooks(getattr(owner, _OPTIMIZER, None))
    if scaler.is_enabled():
        scaler.update()


def _skipped_step_hooks(optimizer) -> None:
    """A skipped step never calls optimizer.step(), so torch's global step post-hooks
    miss it; call them, so that observers counting optimizer steps (oldgpu's guard ends
    its per-op check after the first PPO step's count) count every step verl took."""
    if optimizer is None:
        return
    for hook in list(_global_optimizer_post_hooks.values()):
        hook(optimizer, (), {})


def scaler_metrics(owner, metrics: dict, role: str) -> None:
    """``<role>/grad_scale`` and ``<role>/skipped_steps`` (this update's) into metrics."""
    scaler = grad_scaler(owner)
    metrics[f"{role}/grad_scale"] = [float(scaler.get_scale()) if scaler.is_enabled() else 1.0]
    metrics[f"{role}/skipped_steps"] = [getattr(owner, _SKIPPED, 0)]
    setattr(owner, _SKIPPED, 0)


# --- the HF rollout in fp16 ---
# verl 0.5.0's HF rollout generates with the FSDP actor (fp32 weights) under autocast,
# which casts every weight to fp16 again at every decoding step: a V100 reads 6 bytes a
# parameter per token instead of 2. The rollout generates instead with an fp16 copy of
# the actor, cast once per generate_sequences call and dropped after it; training keeps
# the fp32 weights. The copy is the same HF class made from the actor's config without
# initialising weights, then filled from the full parameters (FSDP's summon).


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def fp16_copy(module):
    """An fp16, eval-mode copy of ``module`` (an HF causal LM, bare or in FSDP) on the
    device of its weights; None where there is none to make (a PEFT/LoRA model, not an
    HF model, or its names do not match): the caller generates as before."""
    inner = module.module if isinstance(module, _FSDP) else module
    make = getattr(type(inner), "_from_config", None)
    if make is None or not hasattr(inner, "generate") or hasattr(inner, "peft_config"):
        return None
    from transformers.modeling_utils import no_init_weights

    summon = (
        _FSDP.summon_full_params(module, writeback=False, recurse=True)
        if isinstance(module, _FSDP)
        else contextlib.nullcontext()
    )
    with summon, torch.no_grad():
        params = {_clean_name(n): p for n, p in inner.named_parameters(remove_duplicate=False)}
        buffers = {_clean_name(n): b for n, b in inner.named_buffers(remove_duplicate=False)}
        if not params:
            return None
        device = next(iter(params.values())).device
        with torch.device(device), no_init_weights():
            half = make(inner.config, torch_dtype=torch.float16)
        half.tie_weights()  # HF ties them only when it initialises weights
        targets = dict(half.named_parameters(remove_duplicate=False))
        missing = sorted(set(targets) - set(params))
        if missing:
            warnings.warn(
                f"oldgpu: no fp16 rollout copy ({len(missing)} parameters not found, e.g. "
                f"{missing[0]}); generating under autocast",
                stacklevel=2,
            )
            return None
        for name, target in targets.items():
            target.copy_(params[name])
        for name, target in half.named_buffers(remove_duplicate=False):
            if name in buffers:
                target.copy_(buffers[name])
    half.generation_config = copy.deepcopy(inner.generation_config)
    half.requires_grad_(False)
    half.eval()
    return half


@contextlib.contextmanager
def fp16_rollout(rollout):
    """Around HFRollout.generate_sequences: ``rollout.module`` is an fp16 copy of the
    actor for the call (compute dtype fp16 only), the actor again after it."""
    module = rollout.module
    half = fp16_copy(module) if compute_dtype() == torch.float16 else None  # noqa: F821
    if half is None:
        yield
        return
    rollout.module = half
    try:
        yield
    finally:
        rollout.module = module
        module.train(half.training)  # the mode the rollout leaves its module in
        del half
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the copy's blocks, before the log-prob phases
