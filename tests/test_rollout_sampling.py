"""The Pascal rollout's request semantics: verl's sampling dict -> a request, a finished
row -> the token ids and log-probs verl gets back (vLLM's behaviour in verl 0.9.0)."""

from __future__ import annotations

import numpy as np
import pytest

from oldgpu.rollout import sampling
from oldgpu.rollout.sampling import (
    HARMLESS,
    HONOURED,
    Limits,
    Request,
    SamplingInvalid,
    SamplingUnsupported,
    batch_tokens,
    finish_row,
    make_request,
    max_new_tokens,
)

LIMITS = Limits(prompt_length=8, response_length=6, max_model_len=32)


def test_default_budget_is_what_is_left_capped_at_response_length():
    assert max_new_tokens(3, {}, LIMITS) == 6  # min(6, 8 + 6 - 3)
    assert max_new_tokens(10, {}, LIMITS) == 4  # a longer prompt (multi-turn) eats the budget
    assert max_new_tokens(14, {}, LIMITS) == 1  # never below 1


def test_explicit_budget_wins_and_is_clamped_to_the_model():
    assert max_new_tokens(3, {"max_tokens": 20}, LIMITS) == 20
    assert max_new_tokens(3, {"max_new_tokens": 5}, LIMITS) == 5  # SGLang's spelling
    assert max_new_tokens(30, {"max_tokens": 20}, LIMITS) == 2  # max_model_len - prompt
    with pytest.raises(ValueError, match="no room"):
        max_new_tokens(32, {}, LIMITS)


def test_agent_loop_params_become_a_request():
    # What verl 0.9.0's AgentLoopWorker sends (agent_loop.py): vLLM's conventions.
    params = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)
    req = make_request(np.array([5, 6, 7]), params, LIMITS, request_id="r1")
    assert req == Request(
        prompt_ids=(5, 6, 7), max_tokens=6, top_k=0, logprobs=True, request_id="r1"
    )
    assert not req.greedy


def test_validation_params_are_greedy():
    params = dict(temperature=0, top_p=1.0, top_k=-1, logprobs=False)
    req = make_request([1, 2], params, LIMITS)
    assert req.greedy and req.temperature == 0.0 and req.top_k == 0


def test_config_defaults_fill_what_the_dict_leaves_out():
    req = make_request([1], {}, LIMITS, default_repetition_penalty=1.2, default_ignore_eos=True)
    assert req.repetition_penalty == 1.2 and req.ignore_eos
    assert req.batch_key == ()  # every setting is per row: any requests share a batch


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"top_p": 0.0}, "top_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_bad_params_are_refused(params, error):
    with pytest.raises(SamplingInvalid, match=f"rollout-sampling-invalid: {error}="):
        make_request([1], params, LIMITS)


def test_temperature_none_is_the_default_not_greedy():
    assert make_request([1], {"temperature": None}, LIMITS).temperature == 1.0
    assert make_request([1], {"temperature": 0}, LIMITS).greedy


