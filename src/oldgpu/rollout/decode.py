"""The decode loop: a left-padded batch, one token a step, finished rows dropped.

Our own loop over the model's forward with its KV cache, rather than HF ``generate``:

- a row that ends (its EOS or stop token, its budget) leaves the running batch, its KV
  cache rows with it (``batch_select_indices``), so it stops costing compute while the
  long rows go on (HF ``generate`` keeps feeding finished rows padding to the end);
- every setting is per row (temperature, top-k, top-p, the three penalties, min_tokens,
  stop tokens, ignore_eos, seed), so any requests share a batch;
- the log-prob of each sampled token is that of the distribution it was drawn from
  (``processed_logprobs``, verl's default) or the model's own (``raw_logprobs``),
  gathered per step: nothing ``(rows, vocab, steps)``-sized is kept;
- the top-k/top-p sort of the vocabulary is skipped when no row asks for either (a
  152K-token sort per row per step is a large share of a step on a GPU);
- a row with a ``seed`` draws from its own ``torch.Generator``: its response depends
  on its seed and prompt, not on the rest of the batch. Rows without one draw together
  from torch's global generator with ``torch.multinomial``, as HF's sampling does.

It calls ``model(...)`` only (never ``generate``), so it works on a module the caller
hands in: the rollout's own copy or the trainer's FSDP-wrapped policy.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from oldgpu.rollout.gqa import grouped_decode_attention
from oldgpu.rollout.kv_cache import reserved_cache
from oldgpu.rollout.sampling import Generated, Request, finish_row, stop_ids

PROCESSED = "processed_logprobs"
RAW = "raw_logprobs"

Forward = Callable[..., Any]


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    # FSDP, DDP and torch.compile wrap the HF model; its forward's signature is inside.
    for attr in ("_fsdp_wrapped_module", "module", "_orig_mod"):
        inner = getattr(model, attr, None)
        if isinstance(inner, torch.nn.Module):
            return _inner(inner)
    return model


def forward_module(model: torch.nn.Module) -> torch.nn.Module:
    """What to call: the module itself, except an FSDP1 root whose parameters the caller
    summoned (``summon_full_params``, the colocated rollout's way): the root's own
    forward may not run inside the summon (its post-forward reshards what the summon
    holds), so the module it wraps is called, as HF ``generate`` reached it through
    FSDP's attribute forwarding; its nested FSDP units unshard themselves."""
    state = getattr(model, "training_state", None)
    if getattr(state, "name", None) == "SUMMON_FULL_PARAMS":
        return model.module
    return model


def keeps_last_logits_only(model: torch.nn.Module) -> dict[str, int]:
    """The forward kwarg that computes the last position's logits only (the prefill's
    full ``(rows, prompt, vocab)`` logits would dwarf the KV cache)."""
    params = inspect.signature(_inner(model).forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


class _Rows:
    """The per-row settings of the rows still running, as tensors on the device."""

    def __init__(self, requests: Sequence[Request], eos_ids: Iterable[int], device, vocab: int):
        f32 = torch.float32

        def col(values, dtype=f32):
            return torch.tensor(values, dtype=dtype, device=device)

        self.requests = list(requests)
        self.temperature = col([r.temperature for r in requests])
        self.greedy = self.temperature <= 0
        self.top_k = col([r.top_k for r in requests], torch.long)
        self.top_p = col([r.top_p for r in requests])
        self.penalty = col([r.repetition_penalty for r in requests])
        self.presence = col([r.presence_penalty for r in requests])
        self.frequency = col([r.frequency_penalty for r in requests])
        self.min_tokens = col([r.min_tokens for r in requests], torch.long)
        self.any_penalty = any(r.repetition_penalty != 1.0 for r in requests)
        self.any_counts = any(r.presence_penalty or r.frequency_penalty for r in requests)
        self.any_top_k = any(r.top_k > 0 for r in requests)
        self.any_top_p = any(r.top_p < 1.0 for r in requests)
        self.any_min = any(r.min_tokens > 0 for r in requests)
        self._flags()
        self.ends = [stop_ids(r, eos_ids) for r in requests]
        # (rows, most stop ids) padded with `vocab` (a column past the vocabulary).
        width = max((len(e) for e in self.ends), default=0)
        self.stop_table = torch.full((len(requests), max(width, 1)), vocab, device=device)
        for i, e in enumerate(self.ends):
            if e:
                self.stop_table[i, : len(e)] = col(sorted(e), torch.long)
        self.generators: list[torch.Generator | None] = []
        for r in requests:
            g = None
            if r.seed is not None:
                g = torch.Generator(device=device)
                g.manual_seed(r.seed)
            self.generators.append(g)
        self.seen: torch.Tensor | None = None  # (rows, vocab) bool: prompt and output
        self.counts: torch.Tensor | None = None  # (rows, vocab) output counts

    def _flags(self) -> None:
        # What the rows still running need (recomputed as rows leave).
        self.all_greedy = all(r.greedy for r in self.requests)
        self.any_greedy = any(r.greedy for r in self.requests)
        self.any_temperature = any(not r.greedy and r.temperature != 1.0 for r in self.requests)

    def keep(self, index: torch.Tensor, rows: list[int]) -> None:
        for name in (
            "temperature",
            "greedy",
            "top_k",
            "top_p",
            "penalty",
            "presence",
            "frequency",
            "min_tokens",
            "stop_table",
            "seen",
            "counts",
        ):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, index))
        self.requests = [self.requests[i] for i in rows]
        self.ends = [self.ends[i] for i in rows]
        self.generators = [self.generators[i] for i in rows]
        self._flags()


