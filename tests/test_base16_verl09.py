"""A LoRA actor's frozen base stored at 16 bits, computed in fp32, on verl 0.9.0: the
three sites of ``patch/verl_0_9_0/base16.py`` against the real sdist, and in the release's
own venv verl's FSDP engine itself built twice (fp32 and bf16 ``model_dtype``) from the
same numbers, giving the same log-probs, LoRA gradients and rollout tokens, under the
P40 guard."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from conftest import fresh_copy, function_def, patch_cli, patch_refused, tree_hashes
from test_rollout_verl09 import assets, cpu_tree, needs_venv, run_verl  # noqa: F401

from oldgpu import patch as patcher

pytestmark = pytest.mark.slow

FSDP_ENGINE = "verl/workers/engine/fsdp/transformer_impl.py"
SITES = {  # what each site reads before and after
    "base16-params-only": (
        "FSDPEngine._build_module",
        "module.to(torch_dtype)",
        "oldgpu_compat.to_model_dtype(module, torch_dtype)",
    ),
    "base16-embedding-units": (
        "FSDPEngine._build_fsdp_module",
        "get_fsdp_wrap_policy(module=module, config=self.engine_config.wrap_policy, "
        "is_lora=self.model_config.lora_rank > 0)",
        "oldgpu_compat.embedding_units(get_fsdp_wrap_policy(module=module, "
        "config=self.engine_config.wrap_policy, is_lora=self.model_config.lora_rank > 0), "
        "module)",
    ),
    "base16-adapters-fp32": (
        "FSDPEngine._build_lora_module",
        "next((p.dtype for p in module.parameters() if not p.requires_grad), None)",
        "oldgpu_compat.adapter_cast_dtype(module, self.engine_config)",
    ),
}


@pytest.fixture
def tree(verl09_pristine: Path, tmp_path: Path) -> Path:
    return fresh_copy(verl09_pristine, tmp_path)


def _calls(tree: Path, qualname: str) -> list[str]:
    fn = function_def(tree, FSDP_ENGINE, qualname)
    return [ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Call)]


@pytest.mark.parametrize("profile", ["pascal", "cpu", "ampere"])
def test_the_engine_sites_are_found_edited_and_reverted(
    tree: Path, verl09_pristine: Path, capsys, profile: str
) -> None:
    for qualname, old, _ in SITES.values():
        assert _calls(tree, qualname).count(old) == 1  # pristine 0.9.0 has each once
    code, out = patch_cli(capsys, str(tree), "--profile", profile)
    assert code == 0, out
    sites = {p["name"]: [s["function"] for s in p["sites"]] for p in out["patches"]}
    for name, (qualname, old, new) in SITES.items():
        assert sites[name] == [qualname]
        calls = _calls(tree, qualname)
        # none left but the one the new call wraps (the embeddings' units)
        assert calls.count(new) == 1 and calls.count(old) == new.count(old), (name, calls)
    for rel in (FSDP_ENGINE, patcher.COMPAT_REL):
        compile((tree / rel).read_bytes(), rel, "exec", dont_inherit=True)
    compat = (tree / patcher.COMPAT_REL).read_text()
    assert all(f"def {f}(" in compat for f in ("to_model_dtype", "embedding_units"))
    assert "def adapter_cast_dtype(" in compat
    code, out = patch_cli(capsys, str(tree), "--revert")
    assert code == 0 and out["changed"] is True
    assert tree_hashes(tree) == tree_hashes(verl09_pristine)


def test_a_changed_lora_cast_is_refused_whole(tree: Path, capsys) -> None:
    # A release whose cast reads the base's dtype another way is not this site: nothing
    # of any patch set is written.
    path = tree / FSDP_ENGINE
    text = path.read_text()
    old = "base_dtype = next((p.dtype for p in module.parameters() if not p.requires_grad), None)"
    assert text.count(old) == 1
    path.write_text(text.replace(old, "base_dtype = module.dtype"))
    err = patch_refused(capsys, tree, "site-not-found")
    assert err["message"].startswith(f"patch base16-adapters-fp32: {FSDP_ENGINE}")
    assert "FSDPEngine._build_lora_module" in err["message"]


# In the verl 0.9.0 venv, inside the cpu-patched tree: verl's FSDPEngine builds the LoRA
# actor (its _build_module, _build_lora_module and _build_fsdp_module, the three sites)
# from the smoke model with its weights rounded to bf16 and saved at fp32 (numbers both
# twins hold exactly), once at model_dtype fp32 and once at bf16, the adapters set alike;
# then, under the P40 guard with bf16 allowed as storage only, the engine's FSDP module's
# forward and backward, and generation through oldgpu.rollout.colocated from it.
TWINS = """
import json, os, shutil, types
import torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from safetensors.torch import load_file, save_file

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541", RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0")
dist.init_process_group("gloo", rank=0, world_size=1)
from verl.trainer.config import CheckpointConfig
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
from oldgpu import guard
from oldgpu.rollout import colocated
from oldgpu.rollout.sampling import Limits, make_request