def test_every_setting_verl_sends_is_honoured():
    # agent_loop.py's dict, llm_server's max_tokens, the tool loop's stop_token_ids, the
    # vLLM server's seed (full_determinism), and vLLM's other penalties and min_tokens.
    params = dict(
        temperature=0.6,
        top_p=0.9,
        top_k=20,
        repetition_penalty=1.1,
        logprobs=True,
        max_tokens=5,
        stop_token_ids=[9, 4, 9],
        seed=43,
        min_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        ignore_eos=False,
        n=1,
        stop=[],
        prompt_logprobs=None,
        skip_special_tokens=True,
    )
    r = make_request([1, 2], params, LIMITS)
    assert (r.temperature, r.top_p, r.top_k, r.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    assert (r.max_tokens, r.stop_token_ids, r.seed, r.min_tokens) == (5, (4, 9), 43, 2)
    assert (r.presence_penalty, r.frequency_penalty, r.logprobs) == (0.5, -0.5, True)
    assert make_request([1], {"min_tokens": 50}, LIMITS).min_tokens == 6  # <= its budget


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("n", 4, "one sample per request"),
        ("stop", ["</tool_call>"], "stop strings"),
        ("prompt_logprobs", 0, "prompt log-probs"),
        ("logit_bias", {3: 1.0}, "not a setting this server knows"),
        ("min_p", 0.1, "not a setting this server knows"),
        ("best_of", 2, "not a setting this server knows"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(key, value, why):
    with pytest.raises(SamplingUnsupported, match="rollout-sampling-unsupported") as info:
        make_request([1], {key: value}, LIMITS)
    assert info.value.key == key and key in str(info.value) and why in str(info.value)


def test_harmless_keys_are_text_only_and_disjoint_from_the_honoured():
    assert not HONOURED & set(HARMLESS)
    for key in HARMLESS:
        make_request([1], {key: True}, LIMITS)


def test_logprobs_as_bool_or_vllms_int():
    assert not make_request([1], {"logprobs": False}, LIMITS).logprobs
    assert make_request([1], {"logprobs": 0}, LIMITS).logprobs
    assert not make_request([1], {"logprobs": None}, LIMITS).logprobs


def test_batch_tokens_is_the_padded_shape():
    a = Request(prompt_ids=(1, 2, 3), max_tokens=4)
    b = Request(prompt_ids=(1,), max_tokens=10)
    assert batch_tokens([a, b]) == 2 * (3 + 10) and batch_tokens([]) == 0
    assert a.tokens == 7


def test_text_and_empty_prompts_are_refused():
    with pytest.raises(TypeError):
        make_request("hello", {}, LIMITS)
    with pytest.raises(ValueError, match="empty"):
        make_request([], {}, LIMITS)


def _req(**kw) -> Request:
    return Request(prompt_ids=(1,), max_tokens=kw.pop("max_tokens", 5), logprobs=True, **kw)


def test_row_is_cut_after_its_eos_which_it_keeps():
    out = finish_row([7, 8, 2, 0, 0], [-0.1, -0.2, -0.3, -9, -9], _req(), eos_ids=[2])
    assert out.token_ids == [7, 8, 2]
    assert out.log_probs == pytest.approx([-0.1, -0.2, -0.3])
    assert out.stop_reason == sampling.COMPLETED


def test_row_is_cut_at_its_own_budget():
    # The batch ran to its longest row's budget; this row asked for 2.
    out = finish_row([7, 8, 9, 10], [-1.0] * 4, _req(max_tokens=2), eos_ids=[2])
    assert out.token_ids == [7, 8] and len(out.log_probs) == 2


def test_ignore_eos_keeps_going():
    out = finish_row([2, 8, 2], [-1.0] * 3, _req(ignore_eos=True), eos_ids=[2])
    assert out.token_ids == [2, 8, 2]


def test_log_probs_only_when_asked():
    req = Request(prompt_ids=(1,), max_tokens=3)
    assert finish_row([4, 5], [-1.0, -2.0], req, eos_ids=[2]).log_probs == []


def test_stop_tokens_end_a_row_even_with_ignore_eos_but_not_before_min_tokens():
    r = Request(prompt_ids=(1,), max_tokens=6, stop_token_ids=(7,), ignore_eos=True)
    assert finish_row([3, 2, 7, 4], None, r, eos_ids=[2]).token_ids == [3, 2, 7]
    late = Request(prompt_ids=(1,), max_tokens=6, min_tokens=3)
    assert finish_row([2, 5, 2, 4], None, late, eos_ids=[2]).token_ids == [2, 5, 2]


def test_abort_marks_only_unfinished_rows():
    cut = finish_row([7, 8], [-1.0, -1.0], _req(), eos_ids=[2], aborted=True)
    assert cut.stop_reason == sampling.ABORTED and cut.token_ids == [7, 8]
    ended = finish_row([7, 2], [-1.0, -1.0], _req(), eos_ids=[2], aborted=True)
    assert ended.stop_reason == sampling.COMPLETED
