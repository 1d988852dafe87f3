"""The decode loop on a tiny random Qwen2, on the CPU: every sampling setting verl 0.9.0
sends is honoured as vLLM defines it (checked against an unpadded reference computed
token by token), finished rows stop costing compute, seeded rows do not depend on their
batch, and an OOM splits the batch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_rollout_hf_engine import PAD, PROMPTS, VOCAB, generator, req, tiny_model  # noqa: E402

from oldgpu.rollout import decode as decode_mod  # noqa: E402
from oldgpu.rollout.hf_engine import RolloutOutOfMemory  # noqa: E402
from oldgpu.rollout.sampling import COMPLETED, Request  # noqa: E402


@torch.no_grad()
def reference_scores(model, r: Request, tokens: list[int], eos: tuple[int, ...]):
    """The scores step t samples from, recomputed unpadded from the prompt and tokens[:t],
    with vLLM's definitions written out plainly."""
    ids = torch.tensor([list(r.prompt_ids) + tokens])
    logits = model(ids).logits[0, len(r.prompt_ids) - 1 :].float()
    ends = set(r.stop_token_ids) | (set() if r.ignore_eos else set(eos))
    steps = []
    for t in range(len(tokens)):
        s = logits[t].clone()
        if t < r.min_tokens:
            for e in ends:
                s[e] = float("-inf")
        seen = set(r.prompt_ids) | set(tokens[:t])
        for v in seen:
            s[v] = s[v] / r.repetition_penalty if s[v] > 0 else s[v] * r.repetition_penalty
        for v in set(tokens[:t]):
            s[v] -= r.frequency_penalty * tokens[:t].count(v) + r.presence_penalty
        s = s / (r.temperature if r.temperature > 0 else 1.0)
        steps.append(s)
    return torch.stack(steps)


def check_against_reference(model, requests, out, eos=()):
    for r, o in zip(requests, out, strict=True):
        scores = reference_scores(model, r, o.token_ids, eos)
        lp = torch.log_softmax(scores, -1).gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(o.log_probs), lp, atol=1e-4), r
        assert torch.isfinite(lp).all()  # never a token the settings forbade
        if r.greedy:
            assert o.token_ids == scores.argmax(-1).tolist()


def test_penalties_as_vllm_defines_them_in_a_left_padded_batch():
    model = tiny_model()
    requests = [
        req(PROMPTS[0], 10, temperature=0.0, frequency_penalty=1.5),
        req(PROMPTS[1], 10, temperature=0.0, presence_penalty=2.0),
        # The shortest prompt is left-padded with PAD tokens: they must not count as seen.
        req([PAD + 3], 10, temperature=0.0, repetition_penalty=3.0),
        req(PROMPTS[2], 10, temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5),
    ]
    out = generator(model, eos=()).generate(requests)
    check_against_reference(model, requests, out)


def test_pad_tokens_are_not_seen_by_the_repetition_penalty():
    ids = torch.tensor([[PAD, PAD, 5], [7, PAD, 9]])
    mask = torch.tensor([[0, 0, 1], [1, 1, 1]])
    seen = decode_mod._seen_mask(ids, mask, VOCAB)
    assert seen[0].nonzero().flatten().tolist() == [5]
    assert seen[1].nonzero().flatten().tolist() == [PAD, 7, 9]  # a real pad-id token counts


def test_a_penalised_row_is_the_same_alone_and_padded():
    model = tiny_model()
    alone = req([4], 8, temperature=0.0, repetition_penalty=2.0)
    (solo,) = generator(model, eos=()).generate([alone])
    batch = generator(model, eos=()).generate([req(PROMPTS[0], 8, temperature=0.0), alone])
    assert batch[1].token_ids == solo.token_ids


def test_stop_token_ends_the_row_and_is_kept_even_with_ignore_eos():
    model = tiny_model()
    (free,) = generator(model, eos=()).generate([req(PROMPTS[0], 8, temperature=0.0)])
    stop = free.token_ids[2]
    cut = free.token_ids.index(stop) + 1
    out = generator(model, eos=()).generate(
        [
            req(PROMPTS[0], 8, temperature=0.0, stop_token_ids=(stop,)),
            req(PROMPTS[0], 8, temperature=0.0, stop_token_ids=(stop,), ignore_eos=True),
        ]
    )
    for o in out:
        assert o.token_ids == free.token_ids[:cut] and o.token_ids[-1] == stop
        assert o.stop_reason == COMPLETED


def test_min_tokens_suppresses_eos_and_stop_tokens_before_it():
    model = tiny_model()
    (free,) = generator(model, eos=()).generate([req(PROMPTS[1], 8, temperature=0.0)])
    eos, stop = free.token_ids[0], free.token_ids[1]
    requests = [req(PROMPTS[1], 8, temperature=0.0, min_tokens=4, stop_token_ids=(stop,))]
    (o,) = generator(model, eos=(eos,)).generate(requests)
    assert len(o.token_ids) >= 4
    assert eos not in o.token_ids[:3] and stop not in o.token_ids[:3]
    check_against_reference(model, requests, [o], eos=(eos,))


def test_a_seeded_row_does_not_depend_on_its_batch():
    model = tiny_model()
    gen = generator(model, eos=())
    mine = req(PROMPTS[2], 12, temperature=1.0, seed=1234)
    (alone,) = gen.generate([mine])
    torch.manual_seed(99)  # the global generator the unseeded rows use: irrelevant to mine
    others = [req(PROMPTS[0], 3), req(PROMPTS[1], 12, seed=7), req([1, 2, 3, 4, 5, 6, 7], 5)]
    batch = gen.generate([others[0], mine, *others[1:]])
    assert batch[1].token_ids == alone.token_ids
    assert batch[1].log_probs == pytest.approx(alone.log_probs, abs=1e-5)
    other_seed = gen.generate([req(PROMPTS[2], 12, temperature=1.0, seed=4321)])[0]
    assert other_seed.token_ids != alone.token_ids