src, model_dir = {model!r}, {work!r}
shutil.copytree(src, model_dir)
weights = load_file(os.path.join(src, "model.safetensors"))
save_file({{k: v.to(torch.bfloat16).float().contiguous() for k, v in weights.items()}},
          os.path.join(model_dir, "model.safetensors"), metadata={{"format": "pt"}})
lora_init = None

def build(dtype, **engine):
    global lora_init
    mc = HFModelConfig(path=model_dir, lora_rank=4, lora_alpha=8, use_remove_padding=False,
                       enable_gradient_checkpointing=True)
    ec = FSDPEngineConfig(model_dtype=dtype, use_torch_compile=False, strategy="fsdp", **engine)
    built = FSDPEngine(mc, ec, FSDPOptimizerConfig(lr=1e-5), CheckpointConfig())
    built._build_model_optimizer()
    with FSDP.summon_full_params(built.module, writeback=True):
        lora = {{n: p for n, p in built.module.named_parameters() if "lora_" in n}}
        if lora_init is None:  # B is zeros after peft: set both, so every gradient counts
            g = torch.Generator().manual_seed(1)
            lora_init = {{n: torch.randn(p.shape, generator=g) * 0.05 for n, p in lora.items()}}
        with torch.no_grad():
            for n, p in lora.items():
                p.copy_(lora_init[n])
    return built

def dtypes(params):
    return sorted({{str(p.dtype) for p in params}})

torch.manual_seed(0)
ids = torch.randint(3, 500, (2, 96))
limits = Limits(prompt_length=16, response_length=24, max_model_len=64)
params = dict(temperature=0, top_p=1.0, top_k=-1, logprobs=True)
requests = [make_request([5, 10 + i, 11, 12 + i], params, limits, request_id=str(i))
            for i in range(3)]
