"""The ``oldgpu-hf`` server's own settings: one table, read and checked in one place.

They sit under ``actor_rollout_ref.rollout.engine_kwargs["oldgpu-hf"]`` (or
``oldgpu_hf``, the spelling a Hydra override can write). verl hands engine kwargs on
unread, so a misspelt key or a word where a number belongs would otherwise reach the
server as nothing at all, or as a traceback inside a Ray actor minutes into the job.
``parse`` refuses both by name; ``check_overrides`` runs the same rules on a job's
composed argv, so ``oldgpu job`` stops with exit 4 before a unit starts.

Imports neither verl, Ray nor torch: the job engine calls it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from oldgpu.rollout import ROLLOUT_NAME

WEIGHTS_TRAINER = "trainer"
"""Engine setting ``weights``: generate from the trainer's parameters (the default)."""
WEIGHTS_COPY = "copy"
"""Engine setting ``weights``: the server's own copy, synced each step (the baseline)."""
WEIGHTS_MODES = (WEIGHTS_TRAINER, WEIGHTS_COPY)


@dataclass(frozen=True)
class Setting:
    kind: type  # int or float (weights is the one word)
    minimum: float  # the least value that means anything
    why: str


# name -> what it is. None is required: the server (and batching) own the defaults, and
# a null value means the default.
SETTINGS: dict[str, Setting] = {
    "max_batch_tokens": Setting(int, 1, "padded rows x (prompt + response) in one pass"),
    "max_batch_size": Setting(int, 1, "rows in one pass (default rollout.max_num_seqs)"),
    "batch_window_ms": Setting(float, 0, "no request for this long closes a batch"),
    "batch_max_wait_ms": Setting(float, 0, "a batch's first request waits at most this"),
    "request_timeout_s": Setting(float, 1, "a request unanswered this long fails"),
    "sleep_wait_s": Setting(float, 1, "a request waits this long for the trainer's wake-up"),
}
WORDS = {"weights": WEIGHTS_MODES}
KNOWN = (*SETTINGS, *WORDS)
SPELLINGS = (ROLLOUT_NAME, ROLLOUT_NAME.replace("-", "_"))
OVERRIDE_PREFIX = "actor_rollout_ref.rollout.engine_kwargs."


class RolloutSettingInvalid(ValueError):
    """An ``engine_kwargs["oldgpu-hf"]`` value the server does not take."""


def _number(name: str, raw: Any) -> int | float:
    spec = SETTINGS[name]
    # bool is an int to Python; true/false here is a mistake, not 1/0.
    bad = isinstance(raw, bool)
    value: int | float | None = None
    if not bad:
        try:
            value = spec.kind(raw) if spec.kind is float else int(str(raw).strip())
        except (TypeError, ValueError):
            bad = True
    if bad or value is None or value != value or value in (float("inf"), float("-inf")):
        noun = "an integer" if spec.kind is int else "a number"
        raise RolloutSettingInvalid(
            f"{ROLLOUT_NAME}: engine setting {name}={raw!r} is not {noun} ({spec.why})"
        )
    if value < spec.minimum:
        raise RolloutSettingInvalid(
            f"{ROLLOUT_NAME}: engine setting {name}={raw!r}: expected >= {spec.minimum:g}"
            f" ({spec.why})"
        )
    return value


def parse(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings given, each checked and converted; an unknown key is refused by name
    (a misspelt knob would otherwise be dropped without a word)."""
    out: dict[str, Any] = {}
    for name, raw in settings.items():
        if name not in KNOWN:
            raise RolloutSettingInvalid(
                f"{ROLLOUT_NAME}: unknown engine setting {name!r}; known: {', '.join(KNOWN)}"
            )
        if raw is None or raw == "null":
            continue
        if name in SETTINGS:
            out[name] = _number(name, raw)
        elif str(raw) in WORDS[name]:
            out[name] = str(raw)
        else:
            raise RolloutSettingInvalid(
                f"{ROLLOUT_NAME}: engine setting {name}={raw!r}; expected one of "
                f"{', '.join(WORDS[name])}"
            )
    return out


def from_engine_kwargs(engine_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Ours out of the rollout's ``engine_kwargs``, checked."""
    kwargs = engine_kwargs or {}
    for spelling in SPELLINGS:
        mine = kwargs.get(spelling)
        if mine:
            return parse(dict(mine))
    return {}


def check_overrides(argv: Sequence[str]) -> None:
    """Raise ``RolloutSettingInvalid`` for a Hydra override of one of our settings
    (``+actor_rollout_ref.rollout.engine_kwargs.oldgpu_hf.KEY=VALUE``) that ``parse``
    would refuse. Overrides of other engines' kwargs are theirs."""
    given: dict[str, str] = {}
    for item in argv:
        key, sep, value = item.lstrip("~+").partition("=")
        if not sep or not key.startswith(OVERRIDE_PREFIX):
            continue
        engine, _, name = key[len(OVERRIDE_PREFIX) :].partition(".")
        if engine in SPELLINGS and name:
            given[name] = value
    parse(given)
