"""``oldgpu patch`` against the real verl 0.9.0 sdist: the model engine's patch set.

verl 0.9.0 is not the pin (0.5.0 is, until issue 27's rollout is proven on a GPU), so
its sdist comes from a fixture of its own, downloaded like the pinned one.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from conftest import (
    fresh_copy,
    function_def,
    needs_torch,
    patch_cli,
    patch_refused,
    run_in_tree,
    tree_hashes,
    tree_state,
    verl_config,
)

from oldgpu import patch as patcher
from oldgpu.patch.compat_module import COMPAT_MODULE

pytestmark = pytest.mark.slow

VERSION = "0.9.0"
FSDP_ENGINE = "verl/workers/engine/fsdp/transformer_impl.py"
MODEL_CONFIG = "verl/workers/config/model.py"
MODEL_UTILS = "verl/utils/model.py"
ATTENTION_UTILS = "verl/utils/attention_utils.py"
ENGINE_WORKERS = "verl/workers/engine_workers.py"
PATCHED_FILES = (FSDP_ENGINE, MODEL_CONFIG, MODEL_UTILS, ATTENTION_UTILS, ENGINE_WORKERS)
PATCHED_MODULES = (
    "verl.workers.engine.fsdp.transformer_impl",
    "verl.workers.config.model",
    "verl.utils.model",
    "verl.utils.attention_utils",
    # engine_workers.py needs the 0.9.0 venv's server packages (uvicorn): it is imported
    # patched by the jobs scenario's 0.9.0 job and tests/test_rollout_verl09.py
)
SITES = {  # patch name -> (file, function) of each site
    "fsdp-param-dtype-default": [(FSDP_ENGINE, "FSDPEngine._build_fsdp_module")],
    "fsdp-autocast-dtype-default": [
        (FSDP_ENGINE, "FSDPEngine.__init__"),
        (FSDP_ENGINE, "FSDPEngineWithLMHead.forward_step"),
    ],
    "merged-lora-export-dtype": [(FSDP_ENGINE, "FSDPEngine._merged_lora_per_tensor_param")],
    "hf-config-attn-default": [(MODEL_CONFIG, "HFModelConfig.__post_init__")],
    "attn-implementation": [(MODEL_UTILS, "load_valuehead_model")] * 2,
    "flash-attn-import-guard": [(ATTENTION_UTILS, "_get_attention_functions")],
    # the base16 set (tests/test_base16_verl09.py): a LoRA base stored at 16 bits
    "base16-params-only": [(FSDP_ENGINE, "FSDPEngine._build_module")],
    "base16-embedding-units": [(FSDP_ENGINE, "FSDPEngine._build_fsdp_module")],
    "base16-adapters-fp32": [(FSDP_ENGINE, "FSDPEngine._build_lora_module")],
    # the logits set (tests/test_patch_logits_verl09.py): the engine's inputs and outputs
    "response-logits": [(FSDP_ENGINE, "FSDPEngineWithLMHead.forward_step")] * 2,
    # the rollout set (tests/test_patch_rollout_verl09.py): no export for a shared rollout
    "shared-weights-sync": [(ENGINE_WORKERS, "ActorRolloutRefWorker.update_weights")],
}
COMPUTE_DTYPE = "oldgpu_compat.compute_dtype()"
ATTN = "oldgpu_compat.attn_implementation()"


@pytest.fixture
def tree(verl09_pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of verl 0.9.0 for one test to patch."""
    return fresh_copy(verl09_pristine, tmp_path)


def _unparsed(tree: Path, rel: str, qualname: str, kind: type) -> list[str]:
    return [
        ast.unparse(n) for n in ast.walk(function_def(tree, rel, qualname)) if isinstance(n, kind)
    ]


def _site_code(tree: Path) -> dict[str, list[str]]:
    """The code at every site, by what it is, for before/after comparison."""
    return {
        "param_dtype": [
            a
            for a in _unparsed(tree, FSDP_ENGINE, "FSDPEngine._build_fsdp_module", ast.Assign)
            if a.startswith("param_dtype = ") and "PrecisionType" not in a
        ],
        "autocast_init": [
            a
            for a in _unparsed(tree, FSDP_ENGINE, "FSDPEngine.__init__", ast.Assign)
            if a.startswith("self._autocast_dtype = ")
        ],
        "autocast_getattr": [
            c
            for c in _unparsed(tree, FSDP_ENGINE, "FSDPEngineWithLMHead.forward_step", ast.Call)
            if c.startswith("getattr(self, '_autocast_dtype'")
        ],
        "lora_export": [
            c
            for c in _unparsed(
                tree, FSDP_ENGINE, "FSDPEngine._merged_lora_per_tensor_param", ast.Call
            )
            if c.endswith("non_blocking=True)") and ".full_tensor().to(" in c
        ],
        "hf_config_attn": [
            c
            for c in _unparsed(tree, MODEL_CONFIG, "HFModelConfig.__post_init__", ast.Call)
            if c.startswith("self.override_config.get('attn_implementation'")
        ],
        "valuehead_attn": [
            k
            for k in _unparsed(tree, MODEL_UTILS, "load_valuehead_model", ast.keyword)
            if k.startswith("attn_implementation=")
        ],
    }


