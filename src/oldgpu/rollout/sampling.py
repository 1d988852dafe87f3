"""What one ``generate`` call asks for, and what a finished row gives back.

verl 0.9.0's agent loops send every server a sampling dict (``agent_loop.py``:
``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ``logprobs``;
``llm_server.py`` adds ``max_tokens``; ``tool_agent_loop.py`` adds ``stop_token_ids``;
vLLM's server adds ``seed`` under ``full_determinism``; the distillation teacher sends
``prompt_logprobs``) and expects vLLM's semantics back. This module turns that dict
into a ``Request`` without torch: every key is either honoured (``HONOURED``), known
harmless for a token-in/token-out server (``HARMLESS``), or refused by name with
``SamplingUnsupported`` -- never silently dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

COMPLETED = "completed"
ABORTED = "aborted"

HONOURED = frozenset(
    {
        "max_tokens",
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
        "ignore_eos",
        "stop_token_ids",
        "min_tokens",
        "seed",
        "n",  # 1 only
        "stop",  # empty only
        "prompt_logprobs",  # None only
    }
)

# Keys that change only how vLLM renders text, which this server never produces (the
# agent loop is token-in/token-out and decodes itself): accepted and have no effect.
HARMLESS = {
    "skip_special_tokens": "detokenizing: we return token ids only",
    "spaces_between_special_tokens": "detokenizing: we return token ids only",
    "detokenize": "detokenizing: we return token ids only",
    "include_stop_str_in_output": "about stop strings, which are refused when given",
    "output_kind": "streaming mode: we answer once, with the final output",
}


class SamplingUnsupported(ValueError):
    """A sampling setting this server cannot honour (code ``rollout-sampling-unsupported``)."""

    code = "rollout-sampling-unsupported"

    def __init__(self, key: str, value: Any, why: str):
        self.key = key
        super().__init__(f"{self.code}: oldgpu-hf cannot honour {key}={value!r}: {why}")


class SamplingInvalid(ValueError):
    """A sampling setting out of its range (code ``rollout-sampling-invalid``)."""

    code = "rollout-sampling-invalid"

    def __init__(self, key: str, value: Any, expected: str):
        self.key = key
        super().__init__(f"{self.code}: {key}={value!r}: expected {expected}")


@dataclass(frozen=True)
class Limits:
    """The length limits of the rollout config (``actor_rollout_ref.rollout``)."""

    prompt_length: int
    response_length: int
    max_model_len: int


@dataclass(frozen=True)
class Request:
    """One prompt to complete, with its own sampling settings (every setting is per row:
    requests that differ in any of them still run in one batch)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    seed: int | None = None
    request_id: str = ""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def batch_key(self) -> tuple[Any, ...]:
        # Every setting is per row in our decode loop: any requests may share a batch.
        return ()

    @property
    def tokens(self) -> int:
        """The most tokens this row can hold in a batch: its prompt and its budget."""
        return len(self.prompt_ids) + self.max_tokens


def batch_tokens(requests: Sequence[Request]) -> int:
    """What a batch costs at its widest: rows x (longest prompt + largest budget), the
    left-padded shape its KV cache and attention mask reach."""
    if not requests:
        return 0
    width = max(len(r.prompt_ids) for r in requests) + max(r.max_tokens for r in requests)
    return len(requests) * width


@dataclass
class Generated:
    """A finished row: the response's token ids (the EOS or stop token that ended it
    included), one log-prob per token (empty unless asked for) and why it stopped."""

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


def _refuse_unsupported(params: Mapping[str, Any]) -> None:
    for key, value in params.items():
        if key in HONOURED or key in HARMLESS:
            continue
        raise SamplingUnsupported(key, value, "not a setting this server knows")
    n = params.get("n")
    if n is not None and int(n) != 1:
        raise SamplingUnsupported(
            "n", n, "one sample per request (verl's agent loop sends one request per sample)"
        )
    stop = params.get("stop")
    if stop:
        # vLLM matches stop strings on the detokenized text and cuts the text (and the
        # tokens) at the match; doing that right needs incremental detokenizing we do not
        # do. verl's loops send stop_token_ids instead.
        raise SamplingUnsupported("stop", stop, "stop strings; use stop_token_ids")
    if params.get("prompt_logprobs") is not None:
        raise SamplingUnsupported(
            "prompt_logprobs", params["prompt_logprobs"], "prompt log-probs are not computed"
        )


