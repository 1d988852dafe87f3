"""The decode step's grouped attention (rollout/gqa.py) against transformers' own SDPA
path, which copies each key/value head to its query heads: the same numbers, the stock
function back after the decode, and every other call left to the stock function."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_rollout_hf_engine import PAD, PROMPTS, req, tiny_model  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from oldgpu.rollout import decode as decode_mod  # noqa: E402
from oldgpu.rollout import gqa  # noqa: E402


class _Module(torch.nn.Module):
    num_key_value_groups = 7
    is_causal = True


def _inputs(rows=5, kv_heads=2, groups=7, length=23, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, kv_heads * groups, 1, dim, generator=g)
    k = torch.randn(rows, kv_heads, length, dim, generator=g)
    v = torch.randn(rows, kv_heads, length, dim, generator=g)
    # left padding: row i attends to its last length - 3*i positions
    keep = torch.arange(length)[None, :] >= (3 * torch.arange(rows))[:, None]
    return q, k, v, keep[:, None, None, :]


@pytest.mark.parametrize("form", ["bool", "additive", "none"])
def test_one_query_token_matches_the_copying_sdpa_path(form):
    q, k, v, keep = _inputs()
    mask = {
        "bool": keep,
        "additive": torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min),
        "none": None,
    }[form]
    want, _ = sdpa_attention_forward(_Module(), q, k, v, mask, scaling=0.25)
    got, weights = gqa.wrap(sdpa_attention_forward)(_Module(), q, k, v, mask, scaling=0.25)
    assert weights is None and got.shape == want.shape == (5, 1, 14, 16)
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


def test_everything_but_a_grouped_single_query_goes_to_the_stock_function():
    calls = []

    def stock(module, q, k, v, mask, dropout=0.0, scaling=None, **kw):
        calls.append((q.shape[2], dropout))
        return "stock", None

    wrapped = gqa.wrap(stock)
    q, k, v, keep = _inputs()
    prefill = torch.randn(5, 14, 4, 16)
    assert wrapped(_Module(), prefill, k, v, None)[0] == "stock"  # the prefill
    assert wrapped(_Module(), q, k, v, keep, dropout=0.1)[0] == "stock"  # training
    ungrouped = _Module()
    ungrouped.num_key_value_groups = 1
    assert wrapped(ungrouped, q[:, :2], k, v, keep)[0] == "stock"
    assert calls == [(4, 0.0), (1, 0.1), (1, 0.0)]
    assert isinstance(wrapped(_Module(), q, k, v, keep)[0], torch.Tensor)


def test_the_decode_runs_grouped_and_gives_the_stock_paths_tokens(monkeypatch):
    """The same seeded responses and log-probs as with transformers' own attention, the
    grouped function called on every decode step, and the stock one back afterwards."""
    stock = ALL_ATTENTION_FUNCTIONS["sdpa"]
    model = tiny_model()
    requests = [req(p, 8, seed=7 + i, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    run = dict(pad_token_id=PAD, eos_ids=(), device=torch.device("cpu"))
    seen, biases = [], []
    real, real_bias = gqa.grouped_single_query, gqa.mask_bias
    monkeypatch.setattr(gqa, "grouped_single_query", lambda *a: seen.append(1) or real(*a))
    monkeypatch.setattr(gqa, "mask_bias", lambda *a: biases.append(1) or real_bias(*a))
    grouped = decode_mod.decode(model, requests, **run)
    # 7 decode steps after the prefill, in each of the tiny model's 2 layers; the mask's
    # bias once a step, not once a layer
    assert len(seen) == 7 * 2 and len(biases) == 7
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is stock
    monkeypatch.setattr(decode_mod, "grouped_decode_attention", _stock_context)
    plain = decode_mod.decode(model, requests, **run)
    assert len(seen) == 7 * 2
    for a, b in zip(grouped, plain, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5)


class _stock_context:
    def __enter__(self):
        return False

    def __exit__(self, *exc):
        return False
