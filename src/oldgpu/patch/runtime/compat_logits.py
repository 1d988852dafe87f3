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
    keeps = _keeps_logits(getattr(actor, "actor_module", None))
    return {"logits_to_keep": response_length + 1} if keeps else {}


def _keeps_logits(module) -> bool:
    """Whether the HF model inside ``module`` (FSDP- or PEFT-wrapped) takes
    ``logits_to_keep`` (HF causal LMs since transformers 4.50)."""
    while isinstance(module, _FSDP):
        module = module.module
    base = getattr(module, "get_base_model", None)  # PEFT: the HF model inside
    if callable(base):
        module = base()
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False
    return "logits_to_keep" in params


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


# --- verl 0.9.0's model engine (verl_0_9_0/logits.py) ---
# 0.9.0's FSDPEngineWithLMHead pads a micro batch's sequences on the right (prompt,
# response, padding): the responses start at different columns, so no logits_to_keep
# covers only them. response_inputs lays the rows out as 0.5.0's batches are (each prompt
# left-padded to end at one column, its response after it), drops the last column (its
# logits would predict past every sequence) and asks for the last max-response positions;
# response_outputs computes their log-probs and entropy by rows (the helpers above) and
# puts them where verl's own output has them: row i's response token j at position
# prompt_i - 1 + j, all that no_padding_2_padding (every reader of these outputs in the
# PPO path) takes; the prompt's positions are 0. Anything else (remove-padding, fused
# kernels, distillation, sum_pi_squared, multi-modal inputs, the value head, a batch
# without prompts and responses) runs verl's own code.

_LAYOUT = "oldgpu_response_layout"
_VERLS_INPUTS = {"input_ids", "attention_mask", "position_ids"}


def _flag(micro_batch, key: str, default=False):
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)


def _lm_head_outputs(engine) -> bool:
    """The engine's outputs are FSDPEngineWithLMHead's (not a value head's, not another
    subclass's own)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    return type(engine).prepare_model_outputs is FSDPEngineWithLMHead.prepare_model_outputs


def _prompt_response_lengths(micro_batch):
    """Each row's prompt and response lengths by no_padding_2_padding's rule (the positions
    its callers read), or None when the micro batch has no prompts and responses."""
    keys = set(micro_batch.keys())
    if not {"prompts", "responses"} <= keys:
        return None
    prompts, responses = micro_batch["prompts"], micro_batch["responses"]
    if prompts.is_nested:
        return prompts.offsets().diff(), responses.offsets().diff()
    mask = micro_batch["attention_mask"] if "attention_mask" in keys else None
    if mask is None or mask.is_nested:
        return None
    width = prompts.shape[1]
    return mask[:, :width].sum(dim=1), mask[:, width:].sum(dim=1)


def _response_layout_applies(engine, micro_batch, model_inputs) -> bool:
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    no_padding = DatasetPadMode.NO_PADDING
    return (
        response_logits_on()
        and _lm_head_outputs(engine)
        and not _flag(micro_batch, "use_remove_padding", True)
        and not _flag(micro_batch, "use_fused_kernels")
        and _flag(micro_batch, "pad_mode", no_padding) == no_padding
        and not any(
            _flag(micro_batch, key)
            for key in ("calculate_sum_pi_squared", "distillation_use_topk", "distillation_only")
        )
        and set(model_inputs) == _VERLS_INPUTS
        and model_inputs["position_ids"].dim() == 2
        and _keeps_logits(getattr(engine, "module", None))
    )


def response_inputs(engine, micro_batch, prepared):
    """verl 0.9.0's ``prepare_model_inputs(micro_batch)`` result (``prepared``), re-laid
    out so that the model computes the logits of the response positions only (see
    above); ``prepared`` as it is wherever verl's own code must run."""
    model_inputs, output_args = prepared
    if not _response_layout_applies(engine, micro_batch, model_inputs):
        return prepared
    lengths = _prompt_response_lengths(micro_batch)
    if lengths is None:
        return prepared
    input_ids = micro_batch["input_ids"]  # nested: (batch, prompt + response)
    offsets = input_ids.offsets()
    seq = offsets.diff()
    prompt, response = (x.to(device=seq.device, dtype=seq.dtype) for x in lengths)
    if not torch.equal(prompt + response, seq) or bool((prompt < 1).any()):
        return prepared
    max_prompt, max_response = int(prompt.max()), int(response.max())
    if max_response < 1:  # logits_to_keep=0 would mean every position
        return prepared
    width = max_prompt + max_response - 1
    batch = seq.numel()
    rows = torch.repeat_interleave(torch.arange(batch, device=seq.device), seq)
    pos = torch.arange(int(offsets[-1]), device=seq.device) - offsets[rows]
    column = pos + (max_prompt - prompt)[rows]
    kept = column < width  # the last token of the longest responses: predicts nothing read
    ids = input_ids.values()
    pad = _flag(micro_batch, "pad_token_id", 0)
    padded = ids.new_full((batch, width), pad)
    padded[rows[kept], column[kept]] = ids[kept]
    positions = torch.zeros_like(padded)
    positions[rows[kept], column[kept]] = micro_batch["position_ids"].values()[kept].to(padded)
    mask = torch.zeros((batch, width), dtype=torch.int32, device=ids.device)
    mask[rows[kept], column[kept]] = 1
    # the token each kept position predicts: row i's response token j at [i, j]
    answer = pos >= prompt[rows]
    labels = ids.new_zeros((batch, max_response))
    labels[rows[answer], (pos - prompt[rows])[answer]] = ids[answer]
    model_inputs = {
        "input_ids": padded,
        "attention_mask": mask,
        "position_ids": positions,
        "logits_to_keep": max_response,
    }
    output_args = {**output_args, _LAYOUT: (prompt, response, labels)}
    return model_inputs, output_args


def response_outputs(engine, output, output_args, micro_batch, logits_processor_func):
    """verl 0.9.0's ``prepare_model_outputs`` for response_inputs' layout: the log-probs
    (and entropy) of the response positions, by rows, nested over the whole sequences as
    verl's are; verl's own where response_inputs left verl's layout."""
    layout = output_args.get(_LAYOUT)
    if layout is None:
        return engine.prepare_model_outputs(
            output=output,
            output_args=output_args,
            micro_batch=micro_batch,
            logits_processor_func=logits_processor_func,
        )
    from torch.distributed.tensor import DTensor

    prompt, response, labels = layout
    logits = output.logits  # (batch, max response, vocab)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    temperature = output_args["temperature"]
    if not bool((temperature == 1).all()):  # in place, as 0.5.0's verl divides
        logits.div_(temperature.clamp(min=1e-8).view(-1, 1, 1).to(logits.dtype))
    log_probs = logprobs_by_rows(logits, labels)
    cu_seqlens = micro_batch["input_ids"].offsets()
    steps = torch.arange(labels.shape[1], device=labels.device)
    inside = steps < response.unsqueeze(1)
    where = (cu_seqlens[:-1] + prompt - 1).unsqueeze(1) + steps

    def nested(values):
        full = values.new_zeros(int(cu_seqlens[-1]))
        full = full.index_put((where[inside],), values[inside])
        return torch.nested.nested_tensor_from_jagged(full, cu_seqlens)

    model_output = {"log_probs": nested(log_probs)}
    if _flag(micro_batch, "calculate_entropy"):
        if engine.engine_config.entropy_checkpointing:
            entropy = torch.utils.checkpoint.checkpoint(
                entropy_by_rows, logits, use_reentrant=False
            )
        else:
            entropy = entropy_by_rows(logits)
        model_output["entropy"] = nested(entropy)
    return model_output
