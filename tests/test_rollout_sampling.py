"""The Pascal rollout's request semantics: verl's sampling dict -> a request, a finished
row -> the token ids and log-probs verl gets back (vLLM's behaviour in verl 0.9.0)."""

from __future__ import annotations

import numpy as np
import pytest

from oldgpu.rollout import sampling
from oldgpu.rollout.sampling import Limits, Request, finish_row, make_request, max_new_tokens

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
    assert req.batch_key == (True,)


@pytest.mark.parametrize(
    ("params", "error"),
    [({"top_p": 0.0}, "top_p"), ({"repetition_penalty": 0}, "repetition_penalty")],
)
def test_bad_params_are_refused(params, error):
    with pytest.raises(ValueError, match=error):
        make_request([1], params, LIMITS)


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


def test_abort_marks_only_unfinished_rows():
    cut = finish_row([7, 8], [-1.0, -1.0], _req(), eos_ids=[2], aborted=True)
    assert cut.stop_reason == sampling.ABORTED and cut.token_ids == [7, 8]
    ended = finish_row([7, 2], [-1.0, -1.0], _req(), eos_ids=[2], aborted=True)
    assert ended.stop_reason == sampling.COMPLETED
