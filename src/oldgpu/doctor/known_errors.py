"""The table of known errors: a message seen in a log -> the check, the cause and the fix.

The seed article's errors and the ones verl meets on old GPUs; ``oldgpu doctor
--explain TEXT`` looks one up.
"""

from __future__ import annotations

import re

# (id, pattern, check, cause, fix); the first match wins, so specific ones come first.
KNOWN_ERRORS: tuple[tuple[str, str, str, str, str], ...] = (
    (
        "no-kernel-image",
        r"no kernel image is available|is not compatible with the current PyTorch installation",
        "torch-build",
        "the torch wheel (or a compiled extension such as flash-attn) has no kernels for this "
        "GPU's compute capability: cu128 and newer torch builds start at sm_75, no Pascal. It is "
        "the wheel's arch list that matters, not the host's CUDA toolkit (nvcc) the seed article "
        "blames",
        "install torch 2.6.0+cu118 (kernels for sm_50..sm_90; sm_61 runs the sm_60 code) from "
        "PyTorch's cu118 wheel index (python_env_torch_index_url) with the project's lock; "
        "`oldgpu doctor --python "
        "VENV/bin/python` shows the build's arch list; pip uninstall flash-attn on pre-Ampere",
    ),
    (
        "vllm-bf16",
        r"Bfloat16 is only supported on GPUs with compute capability of at least 8\.0",
        "bf16",
        "vLLM's worker refuses bf16 below CC 8.0, and vLLM itself needs CC >= 7.0: on Pascal "
        "no vLLM setting helps",
        "use verl's HF rollout (actor_rollout_ref.rollout.name=hf, "
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1) and fp32: oldgpu patch DIR "
        "--profile pascal-6.1 plus the hydra overrides `oldgpu profile` prints; do not sed "
        "bfloat16 out of verl",
    ),
    (
        "flash-attn-ampere",
        r"FlashAttention only supports Ampere GPUs or newer",
        "flash-attn",
        "FlashAttention-2 needs CC >= 8.0, and verl 0.5.0 hard-codes "
        'attn_implementation="flash_attention_2"',
        "oldgpu patch DIR (sdpa attention below CC 8.0, eager the fallback) and "
        "pip uninstall flash-attn",
    ),
    (
        "triton-too-old-gpu",
        r"Triton only supports devices of CUDA Capability >= 7\.0|GPUTooOldForTriton",
        "triton",
        "torch.compile (Inductor) or a Triton kernel (liger, verl's fused kernels, flash-attn's "
        "Triton cross-entropy) ran on a GPU of CC < 7.0, which Triton refuses",
        "actor_rollout_ref.actor.use_torch_compile=False, actor_rollout_ref.model.use_liger=False, "
        "actor_rollout_ref.model.use_fused_kernels=False (the overrides `oldgpu profile` prints) "
        "and pip uninstall flash-attn",
    ),
    (
        "triton-shared-memory",
        r"out of resource: shared memory",
        "flash-attn",
        "a Triton kernel asked for more shared memory per block than the GPU has (48 KiB on "
        "Pascal): on verl that is flash-attn's Triton cross-entropy on the log-prob path, liger "
        "or a compiled kernel. Not a batch-size problem, and max_num_batched_tokens (a vLLM "
        "setting) does nothing with the HF rollout",
        "pip uninstall flash-attn; keep use_torch_compile=False, use_liger=False, "
        "use_fused_kernels=False (`oldgpu profile`'s overrides); oldgpu patch DIR",
    ),
    (
        "triton-compiler-error",
        r"Triton compiler error|CompilationError",
        "triton",
        "a Triton kernel failed to compile: a triton that does not match torch, or any Triton "
        "on CC < 7.0",
        "install the triton torch requires (3.2.0 for torch 2.6.0, not the seed article's "
        "2.3.1; the project's lock has it) and keep Triton off below CC 7.0 "
        "(use_torch_compile=False, use_liger=False, use_fused_kernels=False)",
    ),
    (
        "cuda-out-of-memory",
        r"CUDA out of memory|OutOfMemoryError",
        "gpu-memory",
        "the step needs more GPU memory than is free: fp32 doubles bf16's footprint, and "
        "another process may hold memory",
        "see oldgpu doctor's gpu-memory check; lower ppo_micro_batch_size_per_gpu and the "
        "log-prob micro batches, enable actor_rollout_ref.model.enable_gradient_checkpointing, "
        "offload parameters/optimizer to CPU",
    ),
    (
        "flash-attn-missing",
        r"No module named 'flash_attn'|flash_attn.*not installed|flash_attention_2",
        "verl-patch",
        "unpatched verl imports flash_attn at module level and asks transformers for "
        "flash_attention_2",
        "oldgpu patch DIR (guards the imports, sdpa attention); do not install flash-attn on "
        "pre-Ampere GPUs",
    ),
    (
        "offloaded-params",
        r"Expects tensor to be on the compute device",
        "verl-patch",
        "verl 0.5.0's HF rollout never reloads offloaded actor parameters (param_offload=True)",
        "oldgpu patch DIR (loads the actor to the GPU around generation), or "
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    ),
    (
        "driver-too-old",
        r"CUDA driver version is insufficient|Found no NVIDIA driver|NVIDIA driver on your "
        r"system is too old|couldn't communicate with the NVIDIA driver",
        "driver",
        "no NVIDIA driver is loaded, or it is older than torch's CUDA runtime needs "
        "(CUDA 11.8: >= 520.61.05)",
        "install the driver branch `oldgpu profile` selects (535 on Pascal; proprietary kernel "
        "modules before Turing) with the nvidia_driver role, then reboot",
    ),
    (
        "bf16",
        r"bfloat16|bf16",
        "bf16",
        "a bf16 tensor or autocast on a GPU without bf16 (CC < 8.0): verl 0.5.0 hard-codes "
        "autocast(dtype=torch.bfloat16) and its FSDP mixed precision defaults to bf16",
        "oldgpu patch DIR --profile pascal-6.1 and the fp32 overrides `oldgpu profile` prints "
        "(mixed_precision.param_dtype=fp32, ref model_dtype=fp32); unset "
        "OLDGPU_COMPUTE_DTYPE=bf16",
    ),
)


def explain(message: str) -> dict[str, str] | None:
    """The first known error in ``message``: its check id, cause and fix; None if unknown."""
    for key, pattern, check_id, cause, fix in KNOWN_ERRORS:
        match = re.search(pattern, message, re.IGNORECASE)
        if match:
            return {
                "error": key,
                "check": check_id,
                "matched": match.group(0),
                "cause": cause,
                "fix": fix,
            }
    return None
