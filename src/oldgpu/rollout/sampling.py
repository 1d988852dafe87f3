"""What one ``generate`` call asks for, and what a finished row gives back.

verl's agent loop sends every server the same sampling dict (``temperature``,
``top_p``, ``top_k``, ``repetition_penalty``, ``logprobs``, sometimes ``max_tokens``)
and expects vLLM's semantics back: ``top_k=-1`` means no top-k, ``temperature=0``
means greedy, the response length defaults to what is left of
``prompt_length + response_length`` (never more than ``response_length``), and the
token ids include the EOS token that ended the response. This module decides those
things without torch, so they are tested on their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

COMPLETED = "completed"
ABORTED = "aborted"


@dataclass(frozen=True)
class Limits:
    """The length limits of the rollout config (``actor_rollout_ref.rollout``)."""

    prompt_length: int
    response_length: int
    max_model_len: int


@dataclass(frozen=True)
class Request:
    """One prompt to complete, with its own sampling settings (rows of one batch may
    differ in all of these but ``ignore_eos``, which HF's EOS handling applies to the
    whole batch: it is the batch key)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    repetition_penalty: float = 1.0
    logprobs: bool = False
    ignore_eos: bool = False
    request_id: str = ""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def batch_key(self) -> tuple[Any, ...]:
        return (self.ignore_eos,)


@dataclass
class Generated:
    """A finished row: the response's token ids (EOS included when it stopped there),
    one log-prob per token (empty unless asked for) and why it stopped."""

    token_ids: list[int]
    log_probs: list[float] = field(default_factory=list)
    stop_reason: str = COMPLETED


def _token_ids(prompt_ids: Any) -> tuple[int, ...]:
    # The agent loop passes a list; numpy arrays and tensors have tolist().
    if hasattr(prompt_ids, "tolist"):
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, str):
        raise TypeError("prompt_ids must be token ids, not text (skip_tokenizer_init is assumed)")
    return tuple(int(t) for t in prompt_ids)


def max_new_tokens(n_prompt: int, params: Mapping[str, Any], limits: Limits) -> int:
    """The response budget, as vLLM's server decides it in verl 0.9.0: an explicit
    ``max_tokens`` (or SGLang's ``max_new_tokens``) wins, else what is left of
    ``prompt_length + response_length`` capped at ``response_length``; always at least 1
    and never past ``max_model_len``."""
    room = limits.max_model_len - n_prompt
    if room < 1:
        raise ValueError(
            f"prompt of {n_prompt} tokens leaves no room to generate within max_model_len "
            f"{limits.max_model_len}"
        )
    if params.get("max_tokens") is not None:
        wanted = int(params["max_tokens"])
    elif params.get("max_new_tokens") is not None:
        wanted = int(params["max_new_tokens"])
    else:
        wanted = min(
            limits.response_length, limits.prompt_length + limits.response_length - n_prompt
        )
    return max(1, min(wanted, room))


def make_request(
    prompt_ids: Any,
    params: Mapping[str, Any],
    limits: Limits,
    *,
    request_id: str = "",
    default_repetition_penalty: float = 1.0,
    default_ignore_eos: bool = False,
) -> Request:
    """verl's sampling dict -> a ``Request``. Unknown keys are ignored (vLLM-only knobs
    such as ``priority`` or ``seed`` have no meaning here)."""
    ids = _token_ids(prompt_ids)
    if not ids:
        raise ValueError("empty prompt")
    temperature = float(params.get("temperature", 1.0) or 0.0)
    top_k = params.get("top_k", 0)
    top_k = 0 if top_k is None or int(top_k) < 0 else int(top_k)
    top_p = params.get("top_p", 1.0)
    top_p = 1.0 if top_p is None else float(top_p)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p}: expected 0 < top_p <= 1")
    penalty = params.get("repetition_penalty")
    penalty = default_repetition_penalty if penalty is None else float(penalty)
    if penalty <= 0:
        raise ValueError(f"repetition_penalty={penalty}: expected > 0")
    ignore_eos = params.get("ignore_eos")
    return Request(
        prompt_ids=ids,
        max_tokens=max_new_tokens(len(ids), params, limits),
        temperature=max(temperature, 0.0),
        top_p=top_p,
        top_k=top_k,
        repetition_penalty=penalty,
        logprobs=bool(params.get("logprobs", False)),
        ignore_eos=default_ignore_eos if ignore_eos is None else bool(ignore_eos),
        request_id=request_id,
    )


def finish_row(
    tokens: Sequence[int],
    log_probs: Sequence[float] | None,
    request: Request,
    eos_ids: Iterable[int],
    *,
    aborted: bool = False,
) -> Generated:
    """A row of the batch's output -> the request's answer: cut after the first EOS
    (kept, as vLLM keeps it: verl trains on it) unless ``ignore_eos``, then at the row's
    own ``max_tokens`` (the batch ran to the longest budget in it). Tokens after the EOS
    are the padding HF writes for finished rows."""
    eos = set(eos_ids)
    end = min(len(tokens), request.max_tokens)
    # A row that reached its EOS or its budget before an abort is complete all the same.
    done = end == request.max_tokens
    if not request.ignore_eos:
        for i, tok in enumerate(tokens[:end]):
            if tok in eos:
                end, done = i + 1, True
                break
    lps = [float(x) for x in log_probs[:end]] if (request.logprobs and log_probs) else []
    return Generated(
        token_ids=[int(t) for t in tokens[:end]],
        log_probs=lps,
        stop_reason=ABORTED if aborted and not done else COMPLETED,
    )
