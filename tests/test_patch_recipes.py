"""The patches GRPO and LoRA need on the HF rollout, against the real verl 0.5.0 sdist.

Both are upstream gaps, not device ones, so every profile's set has them: the HF
rollout sampled rollout.n² responses per prompt, and it dropped the FSDP wrap policy
that keeps LoRA's trainable adapters apart from the frozen base weights.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import function_def, needs_torch, patch_cli, tree_hashes

import oldgpu.patch.registry as patch_registry

pytestmark = pytest.mark.slow

HF_ROLLOUT = "verl/workers/rollout/hf_rollout.py"
FSDP_WORKERS = "verl/workers/fsdp_workers.py"
NEW = {"hf-rollout-one-sequence": HF_ROLLOUT, "hf-rollout-lora-wrap": FSDP_WORKERS}


def without_new(monkeypatch, *names: str) -> None:
    """The registry as it was before these patches (for a before/after comparison)."""
    kept = tuple(p for p in patch_registry.registry() if p.name not in names)
    assert len(kept) == len(patch_registry.registry()) - len(names)
    monkeypatch.setattr(patch_registry, "registry", lambda: kept)


def return_sequences(tree: Path) -> list[str]:
    """The values of every "num_return_sequences" entry in HFRollout._generate_minibatch."""
    fn = function_def(tree, HF_ROLLOUT, "HFRollout._generate_minibatch")
    return [
        ast.unparse(v)
        for d in ast.walk(fn)
        if isinstance(d, ast.Dict)
        for k, v in zip(d.keys, d.values, strict=True)
        if isinstance(k, ast.Constant) and k.value == "num_return_sequences"
    ]


def hf_wrap_condition(tree: Path) -> list[str]:
    """The tests of the ifs in the actor's FSDP build that drop the wrap policy."""
    fn = function_def(tree, FSDP_WORKERS, "ActorRolloutRefWorker._build_model_optimizer")
    return [
        ast.unparse(n.test)
        for n in ast.walk(fn)
        if isinstance(n, ast.If)
        and any(ast.unparse(s) == "auto_wrap_policy = None" for s in n.body)
    ]


@pytest.mark.parametrize("profile", ["pascal", "cpu", "ampere"])
def test_sites_are_found_and_rewritten_for_every_profile(
    verl_tree: Path, capsys, profile: str
) -> None:
    # The bugs are there in the sdist (the test bites).
    assert return_sequences(verl_tree) == ["1", "self.config.n"]
    assert hf_wrap_condition(verl_tree) == ["self._is_rollout and self.config.rollout.name == 'hf'"]
    code, out = patch_cli(capsys, str(verl_tree), "--profile", profile)
    assert code == 0
    sites = {p["name"]: p["sites"] for p in out["patches"]}
    for name, rel in NEW.items():
        (site,) = sites[name]
        assert site["file"] == rel, name
    assert sites["hf-rollout-one-sequence"][0]["function"] == "HFRollout._generate_minibatch"
    # Validation already asked for 1; training now does too.
    assert return_sequences(verl_tree) == ["1", "1"]
    assert hf_wrap_condition(verl_tree) == [
        "self._is_rollout and self.config.rollout.name == 'hf' and (not self._is_lora)"
    ]


def test_revert_is_byte_identical(verl_tree: Path, verl_pristine: Path, capsys) -> None:
    patch_cli(capsys, str(verl_tree), "--profile", "cpu")
    code, out = patch_cli(capsys, str(verl_tree), "--revert")
    assert code == 0 and out["changed"] is True
    assert tree_hashes(verl_tree) == tree_hashes(verl_pristine)


