# --- the logits of the response, and their log-probs and entropy by rows ---
# ``oldgpu patch`` appends this to verl/utils/oldgpu_compat.py for every profile; the
# sites of verl_0_5_0/logits.py call it. verl 0.5.0's padded path computes the logits of
# every position (prompt + response) and keeps the response's: half the lm_head's work
# and bytes thrown away (on a P40, fp32 FLOPs at 12 TFLOPS), and the log-probs' and the
# entropy's temporaries are each a micro batch's response logits long. Those set the
# largest micro batch that fits. Here the model computes the response + 1 positions
# (HF's logits_to_keep), and the log-probs and the entropy go ENTROPY_ROWS tokens at a
# time (the same formulas; the log-probs' backward recomputes a chunk's softmax).
# OLDGPU_RESPONSE_LOGITS=off runs verl's own code instead (the baseline of the bench;
# the planner counts these savings, so its micro batches may not fit with it off).
# No ``from __future__`` here: this text is not at the top of the module it lands in.

import inspect
import os

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as _FSDP

ENV_RESPONSE_LOGITS = "OLDGPU_RESPONSE_LOGITS"
ENTROPY_ROWS = 256


def response_logits_on() -> bool:
    """False when $OLDGPU_RESPONSE_LOGITS says off (0, off, false, no): verl's own code."""
    value = os.environ.get(ENV_RESPONSE_LOGITS, "").strip().lower()
    return value not in ("0", "off", "false", "no")


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """verl 0.5.0's entropy_from_logits, as it is written there."""
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def _chunks(t):
    """Views of ENTROPY_ROWS tokens of each sequence of (batch, tokens, ...)."""
    return [c for seq in t.unbind(0) for c in seq.split(ENTROPY_ROWS)]


def entropy_by_rows(logits):
    """verl's entropy_from_logits, in fp32, ENTROPY_ROWS rows (tokens) at a time: its
    softmax, logsumexp and product are a chunk long, not a micro batch's response."""
    if not response_logits_on():
        return _entropy(logits)
    if logits.numel() // logits.shape[-1] <= ENTROPY_ROWS:
        return _entropy(logits.float())
    # Views only: verl hands over the response slice of (batch, sequence, vocab) logits,
    # which no reshape can flatten without copying all of it.
    chunks = _chunks(logits) if logits.dim() == 3 else logits.split(ENTROPY_ROWS)
    parts = [_entropy(chunk.float()) for chunk in chunks]
    return torch.cat(parts).view(logits.shape[:-1])


def response_logits_only(actor, response_length: int) -> dict:
    """Keyword arguments for the actor's model call: ``logits_to_keep`` (the last
    response_length + 1 positions: verl's slice ``[:, -response_length - 1 : -1]``
    then takes the same rows) where the model's forward has that parameter (HF causal
    LMs since transformers 4.50) and verl's fused kernels are off; otherwise none (the
    model computes every position, as verl has it)."""
    if not response_logits_on() or getattr(actor, "use_fused_kernels", False):
        return {}
    module = getattr(actor, "actor_module", None)
    while isinstance(module, _FSDP):
        module = module.module
    base = getattr(module, "get_base_model", None)  # PEFT: the HF model inside
    if callable(base):
        module = base()
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"logits_to_keep": response_length + 1} if "logits_to_keep" in params else {}


class _LogprobsByRows(torch.autograd.Function):
    """log_softmax(logits)[label] in fp32, ENTROPY_ROWS tokens at a time; saves the logits
    (alive anyway) and the logsumexp, and recomputes each chunk's softmax for the
    backward, which it writes in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits, labels):
        out = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for x, lab, o, s in zip(
            _chunks(logits), _chunks(labels), _chunks(out), _chunks(lse), strict=True
        ):
            x = x.float()
            s.copy_(torch.logsumexp(x, dim=-1))
            o.copy_(x.gather(-1, lab.unsqueeze(-1)).squeeze(-1) - s)
        ctx.save_for_backward(logits, labels, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for x, lab, s, g, gx in zip(
            _chunks(logits),
            _chunks(labels),
            _chunks(lse),
            _chunks(grad_out),
            _chunks(grad),
            strict=True,
        ):
            # d/dx (x[label] - logsumexp(x)) = onehot(label) - softmax(x)
            p = x.to(torch.float32, copy=True).sub_(s.unsqueeze(-1)).exp_()
            p.mul_(-g.unsqueeze(-1))
            p.scatter_add_(-1, lab.unsqueeze(-1), g.unsqueeze(-1).float())
            gx.copy_(p)
        return grad, None


def logprobs_by_rows(logits, labels):
    """verl's logprobs_from_logits for the padded path's (batch, response, vocab) logits:
    _LogprobsByRows (no copy of the response logits kept for the backward, no row's
    gradient scattered to the micro batch's size); verl's own when switched off."""
    if not response_logits_on() or logits.dim() != 3:
        from verl.utils.torch_functional import logprobs_from_logits

        return logprobs_from_logits(logits, labels)
    return _LogprobsByRows.apply(logits, labels)
