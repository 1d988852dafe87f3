"""The Pascal rollout's model side on a tiny random Qwen2, on the CPU: the batched decode
loop with per-row settings, log-probs that are those of the distribution each token was
drawn from, and weights copied in from the trainer. (Sampling settings and the decode
loop's compute: test_rollout_decode.py.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from oldgpu.rollout.hf_engine import PROCESSED, RAW, HFGenerator  # noqa: E402
from oldgpu.rollout.sampling import ABORTED, COMPLETED, Request  # noqa: E402

VOCAB = 97
PAD = 0


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=PAD,
    )
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.eval().requires_grad_(False)
    model.generation_config = transformers.GenerationConfig()
    return model


def generator(model=None, *, eos=(VOCAB - 1,), mode=PROCESSED) -> HFGenerator:
    return HFGenerator(
        model if model is not None else tiny_model(),
        pad_token_id=PAD,
        eos_token_ids=eos,
        device="cpu",
        logprobs_mode=mode,
    )


def req(prompt, n=6, **kw) -> Request:
    return Request(prompt_ids=tuple(prompt), max_tokens=n, logprobs=True, **kw)


@torch.no_grad()
def teacher_forced(model, prompt, tokens, temperature=1.0):
    """log p(token_t | prompt, tokens_<t) from one forward pass, unpadded."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


PROMPTS = ([5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23])


def test_a_mixed_batch_returns_one_answer_per_row_within_its_budget():
    gen = generator(eos=())
    requests = [
        req(PROMPTS[0], 6, temperature=1.0),
        req(PROMPTS[1], 3, temperature=0.0),
        req(PROMPTS[2], 5, temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3),
    ]
    out = gen.generate(requests)
    assert [len(o.token_ids) for o in out] == [6, 3, 5]
    for o in out:
        assert len(o.log_probs) == len(o.token_ids)
        assert all(0 <= t < VOCAB for t in o.token_ids)
        assert all(lp <= 1e-6 for lp in o.log_probs)
        assert o.stop_reason == COMPLETED


def test_log_probs_are_those_of_the_sampling_distribution_even_left_padded():
    model = tiny_model()
    gen = generator(model, eos=())
    requests = [req(PROMPTS[0], 8, temperature=1.0), req(PROMPTS[1], 8, temperature=0.5)]
    out = gen.generate(requests)
    for r, o in zip(requests, out, strict=True):
        expected = teacher_forced(model, r.prompt_ids, o.token_ids, r.temperature)
        assert torch.allclose(torch.tensor(o.log_probs), expected, atol=1e-4)


def test_raw_mode_reports_the_models_own_softmax():
    model = tiny_model()
    gen = generator(model, eos=(), mode=RAW)
    (o,) = gen.generate([req(PROMPTS[2], 6, temperature=0.5)])
    expected = teacher_forced(model, PROMPTS[2], o.token_ids, 1.0)
    assert torch.allclose(torch.tensor(o.log_probs), expected, atol=1e-4)


def test_greedy_rows_match_hfs_own_greedy_decoding():
    model = tiny_model()
    gen = generator(model, eos=())
    out = gen.generate([req(p, 6, temperature=0.0) for p in PROMPTS])
    for p, o in zip(PROMPTS, out, strict=True):
        ref = model.generate(
            torch.tensor([p]), do_sample=False, max_new_tokens=6, pad_token_id=PAD
        )[0, len(p) :]
        assert o.token_ids == ref.tolist()
    # A greedy row beside sampled ones decodes the same.
    mixed = gen.generate([req(PROMPTS[0], 6, temperature=1.0), req(PROMPTS[1], 6, temperature=0.0)])
    assert mixed[1].token_ids == out[1].token_ids


def test_top_k_one_is_greedy():
    gen = generator(eos=())
    greedy = gen.generate([req(PROMPTS[0], 5, temperature=0.0)])[0].token_ids
    top1 = gen.generate([req(PROMPTS[0], 5, temperature=1.0, top_k=1)])[0].token_ids
    assert top1 == greedy


