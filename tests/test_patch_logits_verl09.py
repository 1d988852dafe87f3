"""The logits patch set for verl 0.9.0 (``response-logits``: the model engine computes the
response's logits only, and their log-probs and entropy 256 tokens at a time) against the
real verl 0.9.0 sdist: its sites for every profile, all or nothing, a byte-identical
revert; and, in the release's venv ($VERL09_VENV, as tests/test_rollout_verl09.py runs),
the patched engine's log-probs, entropy and gradients against verl's own on a tiny Qwen2,
with the widest logits tensor it makes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import fresh_copy, function_def, patch_cli, patch_refused, tree_hashes, tree_state
from test_rollout_verl09 import needs_venv, run_verl

from oldgpu.patch.options import Options
from oldgpu.patch.registry import select_patches

pytestmark = pytest.mark.slow

FSDP_ENGINE = "verl/workers/engine/fsdp/transformer_impl.py"
FORWARD_STEP = "FSDPEngineWithLMHead.forward_step"


@pytest.fixture
def tree(verl09_pristine: Path, tmp_path: Path) -> Path:
    return fresh_copy(verl09_pristine, tmp_path)


def _text(tree: Path, qualname: str) -> str:
    return ast.unparse(function_def(tree, FSDP_ENGINE, qualname))


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
    assert "response-logits" in {p.name for p in select_patches("0.9.0", options)}


@pytest.mark.parametrize("profile", ["pascal", "volta", "cpu"])
def test_the_engine_asks_for_the_response_logits(tree: Path, capsys, profile: str) -> None:
    before = _text(tree, FORWARD_STEP)
    assert "self.prepare_model_inputs(micro_batch=micro_batch)" in before
    assert "oldgpu_compat.response" not in before
    code, out = patch_cli(capsys, str(tree), "--profile", profile)
    assert code == 0 and out["changed"] is True
    (sites,) = [p["sites"] for p in out["patches"] if p["name"] == "response-logits"]
    assert [(s["file"], s["function"]) for s in sites] == [(FSDP_ENGINE, FORWARD_STEP)] * 2
    text = _text(tree, FORWARD_STEP)
    assert (
        "model_inputs, output_args = oldgpu_compat.response_inputs(self, micro_batch, "
        "self.prepare_model_inputs(micro_batch=micro_batch))" in text
    )
    assert (
        "model_output = oldgpu_compat.response_outputs(self, output=raw_output, "
        "output_args=output_args, micro_batch=micro_batch, logits_processor_func=loss_function)"
        in text
    )
    assert "self.prepare_model_outputs(" not in text
    # verl's own code stays for what the helpers hand back to it
    outputs = _text(tree, "FSDPEngineWithLMHead.prepare_model_outputs")
    assert "logprobs_from_logits(logits=logits_rmpad, labels=input_ids_rmpad_rolled)" in outputs
    path = tree / FSDP_ENGINE
    compile(path.read_bytes(), str(path), "exec", dont_inherit=True)


def test_revert_is_byte_identical(tree: Path, verl09_pristine: Path, capsys) -> None:
    patch_cli(capsys, str(tree), "--profile", "pascal")
    assert "oldgpu_compat.response_inputs" in (tree / FSDP_ENGINE).read_text()
    code, out = patch_cli(capsys, str(tree), "--revert")
    assert code == 0 and out["changed"] is True
    assert tree_hashes(tree) == tree_hashes(verl09_pristine)


def test_changed_engine_call_is_refused(tree: Path, capsys) -> None:
    path = tree / FSDP_ENGINE
    old = "model_inputs, output_args = self.prepare_model_inputs(micro_batch=micro_batch)"
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, old.replace("micro_batch=micro_batch", "micro_batch, 1")))
    state = tree_state(tree)
    err = patch_refused(capsys, tree, "site-not-found", "--profile", "pascal")
    assert "response-logits" in err["message"] and FORWARD_STEP in err["message"]
    assert tree_state(tree) == state  # all or nothing: not even the other sets' files


# The patched FSDPEngineWithLMHead.forward_step on a tiny FSDP-wrapped Qwen2 on the CPU,
# the patch switched on and off (OLDGPU_RESPONSE_LOGITS: off is verl's own code) in one
# process, for a padded batch whose prompts and responses differ in length, as the
# legacy trainer hands it over (left_right_2_no_padding): the response's log-probs and
# entropy as no_padding_2_padding reads them, the gradients of a loss over both, the
# positions the model computed, and the widest vocab-wide tensor any op made.
ENGINE_SCRIPT = """
import functools
import os
import sys
from types import SimpleNamespace
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from tensordict import TensorDict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import Qwen2Config, Qwen2ForCausalLM
from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding
torch.manual_seed(0)
VOCAB = 300
cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
model = FSDP(Qwen2ForCausalLM(cfg), device_id=torch.device("cpu"), use_orig_params=False)
asked = []
forward = Qwen2ForCausalLM.forward
@functools.wraps(forward)  # the same signature: the patch reads it
def spy(self, *args, **kwargs):
    out = forward(self, *args, **kwargs)
    asked.append(tuple(kwargs["input_ids"].shape) + tuple(out.logits.shape))
    return out