def test_sites_found_and_edited(tree: Path, capsys) -> None:
    before = _site_code(tree)
    assert before == {  # the test bites: pristine 0.9.0 hard-codes bf16 and FA2 here
        "param_dtype": ["param_dtype = torch.bfloat16"],
        "autocast_init": ["self._autocast_dtype = torch.bfloat16"],
        "autocast_getattr": ["getattr(self, '_autocast_dtype', torch.bfloat16)"],
        "lora_export": [
            "param.to(device, non_blocking=True).full_tensor().to(torch.bfloat16, "
            "non_blocking=True)"
        ],
        "hf_config_attn": ["self.override_config.get('attn_implementation', 'flash_attention_2')"],
        "valuehead_attn": ["attn_implementation='flash_attention_2'"] * 2,
    }
    code, out = patch_cli(capsys, str(tree), "--profile", "pascal-6.1")
    assert code == 0 and out["changed"] is True and out["verl_version"] == VERSION
    assert {f["path"] for f in out["files"]} == {*PATCHED_FILES, patcher.COMPAT_REL}
    sites = {p["name"]: [(s["file"], s["function"]) for s in p["sites"]] for p in out["patches"]}
    compat_sites = sites.pop("compat-module")
    assert sites == SITES
    assert sorted(compat_sites) == sorted(
        [(patcher.COMPAT_REL, "<module>")]
        + [(rel, "<module>") for rel in (*PATCHED_FILES[:3], ENGINE_WORKERS)]
    )
    assert _site_code(tree) == {
        "param_dtype": [f"param_dtype = {COMPUTE_DTYPE}"],
        "autocast_init": [f"self._autocast_dtype = {COMPUTE_DTYPE}"],
        "autocast_getattr": [f"getattr(self, '_autocast_dtype', {COMPUTE_DTYPE})"],
        "lora_export": [
            f"param.to(device, non_blocking=True).full_tensor().to({COMPUTE_DTYPE}, "
            "non_blocking=True)"
        ],
        "hf_config_attn": [f"self.override_config.get('attn_implementation', {ATTN})"],
        "valuehead_attn": [f"attn_implementation={ATTN}"] * 2,
    }
    # The padding helpers' flash-attn import is guarded, the fallback the compat module's.
    fn = function_def(tree, ATTENTION_UTILS, "_get_attention_functions")
    (guard,) = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Try)
        and any(
            isinstance(s, ast.ImportFrom) and s.module == "flash_attn.bert_padding" for s in n.body
        )
    ]
    (fallback,) = guard.handlers[0].body
    assert ast.unparse(guard.handlers[0].type) == "ImportError"
    assert fallback.module == COMPAT_MODULE
    assert [a.name for a in fallback.names] == [
        "index_first_axis",
        "pad_input",
        "rearrange",
        "unpad_input",
    ]
    compat = (tree / patcher.COMPAT_REL).read_text()
    assert 'BAKED_COMPUTE_DTYPE = "fp32"' in compat
    assert 'BAKED_ATTN_IMPLEMENTATION = "sdpa"' in compat


@pytest.mark.parametrize(
    ("argv", "dtype", "attn"),
    [
        ((), "fp32", "sdpa"),
        # --profile cpu adds the cpu set: tests/test_patch_verl_0_9_cpu.py.
        (("--compute-dtype", "fp16", "--attn-implementation", "eager"), "fp16", "eager"),
        (("--profile", "ampere"), "bf16", "flash_attention_2"),
    ],
)
def test_patched_files_compile(tree: Path, capsys, argv, dtype: str, attn: str) -> None:
    # The same sites for every profile: only the compat module's baked values differ.
    code, out = patch_cli(capsys, str(tree), *argv)
    assert code == 0 and out["changed"] is True
    assert {p["name"] for p in out["patches"]} == {*SITES, "compat-module"}
    for rel in (*PATCHED_FILES, patcher.COMPAT_REL):
        path = tree / rel
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    compat = (tree / patcher.COMPAT_REL).read_text()
    assert f'BAKED_COMPUTE_DTYPE = "{dtype}"' in compat
    assert f'BAKED_ATTN_IMPLEMENTATION = "{attn}"' in compat


