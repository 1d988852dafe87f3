# --- a LoRA actor's frozen base stored at 16 bits, computed in fp32 ---
# ``oldgpu patch`` appends this to verl/utils/oldgpu_compat.py for every profile; the
# sites of verl_0_5_0/base16.py and verl_0_9_0/base16.py call it. A job's base_dtype
# (bf16 or fp16) is verl's actor ``fsdp_config.model_dtype``: the weights are loaded and
# kept at 16 bits, and FSDP's MixedPrecision(param_dtype=fp32) upcasts one unit at a time
# just in time for its forward and frees the copy after it (the adapters stay fp32: peft
# upcasts them; on 0.9.0, adapter_cast_dtype keeps them so). Two
# things keep that exact and small: verl's ``module.to(dtype)`` would round the float32
# buffers too (the rotary inv_freq: a position's angle drifts), so only the parameters
# move; and the embeddings and the lm_head get FSDP units of their own, since the root
# unit's fp32 copy lives through the whole forward and backward (for a 7B shape, 4.4 GB
# where one lm_head is 2.2 GB and only while the logits are computed), and the HF
# rollout computes with the root's stored 16 bits.
# With an fp32 model_dtype neither changes anything.

import functools

import torch
from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy

_SIXTEEN_BITS = (torch.bfloat16, torch.float16)


def to_model_dtype(module, dtype):
    """``module.to(dtype)``, but a 16-bit dtype leaves the float32 buffers as they are."""
    if dtype not in _SIXTEEN_BITS:
        return module.to(dtype)
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return module


def stores_16bit(module) -> bool:
    """Whether the module's frozen weights are stored at 16 bits (a job's base_dtype)."""
    return any(p.dtype in _SIXTEEN_BITS and not p.requires_grad for p in module.parameters())


def embedding_units(policy, module):
    """verl's FSDP wrap policy, plus a unit for the input embeddings and one for the
    output head when the frozen base is stored at 16 bits. Unchanged without a policy or
    at fp32. Tied ones are untied first (a second frozen copy of the same numbers: neither
    trains under LoRA): the HF rollout generates under ``summon_full_params(recurse=False)``,
    which holds the root unit at its stored 16 bits, so no weight may compute from there."""
    if policy is None or not stores_16bit(module):
        return policy
    inputs, outputs = module.get_input_embeddings(), module.get_output_embeddings()
    if outputs is None:
        return policy
    if outputs.weight is inputs.weight:
        outputs.weight = torch.nn.Parameter(inputs.weight.detach().clone(), requires_grad=False)
    ids = {id(inputs), id(outputs)}
    own = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in ids)
    return functools.partial(_or_policy, policies=[policy, own])


def adapter_cast_dtype(module, engine_config):
    """The dtype verl 0.9.0's LoRA build casts the trainable adapters to ("FSDP requires
    all params in a flat group to share dtype"), or None for no cast (verl_0_9_0/base16.py).

    verl casts them to the frozen base's dtype whenever the two differ: a bf16-stored base
    would then train bf16 adapters, their gradients and Adam. Only a flat group that holds
    both needs it: under FSDP1 (strategy ``fsdp``) the wrap policy verl builds for LoRA
    gives every adapter a unit of its own (``get_fsdp_wrap_policy(is_lora=True)``, with
    ``min_num_params`` 0, its default). So the wrap is dry-run with FSDP1's own recursion
    (the embeddings' units only split groups further) and the cast kept only where some
    unit would mix dtypes: no wrap policy, a size policy, or FSDP2 (verl's cast as ever)."""
    base = next((p.dtype for p in module.parameters() if not p.requires_grad), None)
    if base is None or getattr(engine_config, "strategy", "fsdp") != "fsdp":
        return base
    from torch.distributed.fsdp.wrap import _recursive_wrap
    from verl.utils.fsdp_utils import get_fsdp_wrap_policy

    units = [module]
    policy = get_fsdp_wrap_policy(module=module, config=engine_config.wrap_policy, is_lora=True)
    if policy is not None:  # an identity "wrapper": the tree is left as it was
        _recursive_wrap(
            module,
            auto_wrap_policy=policy,
            wrapper_cls=lambda m, **_: units.append(m) or m,
            ignored_modules=set(),
            ignored_params=set(),
            only_wrap_children=True,
        )
    depth = {id(m): name.count(".") + bool(name) for name, m in module.named_modules()}
    owner = {}  # each parameter's innermost unit: its flat group
    for unit in sorted(units, key=lambda m: depth[id(m)]):
        owner.update({id(p): id(unit) for p in unit.parameters()})
    groups: dict = {}
    for p in module.parameters():
        groups.setdefault(owner[id(p)], set()).add(p.dtype)
    return base if any(len(dtypes) > 1 for dtypes in groups.values()) else None
