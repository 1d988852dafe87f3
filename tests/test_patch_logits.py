"""The logits patch set (the response's logits only; log-probs and entropy 256 tokens at
a time) against the real verl 0.5.0 sdist: every profile, the P40's fp32 first."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
from conftest import function_def, patch_cli, patch_refused, run_patched

from oldgpu.patch.options import Options
from oldgpu.patch.registry import select_patches

pytestmark = pytest.mark.slow

DP_ACTOR = "verl/workers/actor/dp_actor.py"
LOGITS_PATCHES = {"entropy-by-rows", "response-logits"}
needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="needs the engine test venv (torch)"
)


def patch(tree: Path, capsys, profile: str) -> dict:
    code, out = patch_cli(capsys, str(tree), "--profile", profile)
    assert code == 0, out
    return {p["name"]: p["sites"] for p in out["patches"]}


def forward_text(tree: Path) -> str:
    return ast.unparse(function_def(tree, DP_ACTOR, "DataParallelPPOActor._forward_micro_batch"))


@pytest.mark.parametrize(
    "options",
    [
        Options(),
        Options(compute_dtype="fp16"),
        Options(compute_dtype="bf16"),
        Options(device="cpu"),
    ],
    ids=["fp32", "fp16", "bf16", "cpu"],
)
def test_registered_for_every_profile(options: Options) -> None:
    assert {p.name for p in select_patches("0.5.0", options)} >= LOGITS_PATCHES


@pytest.mark.parametrize("profile", ["pascal", "volta", "cpu"])
def test_padded_path_keeps_the_response_logits(verl_tree: Path, capsys, profile: str) -> None:
    sites = patch(verl_tree, capsys, profile)
    # the direct entropy call and the one under entropy_checkpointing; the model call
    # and the log-probs
    assert len(sites["entropy-by-rows"]) == 2 and len(sites["response-logits"]) == 2
    assert {s["file"] for s in sites["entropy-by-rows"] + sites["response-logits"]} == {DP_ACTOR}
    text = forward_text(verl_tree)
    assert "verl_F.entropy_from_logits" not in text
    assert "entropy = oldgpu_compat.entropy_by_rows(logits)" in text
    assert "torch.utils.checkpoint.checkpoint(oldgpu_compat.entropy_by_rows, logits)" in text
    assert "**extra_args, **oldgpu_compat.response_logits_only(self, response_length))" in text
    assert "oldgpu_compat.logprobs_by_rows(logits, micro_batch['responses'])" in text
    # the remove-padding path is verl's own
    assert "self.compute_entropy_from_logits(logits_rmpad)" in text
    assert "input_ids=input_ids_rmpad, attention_mask=None" in text
    assert "logprobs_from_logits(logits=logits_rmpad" in text


def test_changed_logits_shape_is_refused(verl_tree: Path, capsys) -> None:
    path = verl_tree / DP_ACTOR
    old = 'log_probs = logprobs_from_logits(logits, micro_batch["responses"])'
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, old.replace("logprobs_from_logits", "verl_F.lp_v2")))
    # all or nothing: every file as it was
    err = patch_refused(capsys, verl_tree, "site-not-found", "--profile", "pascal")
    assert "response-logits" in err["message"] and "_forward_micro_batch" in err["message"]


# verl's entropy against the patched one on 3 x 300 response tokens (a chunk of 256 rows
# and one of 44 per sequence) of verl's non-contiguous response slice, fp32 and fp16;
# the remove-padding shape (tokens, vocab); switched off, verl's own bit for bit.
ENTROPY_SCRIPT = """
import os
import torch
from verl.utils import oldgpu_compat, torch_functional as verl_F
torch.manual_seed(0)
full = torch.randn(3, 400, 1000) * 4
for dtype in (torch.float32, torch.float16):
    logits = full.to(dtype)[:, -301:-1, :]
    ours = oldgpu_compat.entropy_by_rows(logits)
    ref = verl_F.entropy_from_logits(logits.float())
    assert ours.dtype == torch.float32 and ours.shape == (3, 300), (ours.dtype, ours.shape)
    print(str(dtype), float((ours - ref).abs().max()) < 1e-4)