Qwen2ForCausalLM.forward = spy
engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
engine.module, engine._autocast_dtype, engine.pad_to_length = model, torch.float32, None
engine.engine_config = SimpleNamespace(entropy_checkpointing=False)
engine.get_data_parallel_group = lambda: None
# A padded batch as the trainer has it: prompts left-padded to 200, responses right-padded
# to 300 (one row two chunks of 256 + 44 rows); prompts of 190, 120 and 60 tokens.
PW, RW = 200, 300
prompt_lens, resp_lens = [190, 120, 60], [300, 7, 150]
B = len(prompt_lens)
prompts = torch.zeros(B, PW, dtype=torch.long)
responses = torch.zeros(B, RW, dtype=torch.long)
mask = torch.zeros(B, PW + RW, dtype=torch.long)
for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
    prompts[i, PW - p:] = torch.randint(1, VOCAB, (p,))
    responses[i, :r] = torch.randint(1, VOCAB, (r,))
    mask[i, PW - p: PW + r] = 1
position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
TEMPS = torch.tensor([1.0, 0.7, 1.3])  # per sample
def batch(temperature, entropy):
    td = TensorDict({"prompts": prompts, "responses": responses,
                     "input_ids": torch.cat([prompts, responses], 1), "attention_mask": mask,
                     "position_ids": position_ids, "response_mask": mask[:, PW:]}, batch_size=[B])
    td = left_right_2_no_padding(td)
    if torch.is_tensor(temperature):
        td["temperature"] = temperature
    else:
        tu.assign_non_tensor(td, temperature=temperature)
    tu.assign_non_tensor(td, use_remove_padding=False, use_fused_kernels=False,
                         calculate_entropy=entropy, pad_token_id=0)
    return td
class Widest(TorchDispatchMode):  # the most elements of one vocab-wide tensor an op makes
    def __init__(self):
        super().__init__()
        self.most = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not t.is_nested and t.dim() and t.shape[-1] == VOCAB:
                self.most = max(self.most, t.numel())
        return out
def run(on, temperature, train):
    os.environ["OLDGPU_RESPONSE_LOGITS"] = "on" if on else "off"
    td = batch(temperature, True)
    got = {}
    def loss_fn(model_output, data, dp_group):
        lp = no_padding_2_padding(model_output["log_probs"], data)
        ent = no_padding_2_padding(model_output["entropy"], data)
        got["lp"], got["ent"] = lp.detach(), ent.detach()
        m = data["response_mask"].float()
        return ((lp + 0.1 * ent) * m).sum() / m.sum(), {}
    model.zero_grad(set_to_none=True)
    widest = Widest()
    with (torch.enable_grad() if train else torch.no_grad()), widest:
        loss, _ = engine.forward_step(td, loss_function=loss_fn, forward_only=not train)
    if train:
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()] if train else []
    return got, grads, widest.most
m = mask[:, PW:].bool()
cases = [(1.0, False, False), (1.0, True, False), (TEMPS, False, False), (TEMPS, True, True)]
for temperature, train, checkpointing in cases:
    engine.engine_config.entropy_checkpointing = checkpointing
    asked.clear()
    ours, ours_g, ours_most = run(True, temperature, train)
    verls, verls_g, verls_most = run(False, temperature, train)
    lp = float((ours["lp"] - verls["lp"])[m].abs().max())
    ent = float((ours["ent"] - verls["ent"])[m].abs().max())
    g = max(float((a - b).abs().max()) for a, b in zip(ours_g, verls_g)) if train else 0.0
    scale = float(verls["lp"][m].abs().max())
    print("case", lp < 1e-5, ent < 1e-5, g < 1e-6, scale > 1, asked[0], asked[1],
          ours_most, verls_most)
# the value head inherits forward_step, and remove-padding: verl's own inputs, untouched
from verl.utils import oldgpu_compat
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead
os.environ["OLDGPU_RESPONSE_LOGITS"] = "on"
critic = FSDPEngineWithValueHead.__new__(FSDPEngineWithValueHead)
critic.module, critic.pad_to_length = model, None
td = batch(1.0, False)
prepared = critic.prepare_model_inputs(td)
print("critic", oldgpu_compat.response_inputs(critic, td, prepared) is prepared)
tu.assign_non_tensor(td, use_remove_padding=True)
prepared = ({"input_ids": None, "attention_mask": None, "position_ids": None}, {})
print("rmpad", oldgpu_compat.response_inputs(engine, td, prepared) is prepared)
"""


@needs_venv
def test_engine_log_probs_and_entropy_equal_verls(tree: Path, capsys, tmp_path: Path) -> None:
    code, _ = patch_cli(capsys, str(tree), "--profile", "cpu")
    assert code == 0
    script = ENGINE_SCRIPT.replace("sys.argv[1]", repr(str(tmp_path / "pg")))
    lines = run_verl(tree, script, VERL_PLATFORM="cpu")
    batch, vocab, max_prompt, max_response, longest = 3, 300, 190, 300, 490
    ours = (batch, max_prompt + max_response - 1, batch, max_response, vocab)
    verls = (batch, longest, batch, longest, vocab)
    cases = [line for line in lines if line.startswith("case ")]
    assert len(cases) == 4
    widest = f"{batch * max_response * vocab} {batch * longest * vocab}"
    for line in cases:
        # equal to fp32 rounding (a log-prob is about 6 here); the model computed the
        # logits of 300 positions a row, not 490, and no op made a wider vocab tensor
        assert line == f"case True True True True {ours} {verls} {widest}"
    assert lines[-2:] == ["critic True", "rmpad True"]