out = {{}}
for name in ("fp32", "bf16"):
    guard.install(guard.policy_for("pascal", device="cpu", memory_mib=None,
                                   storage_dtypes=("bf16",)))
    try:
        engine = build(name)
        model = engine.module
        logits = model(input_ids=ids).logits
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        logp.sum().backward()
        adapter = types.SimpleNamespace(policy=colocated.PolicyGenerator(
            pad_token_id=0, eos_token_ids=[2], logprobs_mode="processed_logprobs"))
        role = types.SimpleNamespace(rollout=adapter, actor=types.SimpleNamespace(engine=engine))
        colocated.register(0, adapter)
        fused = types.SimpleNamespace(worker_dict={{"actor_rollout": role}})
        got = colocated.run_batch(fused, 0, requests)
    finally:
        guard.uninstall()
    trained = [p for p in model.parameters() if p.requires_grad]
    out[name] = dict(
        logp=logp.detach(),
        grads={{n: p.grad for n, p in model.named_parameters() if p.grad is not None}},
        stored=dtypes(model.parameters()), adapters=dtypes(trained),
        inv_freq=[str(b.dtype) for n, b in model.named_buffers() if n.endswith("inv_freq")],
        units=[type(u.module).__name__ for u in FSDP.fsdp_modules(model)],
        logits=str(logits.dtype), tokens=[g.token_ids for g in got],
        gen_logp=[g.log_probs for g in got],
        bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
    engine.optimizer.step()
    out[name]["adam"] = dtypes(t for s in engine.optimizer.state.values()
                                for t in s.values() if t.dim())
a, b = out["fp32"], out["bf16"]
# No wrap policy, one flat group for all: there verl's cast stays (FSDP could not flatten).
shared = build("bf16", wrap_policy={{"disable": True}}, use_orig_params=True)
print(json.dumps(dict(
    logp_max_diff=(a["logp"] - b["logp"]).abs().max().item(),
    grad_keys_equal=sorted(a["grads"]) == sorted(b["grads"]), n_grads=len(a["grads"]),
    grad_max_diff=max((a["grads"][k] - b["grads"][k]).abs().max().item() for k in a["grads"]),
    same_tokens=a["tokens"] == b["tokens"], lengths=[len(t) for t in b["tokens"]],
    gen_gap=max(abs(x - y) for g, h in zip(a["gen_logp"], b["gen_logp"]) for x, y in zip(g, h)),
    shared_adapters=dtypes(p for p in shared.module.parameters() if p.requires_grad),
    **{{f"{{k}}_{{n}}": out[n][k] for n in out
       for k in ("stored", "adapters", "inv_freq", "units", "logits", "adam", "bytes")}},
)))
dist.destroy_process_group()
"""


@needs_venv
def test_the_engine_with_a_bf16_base_computes_and_generates_like_its_fp32_twin(
    cpu_tree,  # noqa: F811
    assets,  # noqa: F811
    tmp_path: Path,
) -> None:
    script = TWINS.format(model=str(assets / "model"), work=str(tmp_path / "model"))
    (line,) = [s for s in run_verl(cpu_tree, script, VERL_PLATFORM="cpu") if s.startswith("{")]
    r = json.loads(line)
    # Stored at 16 bits, the adapters and Adam's state fp32, computed in fp32, buffers kept:
    assert r["stored_bf16"] == ["torch.bfloat16", "torch.float32"]
    assert r["stored_fp32"] == ["torch.float32"]
    assert r["adapters_bf16"] == r["adapters_fp32"] == ["torch.float32"]
    assert r["adam_bf16"] == r["adam_fp32"] == ["torch.float32"]
    assert r["logits_bf16"] == "torch.float32"
    assert r["inv_freq_bf16"] and set(r["inv_freq_bf16"]) == {"torch.float32"}
    # (so small a model: its tied head's copy and the fp32 adapters are a large share)
    assert r["bytes_bf16"] < 0.7 * r["bytes_fp32"]
    # the tied embeddings, untied, and the lm_head get units of their own at 16 bits only
    assert r["units_bf16"].count("Embedding") == 1 and r["units_fp32"].count("Embedding") == 0
    assert len(r["units_bf16"]) == len(r["units_fp32"]) + 2
    # The same numbers upcast to fp32: the same log-probs and LoRA gradients, bit for bit,
    assert r["grad_keys_equal"] and r["n_grads"] > 0
    assert r["logp_max_diff"] == 0.0 and r["grad_max_diff"] == 0.0
    # and the rollout, generating from the engine's module, the same tokens and log-probs.
    assert r["same_tokens"] and all(n > 0 for n in r["lengths"])
    assert r["gen_gap"] == 0.0
    # Where a flat group would hold the adapters and the base, verl's cast still applies.
    assert r["shared_adapters"] == ["torch.bfloat16"]
