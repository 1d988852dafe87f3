"""The decode loop's reserved KV cache (rollout/kv_cache.py) under transformers 5 (the
0.9.0 lock; test_rollout_verl09.py runs this file in that venv): the same tokens and
log-probs as transformers' own DynamicCache, rows leaving mid-pass, a pass outgrowing
its reservation; and under transformers 4 (the engine's venv) the model's own cache."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_rollout_hf_engine import PAD, PROMPTS, VOCAB, req, tiny_model  # noqa: E402

from oldgpu.rollout import decode as decode_mod  # noqa: E402
from oldgpu.rollout import kv_cache  # noqa: E402

LAYERED = kv_cache._dynamic_layer() is not None
RUN = dict(pad_token_id=PAD, device=torch.device("cpu"))


def _requests():
    # Different budgets and a real EOS: rows leave the running batch at different steps.
    return [req(p, 5 + 3 * i, seed=11 + i) for i, p in enumerate(PROMPTS)]


def _without_reservation(monkeypatch):
    monkeypatch.setattr(decode_mod, "reserved_cache", lambda model, capacity: None)


@pytest.mark.skipif(not LAYERED, reason="transformers 4: no per-layer cache classes")
@pytest.mark.parametrize("capacity_delta", [0, -6])
def test_a_reserved_cache_gives_the_dynamic_caches_tokens(monkeypatch, capacity_delta):
    """capacity_delta -6: the reservation is too small and grows mid-pass."""
    model = tiny_model()
    eos = tuple(range(VOCAB - 20, VOCAB))  # a fifth of the vocabulary: rows end early
    made = []
    real = kv_cache.reserved_cache

    def spy(m, capacity):
        cache = real(m, capacity + capacity_delta)
        made.append(cache)
        return cache

    monkeypatch.setattr(decode_mod, "reserved_cache", spy)
    reserved = decode_mod.decode(model, _requests(), eos_ids=eos, **RUN)
    layers = made[0].layers
    assert len(layers) == 2 and all(type(layer).__name__ == "ReservedLayer" for layer in layers)
    assert all(layer.length > layer.keys.shape[-2] - 1 for layer in layers)
    _without_reservation(monkeypatch)
    plain = decode_mod.decode(model, _requests(), eos_ids=eos, **RUN)
    assert [len(o.token_ids) for o in plain] != [5, 8, 11]  # some row ended on an EOS
    for a, b in zip(reserved, plain, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5)


@pytest.mark.skipif(not LAYERED, reason="transformers 4: no per-layer cache classes")
def test_a_step_writes_one_position_and_hands_out_a_view():
    cache = kv_cache.reserved_cache(tiny_model(), 10)
    layer = cache.layers[0]
    k, v = torch.randn(3, 2, 4, 8), torch.randn(3, 2, 4, 8)
    keys, _ = cache.update(k, v, 0)
    buffer = layer._keys
    assert keys.shape == (3, 2, 4, 8) and torch.equal(keys, k) and buffer.shape[2] == 10
    keys, values = cache.update(k[:, :, :1], v[:, :, :1], 0)
    assert keys.shape[2] == 5 and keys.data_ptr() == buffer.data_ptr()  # no copy
    assert torch.equal(values[:, :, 4], v[:, :, 0])
    cache.layers[0].batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(cache.layers[0].keys[:, :, :4], k[[2, 0]])
    assert cache.get_seq_length(0) == 5


def test_a_model_without_layered_cache_keeps_its_own():
    if LAYERED:
        # a sliding-window layer is not a plain DynamicLayer: the model's own cache
        model = tiny_model()
        model.config.layer_types = ["sliding_attention", "full_attention"]
        model.config.sliding_window = 4
        assert kv_cache.reserved_cache(model, 10) is None
    else:
        assert kv_cache.reserved_cache(tiny_model(), 10) is None