def _seen_mask(ids: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    # Only real prompt tokens: left-padding is no token the model "saw" (writing the pad
    # columns to an extra column keeps a real pad-token id from being lost or added).
    seen = torch.zeros((ids.shape[0], vocab + 1), dtype=torch.bool, device=ids.device)
    seen.scatter_(1, ids.masked_fill(mask == 0, vocab), True)
    return seen[:, :vocab].contiguous()


def _top_k_top_p(scores: torch.Tensor, rows: _Rows) -> torch.Tensor:
    sorted_scores, order = scores.sort(dim=-1, descending=True)
    vocab = scores.shape[-1]
    ranks = torch.arange(vocab, device=scores.device)[None, :]
    k = torch.where(rows.top_k > 0, rows.top_k, torch.full_like(rows.top_k, vocab))
    sorted_scores = sorted_scores.masked_fill(ranks >= k[:, None], float("-inf"))
    if rows.any_top_p:
        probs = sorted_scores.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (keeps >= 1).
        before = probs.cumsum(dim=-1) - probs
        cut = (before >= rows.top_p[:, None]) & (rows.top_p < 1.0)[:, None]
        sorted_scores = sorted_scores.masked_fill(cut, float("-inf"))
    return torch.full_like(scores, float("-inf")).scatter(1, order, sorted_scores)


def process(logits: torch.Tensor, rows: _Rows, step: int) -> torch.Tensor:
    """The scores each row samples from, in vLLM's order: min_tokens, the penalties,
    temperature (greedy rows keep 1), top-k, top-p."""
    scores = logits
    if rows.any_min:
        suppress = (rows.min_tokens > step)[:, None] & (rows.stop_table < scores.shape[-1])
        if bool(suppress.any()):
            r, c = suppress.nonzero(as_tuple=True)
            scores = scores.clone()
            scores[r, rows.stop_table[r, c]] = float("-inf")
    if rows.any_penalty and rows.seen is not None:
        pen = rows.penalty[:, None]
        penalised = torch.where(scores > 0, scores / pen, scores * pen)
        scores = torch.where(rows.seen, penalised, scores)
    if rows.any_counts and rows.counts is not None:
        counts = rows.counts.to(scores.dtype)
        scores = scores - rows.frequency[:, None] * counts
        scores = scores - rows.presence[:, None] * (counts > 0).to(scores.dtype)
    if rows.any_temperature:  # dividing by 1 is a vocabulary-wide pass for nothing
        temps = torch.where(rows.greedy, torch.ones_like(rows.temperature), rows.temperature)
        scores = scores / temps[:, None]
    if rows.any_top_k or rows.any_top_p:
        scores = _top_k_top_p(scores, rows)
    return scores


def sample(scores: torch.Tensor, rows: _Rows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row: greedy rows their argmax, seeded rows from their own
    generator, the rest from torch's global one (as HF's ``multinomial`` sampling).
    Also the probabilities drawn from (None when every row is greedy)."""
    if rows.all_greedy:
        return scores.argmax(dim=-1), None
    probs = scores.softmax(dim=-1)
    tokens = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
    seeded = [i for i, g in enumerate(rows.generators) if g is not None]
    if len(seeded) < len(rows.generators):
        if seeded:
            plain = [i for i, g in enumerate(rows.generators) if g is None]
            index = torch.tensor(plain, device=scores.device)
            drawn = torch.multinomial(probs.index_select(0, index), 1).squeeze(1)
            tokens[index] = drawn
        else:
            tokens = torch.multinomial(probs, 1).squeeze(1)
    for i in seeded:
        tokens[i] = torch.multinomial(probs[i : i + 1], 1, generator=rows.generators[i])[0, 0]
    if rows.any_greedy:  # (a vocabulary-wide pass: only when some row needs it)
        tokens = torch.where(rows.greedy, scores.argmax(dim=-1), tokens)
    return tokens, probs


def _token_log_probs(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    # log softmax at the sampled tokens only: no second (rows, vocab) tensor. (Not the
    # log of the softmax drawn from: that rounds to ~1e-7, where the trainer's own
    # log_softmax agrees with this to ~1e-9; one more vocabulary-wide read per step.)
    return scores.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(scores, dim=-1)


def left_padded(requests: Sequence[Request], pad: int, device) -> tuple[torch.Tensor, ...]:
    width = max(len(r.prompt_ids) for r in requests)
    ids = torch.full((len(requests), width), pad, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, r in enumerate(requests):
        n = len(r.prompt_ids)
        ids[row, width - n :] = torch.tensor(r.prompt_ids, dtype=torch.long)
        mask[row, width - n :] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    requests: Sequence[Request],
    *,
    pad_token_id: int,
    eos_ids: Iterable[int],
    device: torch.device,
    logprobs_mode: str = PROCESSED,
    should_stop: Callable[[], bool] = lambda: False,
) -> list[Generated]:
    """Generate every request's response (in order)."""
    with grouped_decode_attention():  # one read of each key/value head a step (gqa.py)
        return _decode(model, requests, pad_token_id, eos_ids, device, logprobs_mode, should_stop)


def _decode(model, requests, pad_token_id, eos_ids, device, logprobs_mode, should_stop):
    eos_ids = list(eos_ids)
    model = forward_module(model)
    ids, mask = left_padded(requests, pad_token_id, device)
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    extra = keeps_last_logits_only(model)
    longest = max(r.max_tokens for r in requests)
    # The prompt and the longest response, reserved up front (kv_cache.py: no per-step cat).
    reserved = reserved_cache(_inner(model), ids.shape[1] + longest)
    first = extra if reserved is None else {**extra, "past_key_values": reserved}
    out = model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True, **first)
    cache = out.past_key_values
    logits = out.logits[:, -1, :].float()
    del out
    vocab = logits.shape[-1]
    rows = _Rows(requests, eos_ids, device, vocab)
    if rows.any_penalty:
        rows.seen = _seen_mask(ids, mask, vocab)
    if rows.any_counts:
        rows.counts = torch.zeros((len(requests), vocab), dtype=torch.int32, device=device)
    last = position[:, -1]
    live = list(range(len(requests)))  # the original index of each running row
    tokens: list[list[int]] = [[] for _ in requests]
    lps: list[list[float]] = [[] for _ in requests]
    results: list[Generated | None] = [None] * len(requests)
    raw = logprobs_mode == RAW
    for step in range(longest):
        scores = process(logits, rows, step)
        tok, probs = sample(scores, rows)
        want_lp = any(r.logprobs for r in rows.requests)
        if want_lp:
            lp = _token_log_probs(logits if raw else scores, tok).tolist()
        del probs
        tok_list = tok.tolist()
        stopping = should_stop()
        done: list[int] = []
        for j, orig in enumerate(live):
            tokens[orig].append(tok_list[j])
            if want_lp:
                lps[orig].append(lp[j])
            r = rows.requests[j]
            n = len(tokens[orig])
            ended = tok_list[j] in rows.ends[j] and n >= r.min_tokens
            if ended or n >= r.max_tokens or stopping:
                results[orig] = finish_row(tokens[orig], lps[orig], r, eos_ids, aborted=stopping)
                done.append(j)
        if len(done) == len(live):
            break
        if rows.seen is not None:
            rows.seen[torch.arange(len(live), device=device), tok] = True
        if rows.counts is not None:
            rows.counts[torch.arange(len(live), device=device), tok] += 1
        if done:
            gone = set(done)
            kept = [j for j in range(len(live)) if j not in gone]
            index = torch.tensor(kept, device=device)
            cache.batch_select_indices(index)
            mask, last, tok = (t.index_select(0, index) for t in (mask, last, tok))
            rows.keep(index, kept)
            live = [live[j] for j in kept]
        mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
        last = last + 1
        out = model(
            input_ids=tok[:, None],
            attention_mask=mask,
            position_ids=last[:, None],
            past_key_values=cache,
            use_cache=True,
            **extra,
        )
        cache = out.past_key_values
        logits = out.logits[:, -1, :].float()
        del out
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]