def test_unseeded_sampling_is_hfs_for_a_fixed_global_seed():
    # The same draws as the HF-generate rollout before (torch.multinomial over the batch's
    # softmax): rows that run to the end, so none leaves the batch early.
    model = tiny_model()
    prompts = [PROMPTS[0], [13, 14, 15]]  # left-padded by two
    torch.manual_seed(5)
    ours = generator(model, eos=()).generate([req(p, 7, temperature=0.7) for p in prompts])
    torch.manual_seed(5)
    ref = model.generate(
        torch.tensor([PROMPTS[0], [PAD, PAD, 13, 14, 15]]),
        attention_mask=torch.tensor([[1] * 5, [0, 0, 1, 1, 1]]),
        do_sample=True,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        max_new_tokens=7,
        pad_token_id=PAD,
    )[:, 5:]
    assert [o.token_ids for o in ours] == ref.tolist()


def count_rows(model):
    fed: list[int] = []

    def hook(module, args, kwargs):
        fed.append(kwargs["input_ids"].shape[0])

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return fed


def test_rows_that_finish_stop_costing_compute():
    model = tiny_model()
    fed = count_rows(model)
    budgets = [2, 12, 4, 12]
    out = generator(model, eos=()).generate(
        [req(p, n) for p, n in zip([*PROMPTS, [3, 4]], budgets, strict=True)]
    )
    assert [len(o.token_ids) for o in out] == budgets
    # Prefill 4 rows; steps 2..: 3 rows until the 4-token row ends, then 2.
    assert fed == [4, 4, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2]
    assert sum(fed) < len(budgets) * max(budgets)  # HF generate: every row every step


def test_a_row_that_stops_early_on_eos_leaves_the_batch():
    model = tiny_model()
    (free,) = generator(model, eos=()).generate([req(PROMPTS[0], 6, temperature=0.0)])
    fed = count_rows(model)
    out = generator(model, eos=(free.token_ids[0],)).generate(
        [req(PROMPTS[0], 6, temperature=0.0), req(PROMPTS[1], 6, temperature=0.0, ignore_eos=True)]
    )
    assert len(out[0].token_ids) == 1 and len(out[1].token_ids) == 6
    assert fed == [2, 1, 1, 1, 1, 1]


def test_no_sort_when_no_row_asks_for_top_k_or_top_p(monkeypatch):
    calls = []
    real = decode_mod._top_k_top_p
    monkeypatch.setattr(decode_mod, "_top_k_top_p", lambda s, r: calls.append(1) or real(s, r))
    gen = generator(eos=())
    gen.generate([req(PROMPTS[0], 3, top_k=0, top_p=1.0)])
    assert calls == []
    gen.generate([req(PROMPTS[0], 3), req(PROMPTS[1], 3, top_p=0.9)])
    assert len(calls) == 3


class OOMAbove(torch.nn.Module):
    """The model, out of memory when fed more than `rows` rows (as the card would)."""

    def __init__(self, module, rows: int, error=None):
        super().__init__()
        self.module = module
        self.rows = rows
        self.error = error or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        self.sizes: list[int] = []

    def forward(self, **kwargs):
        self.sizes.append(kwargs["input_ids"].shape[0])
        if kwargs["input_ids"].shape[0] > self.rows:
            raise self.error
        return self.module(**kwargs)


@pytest.mark.parametrize(
    "error",
    [None, RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 22.38 GiB)")],
)
def test_out_of_memory_splits_the_batch_and_later_batches_stay_below(error):
    model = tiny_model()
    requests = [req(p, 5, temperature=0.0) for p in [*PROMPTS, [8, 9]]]
    expected = generator(model, eos=()).generate(requests)
    wrapped = OOMAbove(model, rows=2, error=error)
    gen = generator(wrapped, eos=())
    out = gen.generate(requests)
    assert [o.token_ids for o in out] == [o.token_ids for o in expected]
    assert gen.oom_splits == 1 and gen.tokens_limit is not None
    wrapped.sizes.clear()
    assert [o.token_ids for o in gen.generate(requests)] == [o.token_ids for o in expected]
    assert max(wrapped.sizes) <= 2 and gen.oom_splits == 1  # chunked up front, no new OOM


def test_one_row_that_still_runs_out_of_memory_is_named():
    gen = generator(OOMAbove(tiny_model(), rows=0), eos=())
    gen.max_batch_tokens = 4096
    r = Request(prompt_ids=(1, 2, 3), max_tokens=5, request_id="r-7")
    with pytest.raises(RolloutOutOfMemory, match="rollout-out-of-memory") as info:
        gen.generate([r, r])
    message = str(info.value)
    assert "'r-7'" in message and "3 prompt + 5 response" in message
    assert "max_batch_tokens=4096" in message and "asked for 16 tokens" in message


def test_other_errors_are_not_taken_for_out_of_memory():
    gen = generator(OOMAbove(tiny_model(), rows=0, error=RuntimeError("shape mismatch")), eos=())
    with pytest.raises(RuntimeError, match="shape mismatch"):
        gen.generate([req(PROMPTS[0], 3), req(PROMPTS[1], 3)])
    assert gen.oom_splits == 0
