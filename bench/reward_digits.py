"""The learning check's reward: the share of digits among a response's visible characters.

An easy, dense target for a randomly initialised policy (digit tokens are a few percent
of the bench tokenizer's vocabulary, so a random policy scores a few percent and PPO
only has to shift probability mass towards them). verl calls it through
``custom_reward_function.path=bench/reward_digits.py custom_reward_function.name=
compute_score`` with the decoded response (special tokens skipped).
"""

from __future__ import annotations

from typing import Any


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None
) -> float:
    visible = [c for c in solution_str if not c.isspace()]
    if not visible:
        return 0.0
    return sum(c.isdigit() for c in visible) / len(visible)
