"""The fp16 patch set (a loss scaler, the HF rollout on an fp16 copy) against the real
verl 0.5.0 sdist: fp16 only."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest
from conftest import run_patched, tree_hashes

from oldgpu import cli
from oldgpu import patch as patcher
from oldgpu.patch.options import Options
from oldgpu.patch.registry import select_patches

pytestmark = pytest.mark.slow

DP_ACTOR = "verl/workers/actor/dp_actor.py"
DP_CRITIC = "verl/workers/critic/dp_critic.py"
HF_ROLLOUT = "verl/workers/rollout/hf_rollout.py"
FP16_PATCHES = ("fp16-loss-scaler", "fp16-hf-rollout")
ROLES = {
    DP_ACTOR: ("DataParallelPPOActor", "update_policy", "actor_optimizer", "actor"),
    DP_CRITIC: ("DataParallelPPOCritic", "update_critic", "critic_optimizer", "critic"),
}
needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="needs the engine test venv (torch)"
)


def run_cli(capsys, *argv: str) -> tuple[int, dict]:
    code = cli.main(["patch", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def method(tree: Path, rel: str, cls: str, name: str) -> ast.FunctionDef:
    module = ast.parse((tree / rel).read_bytes())
    (klass,) = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls]
    (fn,) = [n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return fn


def calls(fn: ast.AST) -> list[str]:
    """Every call in ``fn`` as ``ast.unparse`` writes it, in source order."""
    found = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
    return [ast.unparse(n) for n in sorted(found, key=lambda n: (n.lineno, n.col_offset))]


def test_registered_for_fp16_only() -> None:
    for dtype in ("fp32", "bf16"):
        names = {p.name for p in select_patches("0.5.0", Options(compute_dtype=dtype))}
        assert not names & set(FP16_PATCHES)
    cpu = {p.name for p in select_patches("0.5.0", Options(device="cpu"))}
    assert not cpu & set(FP16_PATCHES)
    names = {p.name for p in select_patches("0.5.0", Options(compute_dtype="fp16"))}
    assert set(FP16_PATCHES) <= names


def test_scaler_is_on_the_update_paths_in_order(verl_tree: Path, capsys) -> None:
    code, out = run_cli(capsys, str(verl_tree), "--profile", "volta")
    assert code == 0 and out["changed"] is True
    sites = {p["name"]: p["sites"] for p in out["patches"]}
    assert len(sites["fp16-loss-scaler"]) == 6  # per role: backward, metrics, step
    for rel, (cls, update, opt, role) in ROLES.items():
        fn = method(verl_tree, rel, cls, update)
        backwards = [c for c in calls(fn) if c.endswith(".backward()")]
        assert backwards == ["oldgpu_compat.scale_loss(self, loss).backward()"], rel
        assert ast.unparse(fn.body[-2]) == f"oldgpu_compat.scaler_metrics(self, metrics, '{role}')"
        step = calls(method(verl_tree, rel, cls, "_optimizer_step"))
        order = [
            f"oldgpu_compat.unscale_grads(self, self.{opt})",
            next(c for c in step if "clip_grad_norm_" in c),
            f"oldgpu_compat.scaler_step(self, self.{opt})",
            "oldgpu_compat.scaler_update(self, grad_norm)",
        ]
        assert [c for c in step if c in order] == order, step
        assert f"self.{opt}.step()" not in step
    compat = (verl_tree / patcher.COMPAT_REL).read_text()
    assert 'BAKED_COMPUTE_DTYPE = "fp16"' in compat and "ShardedGradScaler(" in compat


def test_hf_rollout_generates_inside_the_fp16_copy(verl_tree: Path, capsys) -> None:
    code, out = run_cli(capsys, str(verl_tree), "--profile", "volta")
    assert code == 0
    (site,) = {p["name"]: p["sites"] for p in out["patches"]}["fp16-hf-rollout"]
    assert site["file"] == HF_ROLLOUT and site["function"] == "HFRollout.generate_sequences"
    fn = method(verl_tree, HF_ROLLOUT, "HFRollout", "generate_sequences")
    (block,) = [s for s in fn.body if isinstance(s, ast.With)]
    assert ast.unparse(block.items[0].context_expr) == "oldgpu_compat.fp16_rollout(self)"
    assert [ast.unparse(s) for s in block.body] == [
        "output = [self._generate_minibatch(p) for p in batch_prompts]"
    ]
    # Only the one statement moved: the rest of the method is the original's.
    assert [ast.unparse(s) for s in fn.body[-2:]] == [
        "output = DataProto.concat(output)",
        "return output",
    ]


def test_pascal_and_fp32_trees_have_no_scaler(verl_tree: Path, verl_pristine: Path, capsys) -> None:
    pristine = tree_hashes(verl_pristine)
    code, out = run_cli(capsys, str(verl_tree), "--profile", "pascal")
    assert code == 0 and "fp16-loss-scaler" not in {p["name"] for p in out["patches"]}
    assert not {p["name"] for p in out["patches"]} & set(FP16_PATCHES)
    for rel, (cls, update, _, _) in ROLES.items():
        assert "loss.backward()" in calls(method(verl_tree, rel, cls, update))
        assert "scaler" not in (verl_tree / rel).read_text()
    assert "fp16_rollout" not in (verl_tree / HF_ROLLOUT).read_text()
    compat = (verl_tree / patcher.COMPAT_REL).read_text()
    assert "ShardedGradScaler" not in compat and "fp16_rollout" not in compat
    run_cli(capsys, str(verl_tree), "--revert")
    assert tree_hashes(verl_tree) == pristine


def test_revert_is_byte_identical(verl_tree: Path, verl_pristine: Path, capsys) -> None:
    run_cli(capsys, str(verl_tree), "--profile", "turing")
    assert tree_hashes(verl_tree) != tree_hashes(verl_pristine)
    code, out = run_cli(capsys, str(verl_tree), "--check", "--profile", "turing")
    assert code == 0 and out["changed"] is False  # a second run changes nothing
    run_cli(capsys, str(verl_tree), "--revert")
    assert tree_hashes(verl_tree) == tree_hashes(verl_pristine)


def refused(verl_tree: Path, capsys, rel: str, old: str, new: str, unique: bool = True) -> str:
    """Rewrite ``old`` (its first occurrence; the only one when ``unique``) to ``new`` in
    ``rel``, patch for volta: refused as site-not-found, nothing changed; the message."""
    path = verl_tree / rel
    text = path.read_text()
    assert text.count(old) == 1 if unique else old in text
    path.write_text(text.replace(old, new, 1))
    before = tree_hashes(verl_tree)
    code = cli.main(["patch", str(verl_tree), "--profile", "volta", "--json"])
    err = json.loads(capsys.readouterr().out)
    assert code == 2 and err["error"] == "site-not-found", err
    assert tree_hashes(verl_tree) == before  # all or nothing
    return err["message"]


def test_changed_shape_is_refused(verl_tree: Path, capsys) -> None:
    message = refused(
        verl_tree, capsys, DP_CRITIC, "loss.backward()", "(loss * 1).backward()", unique=False
    )
    assert "fp16-loss-scaler" in message and "update_critic" in message


def test_changed_rollout_shape_is_refused(verl_tree: Path, capsys) -> None:
    old = "output = [self._generate_minibatch(p) for p in batch_prompts]"
    new = "output = list(map(self._generate_minibatch, batch_prompts))"
    message = refused(verl_tree, capsys, HF_ROLLOUT, old, new)
    assert "fp16-hf-rollout" in message and "generate_sequences" in message


# The patched _optimizer_step of the real classes, on a tiny CPU model: one overflowing
# loss (skipped step, scale halved), then a clean one (grads unscaled before the clip).
RUNTIME_SCRIPT = """
import math, os, sys, types
import torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from verl.utils import oldgpu_compat
from verl.workers.actor.dp_actor import DataParallelPPOActor
from verl.workers.critic.dp_critic import DataParallelPPOCritic
from torch.optim.optimizer import register_optimizer_step_post_hook

