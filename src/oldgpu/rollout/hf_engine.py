"""The model behind the Pascal rollout: loading, batched generation, weight updates.

Generation is our own decode loop (``decode``: per-row settings, finished rows dropped,
log-probs of the distribution sampled from) over a batch the batcher bounded by
``max_batch_tokens``. Out of memory, a batch is split in two and each half retried, and
later batches run in chunks below the size that failed; one row that still does not
fit fails with ``RolloutOutOfMemory``, naming its tokens and the budget.

``HFGenerator`` takes a module, not a path: the rollout's own copy (``load_model``) or
a module the caller owns (the trainer's policy). Nothing here imports verl or Ray.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM, GenerationConfig

from oldgpu.rollout.decode import PROCESSED, RAW, decode
from oldgpu.rollout.sampling import Generated, Request, batch_tokens

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

__all__ = ["PROCESSED", "RAW", "HFGenerator", "RolloutOutOfMemory", "load_model"]

# transformers renamed from_pretrained/from_config's torch_dtype= to dtype= in 4.56.
_DTYPE_KW = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def load_model(
    *,
    local_path: str,
    hf_config: Any,
    dummy: bool,
    dtype: torch.dtype,
    attn_implementation: str,
    device: str | torch.device,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """The rollout's own copy of the policy, for inference only.

    ``dummy`` (verl's ``load_format=dummy``, the default in a colocated job): random
    weights from the config, which the trainer's first weight sync overwrites before
    any request is served; anything else reads the checkpoint. Built on the CPU and
    moved, so a real load never holds two copies on the card.
    """
    kwargs = {_DTYPE_KW: dtype, "attn_implementation": attn_implementation}
    if dummy:
        model = AutoModelForCausalLM.from_config(
            hf_config, trust_remote_code=trust_remote_code, **kwargs
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            local_path, trust_remote_code=trust_remote_code, **kwargs
        )
    model.requires_grad_(False)
    model.eval()
    # The checkpoint's generation_config.json (Qwen's has top_k=20, temperature=0.7,
    # repetition_penalty=1.1) would otherwise be merged into every generate call.
    model.generation_config = GenerationConfig()
    return model.to(device)


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OOM error, or the RuntimeError older torch (and some kernels) raise."""
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    if isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class RolloutOutOfMemory(RuntimeError):
    """One row alone does not fit (code ``rollout-out-of-memory``)."""

    code = "rollout-out-of-memory"


@dataclass
class WeightLoad:
    """What one weight update did: tensors copied, names the model lacks, and (after a
    complete update) the model's parameters no tensor reached."""

    loaded: int = 0
    unknown: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


class HFGenerator:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pad_token_id: int,
        eos_token_ids: Iterable[int],
        device: str | torch.device,
        logprobs_mode: str = PROCESSED,
        max_batch_tokens: int | None = None,
    ):
        if logprobs_mode not in (PROCESSED, RAW):
            raise ValueError(f"logprobs_mode={logprobs_mode!r}: expected {PROCESSED} or {RAW}")
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})
        self.device = torch.device(device)
        self.logprobs_mode = logprobs_mode
        self._loaded_ids: set[int] = set()
        # The batcher's budget (reported in errors), and the one an OOM taught us.
        self.max_batch_tokens = max_batch_tokens
        self.tokens_limit: int | None = None
        self.oom_splits = 0

    # -- generation ----------------------------------------------------------------

    def generate(
        self, requests: Sequence[Request], should_stop: Callable[[], bool] = lambda: False
    ) -> list[Generated]:
        """The batch's responses, in order. Runs in chunks of at most ``tokens_limit``
        tokens (unset until an OOM teaches one); a chunk that runs out of memory is split
        in two and each half retried, and the limit drops below it for later batches."""
        if not requests:
            return []
        chunks: list[list[Request]] = [[]]
        for r in requests:
            if (
                chunks[-1]
                and self.tokens_limit
                and (batch_tokens([*chunks[-1], r]) > self.tokens_limit)
            ):
                chunks.append([])
            chunks[-1].append(r)
        out: list[Generated] = []
        for chunk in chunks:
            out.extend(self._generate_or_split(chunk, should_stop, batch_tokens(requests)))
        return out

    def _generate_or_split(
        self, requests: list[Request], should_stop: Callable[[], bool], asked: int
    ) -> list[Generated]:
        try:
            return self._decode(requests, should_stop)
        except BaseException as exc:
            if not is_out_of_memory(exc):
                raise
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        # Out of the except block: the traceback (and the tensors its frames hold) is gone.
        self._free_cache()
        tokens = batch_tokens(requests)
        self.oom_splits += 1
        if len(requests) == 1:
            r = requests[0]
            raise RolloutOutOfMemory(
                f"{RolloutOutOfMemory.code}: one row alone runs out of memory: request "
                f"{r.request_id!r}, {len(r.prompt_ids)} prompt + {r.max_tokens} response tokens "
                f"(the batch asked for {asked} tokens; max_batch_tokens={self.max_batch_tokens}, "
                f"learned limit {self.tokens_limit}): {message}"
            )
        logger.warning(
            "rollout batch of %d rows / %d tokens ran out of memory (%s); splitting it",
            len(requests),
            tokens,
            message,
        )
        self.tokens_limit = min(self.tokens_limit or tokens, max(1, tokens // 2))
        half = len(requests) // 2
        return [
            *self._generate_or_split(requests[:half], should_stop, asked),
            *self._generate_or_split(requests[half:], should_stop, asked),
        ]

    def _decode(self, requests: Sequence[Request], should_stop: Callable[[], bool]):
        started = time.perf_counter()
        out = decode(
            self.model,
            requests,
            pad_token_id=self.pad_token_id,
            eos_ids=self.eos_token_ids,
            device=self.device,
            logprobs_mode=self.logprobs_mode,
            should_stop=should_stop,
        )
        # One line a pass: the bench reads a slow rollout's cause from it (rows, steps,
        # the time a step took), where verl's timing_s/gen gives only the sum.
        seconds = time.perf_counter() - started
        steps = max((len(g.token_ids) for g in out), default=0)
        tokens = sum(len(g.token_ids) for g in out)
        logger.info(
            "rollout pass: %d rows, prompt width %d, %d steps, %d tokens in %.2f s "
            "(%.1f ms a step, %.0f tokens/s)",
            len(requests),
            max(len(r.prompt_ids) for r in requests),
            steps,
            tokens,
            seconds,
            1000 * seconds / max(steps, 1),
            tokens / max(seconds, 1e-9),
        )
        return out

    def _free_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- weights ---------------------------------------------------------------------

    def _targets(self) -> dict[str, torch.Tensor]:
        # Every name a tensor may come under: tied weights answer to both their names.
        found = dict(self.model.named_parameters(remove_duplicate=False))
        for name, buf in self.model.named_buffers(remove_duplicate=False):
            found.setdefault(name, buf)
        return found

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> WeightLoad:
        """Copy the trainer's tensors into the model, in place (names as HF's state dict)."""
        targets = self._targets()
        report = WeightLoad()
        for name, tensor in named:
            target = targets.get(name)
            if target is None:
                report.unknown.append(name)
                continue
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: the trainer sent {tuple(tensor.shape)}, the rollout's model has "
                    f"{tuple(target.shape)}"
                )
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            self._loaded_ids.add(id(target))
            report.loaded += 1
        return report

    def end_weight_update(self) -> list[str]:
        """After a complete update: the parameters no tensor reached (their values are
        still the previous ones, or random in a dummy-loaded model)."""
        missing = [
            name for name, p in self.model.named_parameters() if id(p) not in self._loaded_ids
        ]
        self._loaded_ids = set()
        return missing

    def to(self, device: str | torch.device) -> None:
        """Where the weights live: the device to serve, the CPU while the trainer runs."""
        self.model.to(device)