flat = full.reshape(-1, 1000)
diff = oldgpu_compat.entropy_by_rows(flat) - verl_F.entropy_from_logits(flat)
print("2d", float(diff.abs().max()) < 1e-4)
os.environ["OLDGPU_RESPONSE_LOGITS"] = "off"
logits = full[:, -301:-1, :]
print("off", torch.equal(oldgpu_compat.entropy_by_rows(logits), verl_F.entropy_from_logits(logits)))
"""


@needs_torch
def test_entropy_by_rows_is_verls_entropy(verl_tree: Path, tmp_path: Path) -> None:
    lines = run_patched(verl_tree, tmp_path, "pascal", ENTROPY_SCRIPT)
    assert lines[-4:] == ["torch.float32 True", "torch.float16 True", "2d True", "off True"]


# The patched DataParallelPPOActor._forward_micro_batch on a tiny FSDP-wrapped Qwen2 on
# CPU, against verl's own padded path written out (every position's logits, the
# response slice, verl's log-probs): the log-probs and the parameter gradients, and the
# positions the model was asked for.
LOGITS_SCRIPT = """
import functools
import sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import Qwen2Config, Qwen2ForCausalLM
from verl.utils import oldgpu_compat, torch_functional as verl_F
from verl.workers.actor.dp_actor import DataParallelPPOActor

torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
actor = FSDP(Qwen2ForCausalLM(cfg), device_id=torch.device("cpu"), use_orig_params=False)
shapes = []
forward = Qwen2ForCausalLM.forward
@functools.wraps(forward)  # the same signature: the patch reads it
def spy(self, *args, **kwargs):
    out = forward(self, *args, **kwargs)
    shapes.append(tuple(out.logits.shape))
    return out
Qwen2ForCausalLM.forward = spy

worker = DataParallelPPOActor.__new__(DataParallelPPOActor)
worker.actor_module, worker.device_name = actor, "cpu"
worker.use_remove_padding = worker.use_fused_kernels = worker.use_ulysses_sp = False
b, prompt, resp = 2, 7, 300  # two chunks of the response: 256 + 44 tokens
ids = torch.randint(1, 300, (b, prompt + resp))
mask = torch.ones_like(ids)
mask[0, :3] = 0  # a left-padded prompt
pos = (mask.cumsum(-1) - 1).clamp(min=0)
batch = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, -resp:]}
w = torch.randn(b, resp)

def grads(logp):
    actor.zero_grad()
    (logp * w).sum().backward()
    return torch.cat([p.grad.flatten() for p in actor.parameters()])

_, ours = worker._forward_micro_batch(batch, temperature=0.7)
g_ours = grads(ours)
on = oldgpu_compat.autocast_enabled()
with torch.autocast("cpu", dtype=oldgpu_compat.autocast_dtype(), enabled=on):
    logits = actor(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    logits.div_(0.7)
    ref = verl_F.logprobs_from_logits(logits[:, -resp - 1 : -1, :], batch["responses"])
g_ref = grads(ref)
print("shapes", shapes)
print("dtype", ours.dtype)
print("logprobs", float((ours - ref).abs().max()))
print("grads", float((g_ours - g_ref).norm() / g_ref.norm()))
"""


@needs_torch
@pytest.mark.parametrize(
    ("profile", "env", "kept", "tolerance"),
    [
        ("pascal", None, 301, 1e-5),  # fp32: the response + 1 positions, the same numbers
        ("pascal", {"OLDGPU_RESPONSE_LOGITS": "off"}, 307, 0.0),  # verl's own, bit for bit
        ("cpu", None, 301, 1e-5),
        # fp16 rounding apart (measured 5e-4, fp16's half step; a wrong gradient is off
        # by ~1); an fp16 tree run as fp32 keeps the response's logits too
        ("volta", None, 301, 4e-3),
        ("volta", {"OLDGPU_COMPUTE_DTYPE": "fp32"}, 301, 1e-5),
    ],
    ids=["pascal", "pascal-off", "cpu", "volta", "volta-as-fp32"],
)
def test_response_logits_are_verls_log_probs(
    verl_tree: Path, tmp_path: Path, profile: str, env, kept: int, tolerance: float
) -> None:
    lines = run_patched(verl_tree, tmp_path, profile, LOGITS_SCRIPT, env)
    values = dict(line.split(" ", 1) for line in lines[-4:])
    assert values["shapes"] == f"[(2, {kept}, 300), (2, 307, 300)]", lines
    assert values["dtype"] == "torch.float32"
    logprobs, grads = float(values["logprobs"]), float(values["grads"])
    if tolerance:
        assert logprobs < 5 * tolerance and grads < tolerance, values
    else:
        assert logprobs == 0.0 and grads == 0.0, values
