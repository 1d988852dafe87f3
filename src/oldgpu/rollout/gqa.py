"""Decode-step attention that reads each key/value head once.

transformers' SDPA path copies every grouped key/value head to all the query heads that
share it (``repeat_kv``) whenever an attention mask is given, and the decode loop always
has one (its rows are left-padded). For one new token per row that copy is the step:
Qwen2.5-0.5B has 14 query heads over 2 key/value heads, so each layer writes the whole
KV cache 7 times over and the kernel reads it back, about 34 cache-sizes of memory
traffic per layer and step against the 2 a grouped read needs. At 448 rows of 512
tokens that is tens of GB a step: most of a P40's 346 GB/s.

Here a single-token query is grouped instead: ``(rows, kv_heads, group, dim)`` against
``(rows, kv_heads, length, dim)``, one batched matmul each way, with the same mask,
scale and fp32 softmax. Anything else (the prefill, a training forward, dropout, a
model without grouped heads) goes to transformers' own function unchanged.

Only while ``decode`` runs (``grouped_decode_attention``): the trainer's forwards keep
the stock function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

IMPLEMENTATION = "sdpa"


def _interface() -> Any | None:
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # a transformers without the interface: nothing to wrap
        return None
    return ALL_ATTENTION_FUNCTIONS


def mask_bias(attention_mask: torch.Tensor | None, rows: int, kv_heads: int, length: int,
              dtype: torch.dtype) -> torch.Tensor | None:  # fmt: skip
    """The mask of one query token as an additive bias, one row per (row, kv head):
    ``(rows * kv_heads, 1, length)``. The same for every layer of a step."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, :, -1:, -length:]  # (rows, 1, 1, length)
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        bias = bias.masked_fill(~mask, float("-inf"))
    else:
        bias = mask.to(dtype)
    return bias.expand(rows, kv_heads, 1, length).reshape(rows * kv_heads, 1, length)


def grouped_single_query(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Attention of one query token per row over grouped key/value heads.

    query ``(rows, heads, 1, dim)``; key, value ``(rows, kv_heads, length, dim)``; the
    mask as ``mask_bias`` gives it. Returns ``(rows, 1, heads, dim)``, as transformers'
    attention functions do. Few ops a layer (the step is host-bound on a fast card):
    one batched matmul each way over ``rows * kv_heads``, the bias added in the first."""
    rows, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    q = query.reshape(rows * kv_heads, heads // kv_heads, dim)
    k = key.reshape(rows * kv_heads, length, dim)
    v = value.reshape(rows * kv_heads, length, value.shape[-1])
    if bias is None:
        scores = torch.bmm(q, k.transpose(1, 2)) * scaling
    else:
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scaling)
    if scores.dtype != torch.float32:
        scores = scores.float()
    probs = scores.softmax(dim=-1)
    if probs.dtype != value.dtype:
        probs = probs.to(value.dtype)
    out = torch.bmm(probs, v)  # (rows * kv_heads, group, dim)
    return out.view(rows, heads, 1, -1).transpose(1, 2)


def wrap(stock: Callable[..., Any]) -> Callable[..., Any]:
    """``stock`` (transformers' SDPA attention function) with single-token grouped
    queries taken by ``grouped_single_query``."""
    step: dict[str, Any] = {"mask": None, "bias": None, "shape": None}

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        groups = getattr(module, "num_key_value_groups", 1)
        if (
            query.shape[2] != 1
            or groups <= 1
            or dropout
            or kwargs.get("output_attentions")
            or query.shape[1] != key.shape[1] * groups
        ):
            kwargs.update(dropout=dropout, scaling=scaling)
            return stock(module, query, key, value, attention_mask, **kwargs)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        rows, kv_heads, length = key.shape[0], key.shape[1], key.shape[2]
        shape = (rows, kv_heads, length, query.dtype)
        # One mask a forward, the same tensor for every layer: its bias once a step.
        if step["mask"] is not attention_mask or step["shape"] != shape:
            bias = mask_bias(attention_mask, rows, kv_heads, length, query.dtype)
            step.update(mask=attention_mask, shape=shape, bias=bias)
        return grouped_single_query(query, key, value, step["bias"], scale), None

    attention.oldgpu_grouped = True  # type: ignore[attr-defined]
    return attention


@contextlib.contextmanager
def grouped_decode_attention() -> Iterator[bool]:
    """Within: transformers' ``sdpa`` attention takes single-token grouped queries the
    grouped way. Yields whether it does (False: no interface, or already wrapped)."""
    functions = _interface()
    if functions is None or IMPLEMENTATION not in functions:
        yield False
        return
    stock = functions[IMPLEMENTATION]
    if getattr(stock, "oldgpu_grouped", False):  # a decode inside a decode's thread
        yield False
        return
    functions[IMPLEMENTATION] = wrap(stock)
    try:
        yield True
    finally:
        functions[IMPLEMENTATION] = stock