@pytest.mark.parametrize("profile", ["pascal", "cpu"])
def test_nothing_else_changes(
    verl_tree: Path, verl_pristine: Path, tmp_path: Path, capsys, monkeypatch, profile: str
) -> None:
    """The set with the new patches differs from the set without them only at their
    two lines: every other patch's result is byte for byte what it was."""
    patch_cli(capsys, str(verl_tree), "--profile", profile)
    with_new = tree_hashes(verl_tree)
    before = tmp_path / "before"
    import shutil

    shutil.copytree(verl_pristine, before, symlinks=True)
    without_new(monkeypatch, *NEW)
    code, out = patch_cli(capsys, str(before), "--profile", profile)
    assert code == 0 and not set(NEW) & {p["name"] for p in out["patches"]}
    without = tree_hashes(before)
    differ = {
        rel for rel in with_new.keys() | without.keys() if with_new.get(rel) != without.get(rel)
    }
    assert {rel for rel in differ if not rel.startswith(".oldgpu")} == set(NEW.values())
    for rel in NEW.values():
        new_lines = (verl_tree / rel).read_text().splitlines()
        old_lines = (before / rel).read_text().splitlines()
        assert len(new_lines) == len(old_lines)
        changed = [(a, b) for a, b in zip(old_lines, new_lines, strict=True) if a != b]
        assert len(changed) == 1, changed
    assert "num_return_sequences" in "".join(
        b for a, b in zip(
            (before / HF_ROLLOUT).read_text().splitlines(),
            (verl_tree / HF_ROLLOUT).read_text().splitlines(),
            strict=True,
        ) if a != b
    )  # fmt: skip


def test_site_not_found_changes_nothing(verl_tree: Path, capsys) -> None:
    path = verl_tree / HF_ROLLOUT
    path.write_text(path.read_text().replace('"num_return_sequences": self.config.n', '"n": 2'))
    before = tree_hashes(verl_tree)
    code, out = patch_cli(capsys, str(verl_tree))
    assert code == 2 and out["error"] == "site-not-found"
    assert "hf-rollout-one-sequence" in out["message"] and "site not found" in out["message"]
    assert tree_hashes(verl_tree) == before


ROLLOUT_SCRIPT = """
import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM
from verl import DataProto
from verl.workers.rollout.hf_rollout import HFRollout

torch.manual_seed(0)
model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
config = OmegaConf.create({"n": 2, "do_sample": True, "temperature": 1.0, "top_p": 1.0,
    "top_k": 0, "response_length": 4, "micro_batch_size": 8,
    "val_kwargs": {"top_k": 0, "top_p": 1.0, "temperature": 1.0}})
prompts = torch.randint(3, 64, (2, 5))
# As ray_trainer.fit hands it over: the batch already repeated rollout.n times.
batch = DataProto.from_dict(tensors={
    "input_ids": prompts, "attention_mask": torch.ones_like(prompts),
    "position_ids": torch.arange(5).expand(2, 5).clone()},
    meta_info={"eos_token_id": 1, "pad_token_id": 0}).repeat(repeat_times=2, interleave=True)
out = HFRollout(model, config).generate_sequences(batch)
print(len(batch), len(out), tuple(out.batch["responses"].shape))
"""


@needs_torch
def test_rollout_returns_one_response_per_repeated_prompt(
    verl_tree: Path, capsys, monkeypatch
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLDGPU_")}
    env.update(PYTHONPATH=str(verl_tree), PYTHONDONTWRITEBYTECODE="1", CUDA_VISIBLE_DEVICES="")

    def run() -> str:
        proc = subprocess.run(
            [sys.executable, "-c", ROLLOUT_SCRIPT], cwd=verl_tree, env=env,
            capture_output=True, text=True, check=False, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.strip().splitlines()[-1]

    # The cpu set without this patch (the pristine tree cannot run on a CPU at all):
    # n² responses, which the trainer's union of batch and responses then refuses.
    with monkeypatch.context() as m:
        without_new(m, "hf-rollout-one-sequence")
        patch_cli(capsys, str(verl_tree), "--profile", "cpu")
    assert run() == "4 8 (8, 4)"
    code, out = patch_cli(capsys, str(verl_tree), "--profile", "cpu")
    assert code == 0 and [f["path"] for f in out["files"] if f["status"] == "patch"] == [HF_ROLLOUT]
    assert run() == "4 4 (4, 4)"
