"""A LoRA actor's frozen base stored at 16 bits, computed in fp32 (a job's base_dtype),
against the real verl 0.5.0 sdist: the two sites, and on the CPU the real peft + FSDP1
path giving the fp32 base's log-probs and LoRA gradients, with no 16-bit arithmetic
under the P40 guard."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from conftest import function_def, needs_torch, patch_cli, run_in_tree

from oldgpu.guard.policy import SITE_DIR

pytestmark = pytest.mark.slow

FSDP_WORKERS = "verl/workers/fsdp_workers.py"
ACTOR_BUILD = "ActorRolloutRefWorker._build_model_optimizer"


def test_the_actor_build_keeps_buffers_and_wraps_the_embeddings(verl_tree: Path, capsys) -> None:
    code, doc = patch_cli(capsys, str(verl_tree), "--profile", "pascal")
    assert code == 0, doc
    names = {p["name"] for p in doc["patches"]}
    assert {"base16-params-only", "base16-embedding-units"} <= names
    fn = function_def(verl_tree, FSDP_WORKERS, ACTOR_BUILD)
    calls = [ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Call)]
    assert "oldgpu_compat.to_model_dtype(actor_module, torch_dtype)" in calls
    assert "actor_module.to(torch_dtype)" not in calls
    wrapped = [c for c in calls if c.startswith("oldgpu_compat.embedding_units(")]
    assert len(wrapped) == 1 and "get_fsdp_wrap_policy(module=actor_module" in wrapped[0]
    assert wrapped[0].endswith(", actor_module)")


# What both scripts below start with: this checkout's engine on the path, torch, peft,
# transformers and the patched tree's helpers, one gloo process group, a fixed seed.
PRELUDE = r"""
import copy, functools, json, os, sys
sys.path.insert(0, __SRC__)
import torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
from peft import LoraConfig, TaskType, get_peft_model
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from verl.utils import oldgpu_compat
from verl.utils.fsdp_utils import get_fsdp_wrap_policy
from oldgpu import guard

dist.init_process_group("gloo", init_method="file://" + __PG__, rank=0, world_size=1)
torch.manual_seed(0)
"""


def script(body: str, tmp_path: Path, **values: str) -> str:
    """PRELUDE + body with the placeholders filled in (__SRC__, __PG__ and ``values``)."""
    text = (PRELUDE + body).replace("__SRC__", repr(str(SITE_DIR.parents[1])))
    text = text.replace("__PG__", repr(str(tmp_path / "pg")))
    for key, value in values.items():
        text = text.replace(f"__{key}__", repr(value))
    return text


# Run inside a cpu-patched tree: verl's own wrap policy and the compat helpers, peft and
# FSDP1 as verl builds the LoRA actor, once with the fp32 base (rounded to bf16, so both
# hold the same numbers) and once stored at bf16, under the P40 guard (device cpu) with
# bf16 allowed as storage only. Prints one JSON line.
TWINS = r"""
cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=160, vocab_size=300,
                  max_position_embeddings=512, tie_word_embeddings=False)
base = Qwen2ForCausalLM(cfg)
with torch.no_grad():
    for p in base.parameters():
        p.copy_(p.to(torch.bfloat16).float())  # numbers both twins hold exactly
lora_init = None

def build(dtype):
    global lora_init
    m = copy.deepcopy(base)
    m = oldgpu_compat.to_model_dtype(m, dtype)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.enable_input_require_grads()
    m = get_peft_model(m, LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8,
                                     target_modules="all-linear", bias="none"))
    lora = {n: p for n, p in m.named_parameters() if "lora_" in n}
    if lora_init is None:
        g = torch.Generator().manual_seed(1)
        lora_init = {n: torch.randn(p.shape, generator=g) * 0.05 for n, p in lora.items()}
    with torch.no_grad():
        for n, p in lora.items():
            p.copy_(lora_init[n])
    verls = get_fsdp_wrap_policy(module=m, config=None, is_lora=True)
    policy = oldgpu_compat.embedding_units(verls, m)
    fp32 = torch.float32
    mp = MixedPrecision(param_dtype=fp32, reduce_dtype=fp32, buffer_dtype=fp32)
    return FSDP(m, auto_wrap_policy=policy, mixed_precision=mp, device_id=torch.device("cpu"),
                use_orig_params=False, sync_module_states=False)