def test_check(tree: Path, capsys) -> None:
    state = tree_state(tree)
    code, out = patch_cli(capsys, str(tree), "--check")
    assert code == 1 and out["changed"] is True and out["dry_run"] is True
    assert tree_state(tree) == state
    patch_cli(capsys, str(tree))
    code, out = patch_cli(capsys, str(tree), "--check")
    assert code == 0 and out["changed"] is False


def test_second_patch_changes_nothing(tree: Path, capsys) -> None:
    patch_cli(capsys, str(tree))
    state = tree_state(tree)
    code, out = patch_cli(capsys, str(tree))
    assert code == 0 and out["changed"] is False
    assert {f["status"] for f in out["files"]} == {"unchanged"}
    assert tree_state(tree) == state  # not even rewritten


def test_revert_is_byte_identical(tree: Path, verl09_pristine: Path, capsys) -> None:
    patch_cli(capsys, str(tree))
    manifest = json.loads((tree / patcher.MANIFEST_NAME).read_text())
    assert manifest["verl_version"] == VERSION
    assert tree_hashes(tree) != tree_hashes(verl09_pristine)
    code, out = patch_cli(capsys, str(tree), "--revert")
    assert code == 0 and out["changed"] is True
    assert tree_hashes(tree) == tree_hashes(verl09_pristine)
    assert not (tree / patcher.ORIGINALS_DIR).exists()


def test_hand_edited_tree_ispatch_refused(tree: Path, capsys) -> None:
    patch_cli(capsys, str(tree))
    engine = tree / FSDP_ENGINE
    engine.write_bytes(engine.read_bytes() + b"# a hand edit\n")
    err = patch_refused(capsys, tree, "tree-modified")
    assert "transformer_impl.py" in err["message"]
    patch_refused(capsys, tree, "tree-modified", "--revert")
    patch_refused(capsys, tree, "tree-modified", "--check")


def _edit_line(tree: Path, rel: str, qualname: str, startswith: str, new: str) -> None:
    """Replace the one line of ``qualname`` that starts (after indent) with ``startswith``
    by ``new`` (indented the same); ``new`` may hold several lines."""
    fn = function_def(tree, rel, qualname)
    path = tree / rel
    lines = path.read_text().splitlines(keepends=True)
    (i,) = [
        i for i in range(fn.lineno - 1, fn.end_lineno) if lines[i].lstrip().startswith(startswith)
    ]
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = "".join(f"{indent}{line}\n" for line in new.splitlines())
    path.write_text("".join(lines))


def test_changed_site_ispatch_refused(tree: Path, capsys) -> None:
    # A release that already made the default fp16 is not this patch's shape: refuse.
    _edit_line(
        tree,
        FSDP_ENGINE,
        "FSDPEngine._build_fsdp_module",
        "param_dtype = torch.bfloat16",
        "param_dtype = torch.float16",
    )
    err = patch_refused(capsys, tree, "site-not-found")
    assert err["message"].startswith(f"patch fsdp-param-dtype-default: {FSDP_ENGINE}")
    assert "FSDPEngine._build_fsdp_module" in err["message"]
    assert "(site not found)" in err["message"]


def test_bf16_in_another_shape_ispatch_refused(tree: Path, capsys) -> None:
    # bf16 where the getattr fallback was, but no longer a fallback: not this patch's site.
    _edit_line(
        tree,
        FSDP_ENGINE,
        "FSDPEngineWithLMHead.forward_step",
        "autocast_dtype = getattr(",
        "autocast_dtype = torch.bfloat16",
    )
    err = patch_refused(capsys, tree, "site-not-found")
    assert err["message"].startswith(f"patch fsdp-autocast-dtype-default: {FSDP_ENGINE}")
    assert "not in the expected shape" in err["message"]


def test_bf16_elsewhere_in_a_site_ispatch_refused(tree: Path, capsys) -> None:
    # A second bf16 default in the same function is a changed tree, not one more site.
    _edit_line(
        tree,
        FSDP_ENGINE,
        "FSDPEngine.__init__",
        "self.scaler = None",
        "self.scaler = None\nself._grad_dtype = torch.bfloat16",
    )
    err = patch_refused(capsys, tree, "site-not-found")
    assert "FSDPEngine.__init__" in err["message"] and "site ambiguous" in err["message"]


def test_patched_tree_without_manifest_ispatch_refused(tree: Path, capsys) -> None:
    patch_cli(capsys, str(tree))
    (tree / patcher.MANIFEST_NAME).unlink()
    patch_refused(capsys, tree, "tree-patched-without-manifest")


