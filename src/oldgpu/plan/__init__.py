"""``oldgpu plan``: batch sizes, micro batches, checkpointing and offload that fit the GPU.

From the GPU's memory, the model's shape, the prompt and response lengths and
the profile (dtype, rollout, device), the planner picks verl 0.5.0's
``train_batch_size``, ``ppo_mini_batch_size``, the micro batches of the actor,
critic, rollout log-prob and ref log-prob, gradient checkpointing, and the
param/optimizer offload of actor, ref and critic; it prints them as Hydra
overrides with the memory estimate behind each choice. Inputs that cannot fit
are refused (``plan-does-not-fit``) with what to change, never turned into a
config that will run out of memory.

Where each part lives (a new memory term goes into ``memory.py``):

* ``model.py``: the model's shape (built-in or from config.json) and ``Precision``,
  the bytes per element of each role for a compute dtype;
* ``inputs.py``: what the planner is asked (``Inputs``) and chooses (``Choice``);
* ``memory.py``: the memory model, phase by phase, with its calibrated constants
  and the measurements behind them (docs/planner.md has the full account);
* ``search.py``: the cap, the search space, offload levels, the search itself and
  what to change when nothing fits;
* ``explain.py``: the Hydra overrides, the reason behind each, the JSON and text;
* ``cli.py``: ``oldgpu plan``'s flags.
"""

from __future__ import annotations

from oldgpu import detect
from oldgpu.plan.cli import _host_available_mib, add_parser, run
from oldgpu.plan.explain import hydra_overrides, payload, text
from oldgpu.plan.inputs import PPO_MINI_BATCHES, Choice, Inputs, Offload
from oldgpu.plan.memory import (
    MIB,
    PHASES,
    VLLM_MAX_UTILIZATION,
    PhaseEstimate,
    estimate,
    estimate_phase,
    per_gpu_batch,
)
from oldgpu.plan.model import (
    PRECISIONS,
    SHAPES,
    ModelShape,
    Precision,
    load_model_dir,
    shape_from_config,
)
from oldgpu.plan.search import MAX_TRAIN_BATCH, Plan, cap_mib, plan, search

__all__ = [
    "MAX_TRAIN_BATCH",
    "MIB",
    "PHASES",
    "PPO_MINI_BATCHES",
    "PRECISIONS",
    "SHAPES",
    "VLLM_MAX_UTILIZATION",
    "Choice",
    "Inputs",
    "ModelShape",
    "Offload",
    "PhaseEstimate",
    "Plan",
    "Precision",
    "_host_available_mib",
    "add_parser",
    "cap_mib",
    "detect",
    "estimate",
    "estimate_phase",
    "hydra_overrides",
    "load_model_dir",
    "payload",
    "per_gpu_batch",
    "plan",
    "run",
    "search",
    "shape_from_config",
    "text",
]
