"""The model behind the Pascal rollout: loading, batched generation, weight updates.

Generation is HF ``generate`` over a left-padded batch, with the sampling done by our
own last logits processor (HF's temperature/top-k/top-p warpers are switched off):

- each row keeps its own temperature, top-k, top-p and repetition penalty, so the
  requests that arrive together run together whatever their settings;
- the log-prob of each sampled token is taken from the very distribution it was drawn
  from (verl's default ``logprobs_mode=processed_logprobs``; ``raw_logprobs`` takes
  the model's own softmax instead), holding one ``(batch, vocab)`` row of log-probs
  between steps rather than HF's ``output_scores`` (``batch * vocab * steps``: about
  20 GB fp32 for 64 rows of 512 tokens of a 152K vocabulary, more than a P40 has).

Nothing here imports verl or Ray: the server hands in the model config's pieces.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from oldgpu.rollout.sampling import Generated, Request, finish_row

logger = logging.getLogger(__name__)

PROCESSED = "processed_logprobs"
RAW = "raw_logprobs"

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


class _Sampler(LogitsProcessor):
    """The last logits processor: applies each row's settings and records log-probs.

    At step t HF calls it with the ids so far, whose last column is the token sampled
    at step t-1: its log-prob is gathered from the row kept from step t-1. The last
    step's token is gathered by ``finish`` once ``generate`` returns.
    """

    def __init__(self, requests: Sequence[Request], logprobs_mode: str, device: torch.device):
        self.raw = logprobs_mode == RAW
        f32 = torch.float32
        self.temperature = torch.tensor([r.temperature for r in requests], dtype=f32, device=device)
        self.greedy = self.temperature <= 0
        self.top_k = torch.tensor([r.top_k for r in requests], dtype=torch.long, device=device)
        self.top_p = torch.tensor([r.top_p for r in requests], dtype=f32, device=device)
        self.penalty = torch.tensor(
            [r.repetition_penalty for r in requests], dtype=f32, device=device
        )
        self.any_penalty = bool((self.penalty != 1.0).any())
        self.any_top_k = bool((self.top_k > 0).any())
        self.any_top_p = bool((self.top_p < 1.0).any())
        self.any_greedy = bool(self.greedy.any())
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def _gather_prev(self, tokens: torch.Tensor) -> None:
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, tokens[:, None]).squeeze(1).float().cpu())
            self.prev = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._gather_prev(input_ids[:, -1])
        scores = scores.float()
        raw_lp = torch.log_softmax(scores, dim=-1) if self.raw else None
        if self.any_penalty:
            # As HF's and vLLM's repetition penalty: over the prompt and the output so far.
            seen = scores.gather(1, input_ids)
            pen = self.penalty[:, None]
            seen = torch.where(seen < 0, seen * pen, seen / pen)
            scores = scores.scatter(1, input_ids, seen)
        temps = torch.where(self.greedy, torch.ones_like(self.temperature), self.temperature)
        scores = scores / temps[:, None]
        if self.any_top_k or self.any_top_p:
            scores = self._top_k_top_p(scores)
        lp = raw_lp if self.raw else torch.log_softmax(scores, dim=-1)
        if self.any_greedy:
            # Greedy rows: only the argmax survives, so HF's multinomial draws it.
            best = scores.argmax(dim=-1, keepdim=True)
            onehot = torch.full_like(scores, float("-inf")).scatter(1, best, 0.0)
            scores = torch.where(self.greedy[:, None], onehot, scores)
        self.prev = lp
        return scores

    def _top_k_top_p(self, scores: torch.Tensor) -> torch.Tensor:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        vocab = scores.shape[-1]
        ranks = torch.arange(vocab, device=scores.device)[None, :]
        k = torch.where(self.top_k > 0, self.top_k, torch.full_like(self.top_k, vocab))
        drop = ranks >= k[:, None]
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        if self.any_top_p:
            probs = sorted_scores.softmax(dim=-1)
            # Drop a token when the mass before it already reaches top_p (keeps >= 1).
            before = probs.cumsum(dim=-1) - probs
            cut = (before >= self.top_p[:, None]) & (self.top_p < 1.0)[:, None]
            sorted_scores = sorted_scores.masked_fill(cut, float("-inf"))
        return torch.full_like(scores, float("-inf")).scatter(1, order, sorted_scores)

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(batch, steps) log-probs of the sampled tokens, on the CPU."""
        self._gather_prev(sequences[:, -1])
        if not self.steps:
            return torch.zeros(sequences.shape[0], 0)
        return torch.stack(self.steps, dim=1)


class _StopOnAbort(StoppingCriteria):
    def __init__(self, should_stop: Callable[[], bool]):
        self.should_stop = should_stop
        self.stopped = False

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        stop = self.should_stop()
        self.stopped = self.stopped or stop
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


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
    ):
        if logprobs_mode not in (PROCESSED, RAW):
            raise ValueError(f"logprobs_mode={logprobs_mode!r}: expected {PROCESSED} or {RAW}")
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})
        self.device = torch.device(device)
        self.logprobs_mode = logprobs_mode
        self._loaded_ids: set[int] = set()

    # -- generation ----------------------------------------------------------------

    def _left_padded(self, requests: Sequence[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, r in enumerate(requests):
            n = len(r.prompt_ids)
            ids[row, width - n :] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[row, width - n :] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.no_grad()
    def generate(
        self, requests: Sequence[Request], should_stop: Callable[[], bool] = lambda: False
    ) -> list[Generated]:
        """One ``generate`` over the batch (every row the same ``ignore_eos``)."""
        if not requests:
            return []
        if len({r.batch_key for r in requests}) != 1:
            raise ValueError("one batch, one batch key (ignore_eos)")
        input_ids, attention_mask = self._left_padded(requests)
        sampler = _Sampler(requests, self.logprobs_mode, self.device)
        abort = _StopOnAbort(should_stop)
        ignore_eos = requests[0].ignore_eos
        config = GenerationConfig(
            do_sample=True,  # our sampler decides; greedy rows get a one-hot distribution
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_beams=1,
            max_new_tokens=max(r.max_tokens for r in requests),
            eos_token_id=None if ignore_eos else list(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )
        sequences = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            logits_processor=LogitsProcessorList([sampler]),
            stopping_criteria=StoppingCriteriaList([abort]),
        )
        new = sequences[:, input_ids.shape[1] :].cpu()
        log_probs = sampler.finish(sequences).cpu()
        return [
            finish_row(
                new[row].tolist(),
                log_probs[row].tolist(),
                r,
                self.eos_token_ids,
                aborted=abort.stopped,
            )
            for row, r in enumerate(requests)
        ]

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