def test_other_release_ispatch_refused(tree: Path, capsys) -> None:
    (tree / "verl/version/version").write_text("0.8.0\n")
    err = patch_refused(capsys, tree, "verl-version-unsupported")
    assert "0.8.0" in err["message"] and "0.9.0" in err["message"]


# The legacy PPO trainer's own call (trainer.use_v1=false, ray_trainer: _compute_old_log_prob
# and the others) on a padded batch: it reaches verl.utils.attention_utils' flash-attn import
# on anything but an NPU.
_TRAINER_PADDING = """
import importlib.util
import torch
from tensordict import TensorDict
assert importlib.util.find_spec("flash_attn") is None, "flash_attn is importable"
from verl.workers.utils.padding import left_right_2_no_padding
mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
batch = TensorDict(
    {
        "input_ids": torch.arange(12).reshape(2, 6),
        "attention_mask": mask,
        "response_mask": mask[:, 3:],
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
    },
    batch_size=[2],
)
out = left_right_2_no_padding(batch)
print(out["input_ids"].offsets().tolist(), out["input_ids"].values().tolist())
import verl.utils.attention_utils as helpers
print(helpers._unpad_input.__module__)
"""


@needs_torch
def test_trainer_padding_runs_without_flash_attn(tree: Path, capsys) -> None:
    pristine = run_in_tree(tree, _TRAINER_PADDING)
    assert pristine.returncode != 0 and "No module named 'flash_attn'" in pristine.stderr
    patch_cli(capsys, str(tree))
    patched = run_in_tree(tree, _TRAINER_PADDING)
    assert patched.returncode == 0, patched.stderr[-3000:]
    nested, helpers = patched.stdout.splitlines()[-2:]
    assert nested == "[0, 4, 10] [1, 2, 3, 4, 6, 7, 8, 9, 10, 11]"  # padding dropped
    assert helpers == COMPAT_MODULE


@needs_torch
def test_patched_modules_import(tree: Path, capsys) -> None:
    patch_cli(capsys, str(tree))
    script = "\n".join(
        [
            "import importlib",
            f"for name in {list(PATCHED_MODULES)!r}:",
            "    importlib.import_module(name)",
            "from verl.utils import oldgpu_compat",
            "print(oldgpu_compat.compute_dtype(), oldgpu_compat.attn_implementation())",
        ]
    )
    done = run_in_tree(tree, script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "torch.float32 sdpa"


# What a pascal job sets on verl 0.9.0 (docs/newer-verl.md): settings, not patches.
PASCAL_SETTINGS = [
    # Inductor refuses CC < 7.0; the engine reads each role's own fsdp_config key.
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
    "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
    "critic.fsdp.use_torch_compile=False",
    # On (the 0.9.0 default) a micro-batch is packed into one row with attention_mask=None:
    # unproven with sdpa, and it attends over the whole row (docs/newer-verl.md).
    "actor_rollout_ref.model.use_remove_padding=False",
    "critic.model.use_remove_padding=False",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
]
# What the patch set makes the default; a tree left unpatched needs these too.
UNPATCHED_SETTINGS = [
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
    "+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32",
    "+critic.fsdp.mixed_precision.param_dtype=fp32",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "+critic.model.override_config.attn_implementation=sdpa",
]


def test_pascal_settings_compose(verl09_pristine: Path) -> None:
    cfg = verl_config(verl09_pristine, PASCAL_SETTINGS + UNPATCHED_SETTINGS)
    arr = cfg.actor_rollout_ref
    engines = (arr.actor.fsdp_config, arr.ref.fsdp_config, cfg.critic.fsdp)
    assert [e.use_torch_compile for e in engines] == [False] * 3
    assert [e.mixed_precision.param_dtype for e in engines] == ["fp32"] * 3
    assert [e.model_dtype for e in engines] == ["fp32"] * 3  # 0.9.0's default, ref too
    assert [m.use_remove_padding for m in (arr.model, cfg.critic.model)] == [False] * 2
    assert arr.actor.use_remove_padding is False  # interpolated from the model's
    assert arr.model.override_config.attn_implementation == "sdpa"
    assert cfg.critic.model.override_config.attn_implementation == "sdpa"
    assert (arr.model.use_liger, arr.model.use_fused_kernels) == (False, False)  # defaults


def test_actor_use_torch_compile_does_not_reach_the_engine(verl09_pristine: Path) -> None:
    # 0.5.0's key: in 0.9.0 it sets the ref's role key, not any engine's.
    cfg = verl_config(verl09_pristine, ["actor_rollout_ref.actor.use_torch_compile=False"])
    arr = cfg.actor_rollout_ref
    assert arr.ref.use_torch_compile is False
    assert arr.actor.fsdp_config.use_torch_compile is True
    assert arr.ref.fsdp_config.use_torch_compile is True