hooked = []  # what an observer of optimizer steps (the guard) sees
register_optimizer_step_post_hook(lambda opt, args, kwargs: hooked.append(type(opt).__name__))

for cls, mod, opt, role in (
    (DataParallelPPOActor, "actor_module", "actor_optimizer", "actor"),
    (DataParallelPPOCritic, "critic_module", "critic_optimizer", "critic"),
):
    torch.manual_seed(0)
    worker = cls.__new__(cls)
    model = torch.nn.Linear(4, 1)
    setattr(worker, mod, model)
    setattr(worker, opt, torch.optim.SGD(model.parameters(), lr=0.1))
    worker.config = types.SimpleNamespace(grad_clip=100.0)
    x = torch.ones(1, 4)
    w0 = model.weight.detach().clone()
    scaled = oldgpu_compat.scale_loss(worker, model(x).sum() * 1e35)
    scaled.backward()
    norm = worker._optimizer_step()
    assert not math.isfinite(float(norm)), norm
    assert torch.equal(model.weight, w0), "an overflowing step was taken"
    getattr(worker, opt).zero_grad()
    loss = model(x).sum()
    scaled = oldgpu_compat.scale_loss(worker, loss)
    scaled.backward()
    norm = float(worker._optimizer_step())
    assert abs(norm - math.sqrt(5.0)) < 1e-4, norm  # unscaled before the clip
    assert torch.allclose(model.weight, w0 - 0.1), "the clean step was not taken"
    metrics = {}
    oldgpu_compat.scaler_metrics(worker, metrics, role)
    print(role, float(scaled / loss), metrics)