def test_a_row_stops_at_its_eos_and_keeps_it():
    model = tiny_model()
    first = generator(model, eos=()).generate([req(PROMPTS[0], 4, temperature=0.0)])[0]
    eos = first.token_ids[0]
    out = generator(model, eos=(eos,)).generate([req(PROMPTS[0], 4, temperature=0.0)])[0]
    assert out.token_ids == [eos]
    ignoring = generator(model, eos=(eos,)).generate(
        [req(PROMPTS[0], 4, temperature=0.0, ignore_eos=True)]
    )[0]
    assert ignoring.token_ids == first.token_ids


def test_abort_stops_after_the_current_token():
    gen = generator(eos=())
    (o,) = gen.generate([req(PROMPTS[0], 20)], should_stop=lambda: True)
    assert len(o.token_ids) == 1 and o.stop_reason == ABORTED


def test_rows_with_and_without_ignore_eos_share_a_batch():
    model = tiny_model()
    first = generator(model, eos=()).generate([req(PROMPTS[0], 4, temperature=0.0)])[0]
    eos = first.token_ids[0]
    out = generator(model, eos=(eos,)).generate(
        [req(PROMPTS[0], 4, temperature=0.0), req(PROMPTS[0], 4, temperature=0.0, ignore_eos=True)]
    )
    assert out[0].token_ids == [eos]
    assert out[1].token_ids == first.token_ids


def test_weights_from_the_trainer_replace_the_models():
    trained = tiny_model(seed=1)
    rollout = generator(tiny_model(seed=2), eos=())
    probe = [req(PROMPTS[0], 6, temperature=0.0)]
    report = rollout.load_weights(trained.state_dict().items())
    assert report.loaded > 0 and report.unknown == []
    assert rollout.end_weight_update() == []
    for name, tensor in trained.state_dict().items():
        assert torch.equal(rollout.model.state_dict()[name], tensor), name
    assert (
        rollout.generate(probe)[0].token_ids
        == generator(trained, eos=()).generate(probe)[0].token_ids
    )


def test_a_partial_update_names_what_it_missed_and_unknown_names_are_reported():
    rollout = generator(eos=())
    state = tiny_model(seed=3).state_dict()
    report = rollout.load_weights(
        [(n, t) for n, t in state.items() if "layers.1." not in n] + [("nope", torch.ones(1))]
    )
    assert report.unknown == ["nope"]
    missing = rollout.end_weight_update()
    assert missing and all("layers.1." in n for n in missing)


def test_a_shape_mismatch_is_refused():
    rollout = generator()
    with pytest.raises(ValueError, match="embed_tokens"):
        rollout.load_weights([("model.embed_tokens.weight", torch.zeros(3, 3))])


def test_a_module_the_trainer_owns_fsdp_wrapped_or_summoned(tmp_path):
    """The generator takes the trainer's policy as it is: the FSDP root itself, or its
    inner module under ``summon_full_params(writeback=False, recurse=False)``."""
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    requests = [req(p, 6, temperature=0.0) for p in PROMPTS]
    expected = [o.token_ids for o in generator(tiny_model(), eos=()).generate(requests)]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        policy = FSDP(
            tiny_model(),
            device_id=torch.device("cpu"),
            auto_wrap_policy=ModuleWrapPolicy({Qwen2DecoderLayer}),
            use_orig_params=True,
        )
        assert [o.token_ids for o in generator(policy, eos=()).generate(requests)] == expected
        root_calls = []
        policy.register_forward_pre_hook(lambda m, a: root_calls.append(1))
        with FSDP.summon_full_params(policy, writeback=False, recurse=False):
            inner = generator(policy.module, eos=()).generate(requests)
            # The root handed in as is (the colocated rollout's way): its forward may not
            # start inside the summon, so the generator calls the module it wraps.
            root = generator(policy, eos=()).generate(requests)
        assert root_calls == []
        assert [o.token_ids for o in inner] == expected
        assert [o.token_ids for o in root] == expected
    finally:
        dist.destroy_process_group()