def _number(params: Mapping[str, Any], key: str, default: float) -> float:
    value = params.get(key)
    return default if value is None else float(value)


def _wants_logprobs(value: Any) -> bool:
    # verl sends a bool; vLLM's own int (0 = the sampled token's only) also means yes.
    if isinstance(value, int) and not isinstance(value, bool):
        return value >= 0
    return bool(value)


def make_request(
    prompt_ids: Any,
    params: Mapping[str, Any],
    limits: Limits,
    *,
    request_id: str = "",
    default_repetition_penalty: float = 1.0,
    default_ignore_eos: bool = False,
) -> Request:
    """verl's sampling dict -> a ``Request``, or ``SamplingUnsupported`` naming the key."""
    _refuse_unsupported(params)
    ids = _token_ids(prompt_ids)
    if not ids:
        raise ValueError("empty prompt")
    # None is vLLM's default (1.0), not greedy; 0 is greedy.
    temperature = _number(params, "temperature", 1.0)
    top_k = params.get("top_k")
    top_k = 0 if top_k is None or int(top_k) < 0 else int(top_k)
    top_p = _number(params, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise SamplingInvalid("top_p", top_p, "0 < top_p <= 1")
    penalty = _number(params, "repetition_penalty", default_repetition_penalty)
    if penalty <= 0:
        raise SamplingInvalid("repetition_penalty", penalty, "> 0")
    presence = _number(params, "presence_penalty", 0.0)
    frequency = _number(params, "frequency_penalty", 0.0)
    for key, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2.0 <= value <= 2.0:  # vLLM's range
            raise SamplingInvalid(key, value, "-2 <= value <= 2")
    min_tokens = int(params.get("min_tokens") or 0)
    if min_tokens < 0:
        raise SamplingInvalid("min_tokens", min_tokens, ">= 0")
    seed = params.get("seed")
    ignore_eos = params.get("ignore_eos")
    max_tokens = max_new_tokens(len(ids), params, limits)
    return Request(
        prompt_ids=ids,
        max_tokens=max_tokens,
        temperature=max(temperature, 0.0),
        top_p=top_p,
        top_k=top_k,
        repetition_penalty=penalty,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logprobs=_wants_logprobs(params.get("logprobs")),
        ignore_eos=default_ignore_eos if ignore_eos is None else bool(ignore_eos),
        stop_token_ids=tuple(sorted({int(t) for t in params.get("stop_token_ids") or ()})),
        min_tokens=min(min_tokens, max_tokens),
        seed=None if seed is None else int(seed),
        request_id=request_id,
    )


def stop_ids(request: Request, eos_ids: Iterable[int]) -> frozenset[int]:
    """The tokens that end this row: its stop tokens, and the EOS ids unless
    ``ignore_eos`` (as vLLM: ``ignore_eos`` does not switch off ``stop_token_ids``)."""
    ids = set(request.stop_token_ids)
    if not request.ignore_eos:
        ids.update(int(t) for t in eos_ids)
    return frozenset(ids)


def finish_row(
    tokens: Sequence[int],
    log_probs: Sequence[float] | None,
    request: Request,
    eos_ids: Iterable[int],
    *,
    aborted: bool = False,
) -> Generated:
    """A row's sampled tokens -> the request's answer: cut after the first EOS or stop
    token (kept, as vLLM keeps it: verl trains on it), then at the row's own
    ``max_tokens``. A row stopped by an abort before either is ``aborted``."""
    ends = stop_ids(request, eos_ids)
    end = min(len(tokens), request.max_tokens)
    # A row that reached its stop or its budget before an abort is complete all the same.
    done = end == request.max_tokens
    for i, tok in enumerate(tokens[:end]):
        if tok in ends and i + 1 >= request.min_tokens:
            end, done = i + 1, True
            break
    lps = [float(x) for x in log_probs[:end]] if (request.logprobs and log_probs) else []
    return Generated(
        token_ids=[int(t) for t in tokens[:end]],
        log_probs=lps,
        stop_reason=ABORTED if aborted and not done else COMPLETED,
    )