print("hooked", hooked)  # the skipped step counts too
print("ok")
"""


@needs_torch
def run_on_volta_tree(
    verl_tree: Path, tmp_path: Path, capsys, script: str, dtype: str | None
) -> list[str]:
    """Patch the tree for volta, run ``script`` in it (under ``dtype``), return its lines."""
    env = {"OLDGPU_COMPUTE_DTYPE": dtype} if dtype else None
    return run_patched(verl_tree, tmp_path, "volta", script, env)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (
            None,
            [
                "actor 32768.0 {'actor/grad_scale': [32768.0], 'actor/skipped_steps': [1]}",
                "critic 32768.0 {'critic/grad_scale': [32768.0], 'critic/skipped_steps': [1]}",
            ],
        ),
        # An fp16 tree run as fp32 (the bench's baseline): the scaler passes through;
        # verl's own non-finite check still skips the step, and it is counted.
        (
            "fp32",
            [
                "actor 1.0 {'actor/grad_scale': [1.0], 'actor/skipped_steps': [1]}",
                "critic 1.0 {'critic/grad_scale': [1.0], 'critic/skipped_steps': [1]}",
            ],
        ),
    ],
)
def test_overflow_skips_the_step(
    verl_tree: Path, tmp_path: Path, capsys, dtype: str | None, expected: list[str]
) -> None:
    lines = run_on_volta_tree(verl_tree, tmp_path, capsys, RUNTIME_SCRIPT, dtype)
    hooked = "hooked ['SGD', 'SGD', 'SGD', 'SGD']"
    assert [x for x in lines if not x.startswith("WARN")] == [*expected, hooked, "ok"], lines


# The patched HFRollout.generate_sequences on a tiny FSDP-wrapped Qwen2 on CPU (FSDP's
# summon and naming as in verl's actor): two minibatches, greedy.
ROLLOUT_SCRIPT = """
import sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from omegaconf import OmegaConf
from tensordict import TensorDict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import Qwen2Config, Qwen2ForCausalLM
from verl import DataProto
from verl.workers.rollout.hf_rollout import HFRollout

torch.cpu.empty_cache = lambda: None  # verl calls it after each minibatch; torch.cpu has none
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  attn_implementation="sdpa")
model = Qwen2ForCausalLM(cfg)
reference = {n: p.detach().clone() for n, p in model.named_parameters()}
actor = FSDP(model, device_id=torch.device("cpu"), use_orig_params=False)
seen = []
generate = Qwen2ForCausalLM.generate

def spy(self, *args, **kwargs):
    params = dict(self.named_parameters())
    same = all(torch.equal(params[n], p.half()) for n, p in reference.items() if n in params)
    tied = self.lm_head.weight is self.model.embed_tokens.weight
    seen.append((id(self), sorted({str(p.dtype) for p in params.values()}), same, tied))
    return generate(self, *args, **kwargs)

Qwen2ForCausalLM.generate = spy
conf = OmegaConf.create({"micro_batch_size": 2, "do_sample": False, "temperature": 1.0,
                         "response_length": 4, "n": 1, "top_k": 0, "top_p": 1.0})
rollout = HFRollout(actor, conf)
ids = torch.randint(3, 64, (4, 5))
batch = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                    "position_ids": torch.arange(5).expand(4, 5).clone()}, batch_size=4)
out = rollout.generate_sequences(
    DataProto(batch=batch, meta_info={"eos_token_id": 1, "pad_token_id": 0})
)
print("copies", len({s[0] for s in seen}), "calls", len(seen))
print("dtypes", sorted({d for s in seen for d in s[1]}))
print("equal-to-half", all(s[2] for s in seen), "tied", all(s[3] for s in seen))
print("after", type(rollout.module).__name__, tuple(out.batch["responses"].shape))
assert all(p.dtype == torch.float32 for p in actor.parameters())
print("ok")
"""


@needs_torch
@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        # fp16: one copy for both minibatches, every weight the actor's cast to fp16.
        (None, ["copies 1 calls 2", "dtypes ['torch.float16']", "equal-to-half True tied True"]),
        # fp16 tree run as fp32: the FSDP actor's own fp32 weights, as verl does.
        ("fp32", ["copies 1 calls 2", "dtypes ['torch.float32']", "equal-to-half False tied True"]),
    ],
)
def test_hf_rollout_runs_on_fp16_copy(
    verl_tree: Path, tmp_path: Path, capsys, dtype: str | None, expected: list[str]
) -> None:
    lines = run_on_volta_tree(verl_tree, tmp_path, capsys, ROLLOUT_SCRIPT, dtype)
    assert lines == [*expected, "after FullyShardedDataParallel (4, 4)", "ok"], lines