ids = torch.randint(0, 300, (2, 200))
out = {}
for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    guard.install(guard.policy_for("pascal", device="cpu", memory_mib=None,
                                   storage_dtypes=("bf16",)))
    try:
        model = build(dtype)
        stored = {str(p.dtype) for p in model.parameters()}
        logits = model(input_ids=ids).logits
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        logp.sum().backward()
    finally:
        guard.uninstall()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    inv_freq = [b for n, b in model.named_buffers() if n.endswith("inv_freq")]
    units = [type(m.module).__name__ for m in FSDP.fsdp_modules(model)]
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    out[name] = dict(logp=logp.detach(), grads=grads, stored=sorted(stored),
                     logits=str(logits.dtype), inv_freq=str(inv_freq[0].dtype),
                     units=units, bytes=size)
a, b = out["fp32"], out["bf16"]
print(json.dumps(dict(
    logp_max_diff=(a["logp"] - b["logp"]).abs().max().item(),
    grad_keys_equal=sorted(a["grads"]) == sorted(b["grads"]),
    grad_max_rel=max(((a["grads"][k] - b["grads"][k]).abs().max() /
                      a["grads"][k].abs().max()).item() for k in a["grads"]),
    n_grads=len(a["grads"]),
    **{f"{k}_{n}": out[n][k] for n in out
       for k in ("stored", "logits", "inv_freq", "units", "bytes")},
)))
dist.destroy_process_group()
"""


@needs_torch
def test_a_16bit_base_computes_like_its_fp32_twin(verl_tree: Path, tmp_path: Path, capsys) -> None:
    code, doc = patch_cli(capsys, str(verl_tree), "--profile", "cpu")
    assert code == 0, doc
    proc = run_in_tree(verl_tree, script(TWINS, tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    # Stored at 16 bits (the adapters fp32), computed in fp32, buffers untouched:
    assert r["stored_bf16"] == ["torch.bfloat16", "torch.float32"]
    assert r["stored_fp32"] == ["torch.float32"]
    assert r["logits_bf16"] == "torch.float32" and r["inv_freq_bf16"] == "torch.float32"
    assert r["bytes_bf16"] < 0.6 * r["bytes_fp32"]
    # the embeddings and the untied lm_head have units of their own only at 16 bits
    assert r["units_bf16"].count("Embedding") == 1 and r["units_fp32"].count("Embedding") == 0
    assert len(r["units_bf16"]) == len(r["units_fp32"]) + 2
    # The same numbers upcast to fp32 give the same log-probs and LoRA gradients, bit for
    # bit (the upcast is exact; so the only error a 16-bit base adds is its rounding of
    # an fp32 checkpoint, none for a bf16 one).
    assert r["grad_keys_equal"] and r["n_grads"] > 0
    assert r["logp_max_diff"] == 0.0
    assert r["grad_max_rel"] == 0.0


# A bf16 checkpoint loaded as verl loads the actor (from_pretrained at model_dtype bf16,
# then the patched .to, peft and FSDP with its embedding units), read back from FSDP:
# every base weight has the checkpoint's bits.
ROUND_TRIP = r"""
from safetensors.torch import load_file
cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=160, vocab_size=300,
                  tie_word_embeddings=True, torch_dtype="bfloat16")
Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(__DIR__, safe_serialization=True)
saved = load_file(__DIR__ + "/model.safetensors")
m = AutoModelForCausalLM.from_pretrained(__DIR__, torch_dtype=torch.bfloat16)
m = oldgpu_compat.to_model_dtype(m, torch.bfloat16)
m = get_peft_model(m, LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, target_modules="all-linear"))
policy = oldgpu_compat.embedding_units(get_fsdp_wrap_policy(m, None, is_lora=True), m)
fp32 = torch.float32
m = FSDP(m, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=False,
         mixed_precision=MixedPrecision(param_dtype=fp32, reduce_dtype=fp32, buffer_dtype=fp32))
with FSDP.summon_full_params(m):
    held = {n.replace("_fsdp_wrapped_module.", "").replace("base_model.model.", "")
             .replace(".base_layer", ""): p.detach().clone() for n, p in m.named_parameters()}
same = [k for k, v in saved.items() if held[k].dtype == v.dtype and torch.equal(
    held[k].view(torch.int16), v.view(torch.int16))]
print(json.dumps({"saved": len(saved), "bit_identical": len(same),
                  "lm_head_untied_equal": torch.equal(held["lm_head.weight"],
                                                      held["model.embed_tokens.weight"])}))
dist.destroy_process_group()
"""


@needs_torch
def test_a_bf16_checkpoint_round_trips_bit_for_bit(verl_tree: Path, tmp_path: Path, capsys) -> None:
    code, doc = patch_cli(capsys, str(verl_tree), "--profile", "cpu")
    assert code == 0, doc
    proc = run_in_tree(verl_tree, script(ROUND_TRIP, tmp_path, DIR=str(tmp_path / "ckpt")))
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["saved"] > 0 and r["bit_identical"] == r["saved"], r
    assert r["lm_head_untied_equal"] is True  # the tied head's copy holds the same bits
