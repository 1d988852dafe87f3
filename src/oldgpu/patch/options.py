"""What a patch run is for: the compute dtype, the attention implementation and the
device, from flags or from an oldgpu profile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oldgpu.output import EngineError

COMPUTE_DTYPES = ("fp32", "fp16", "bf16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
DEVICES = ("cuda", "cpu")
PROFILE_KEYS = ("compute_dtype", "attn_implementation", "device")  # of profile's patch_options
# Pascal first: no bf16, no FlashAttention-2; PyTorch's SDPA runs on sm_50+.
DEFAULT_COMPUTE_DTYPE = "fp32"
DEFAULT_ATTN_IMPLEMENTATION = "sdpa"


@dataclass(frozen=True)
class Options:
    compute_dtype: str = DEFAULT_COMPUTE_DTYPE
    attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION
    profile: str | None = None
    # From the profile; lets device-specific patch sets (a cpu one) join via applies().
    device: str = "cuda"

    def __post_init__(self) -> None:
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise EngineError(
                "options-invalid",
                f"compute dtype {self.compute_dtype!r}: "
                f"expected one of {', '.join(COMPUTE_DTYPES)}",
            )
        if self.device not in DEVICES:
            raise EngineError(
                "options-invalid", f"device {self.device!r}: expected one of {', '.join(DEVICES)}"
            )
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise EngineError(
                "options-invalid",
                f"attention implementation {self.attn_implementation!r}: "
                f"expected one of {', '.join(ATTN_IMPLEMENTATIONS)}",
            )

    def as_dict(self) -> dict[str, Any]:
        return {
            "compute_dtype": self.compute_dtype,
            "attn_implementation": self.attn_implementation,
            "profile": self.profile,
            "device": self.device,
        }


def profile_options(name: str) -> dict[str, str]:
    """The patch options of a profile: an architecture (``pascal``) or a profile name as
    ``oldgpu profile`` prints it (``pascal-6.1``, ``cpu``)."""
    from oldgpu import profile as profiles

    arch, _, cc = name.partition("-")
    if arch not in profiles.PROFILES:
        raise EngineError(
            "profile-unknown",
            f"no profile {name!r}: expected an architecture ({', '.join(profiles.PROFILES)}) "
            "or a name like pascal-6.1",
        )
    found = profiles.profile_for_arch(arch, cc or None)["patch_options"]
    return {key: str(found[key]) for key in PROFILE_KEYS if found.get(key) is not None}
