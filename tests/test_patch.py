"""``oldgpu patch`` against the real verl sdist (no fakes of verl)."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest
from conftest import needs_torch, patch_cli, patch_refused, run_in_tree, tree_hashes, tree_state

from oldgpu import cli
from oldgpu import patch as patcher
from oldgpu.output import EngineError
from oldgpu.patch import registry, transaction

pytestmark = pytest.mark.slow

# The FSDP PPO path's files that carry autocast / attention / flash-attn sites in 0.5.0.
PPO_FILES = (
    "verl/workers/actor/dp_actor.py",
    "verl/workers/critic/dp_critic.py",
    "verl/workers/rollout/hf_rollout.py",
    "verl/workers/fsdp_workers.py",
    "verl/utils/model.py",
    "verl/workers/engine/fsdp/engine_impl.py",
)
PATCHED_MODULES = (
    "verl.workers.fsdp_workers",
    "verl.workers.actor.dp_actor",
    "verl.workers.critic.dp_critic",
    "verl.workers.rollout.hf_rollout",
    "verl.workers.engine.fsdp.engine_impl",
    "verl.utils.model",
)


def names_bf16(node: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Attribute) and n.attr == "bfloat16")
        or (isinstance(n, ast.Constant) and n.value in ("bfloat16", "bf16"))
        for n in ast.walk(node)
    )


def bad_sites(path: Path) -> list[str]:
    """Autocasts naming bf16 and attn_implementation keywords naming flash_attention_2."""
    tree = ast.parse(path.read_bytes())
    bad = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "autocast"
            and names_bf16(node)
        ):
            bad.append(f"{path.name}:{node.lineno}: autocast bf16")
        if (
            isinstance(node, ast.keyword)
            and node.arg == "attn_implementation"
            and isinstance(node.value, ast.Constant)
            and node.value.value == "flash_attention_2"
        ):
            bad.append(f"{path.name}:{node.lineno}: flash_attention_2")
    return bad


def test_patched_sites_follow_the_profile(verl_tree: Path, capsys) -> None:
    before = [s for rel in PPO_FILES for s in bad_sites(verl_tree / rel)]
    assert len(before) >= 11, before  # the test would bite: pristine 0.5.0 has them
    code, out = patch_cli(capsys, str(verl_tree))
    assert code == 0 and out["changed"] is True
    for rel in PPO_FILES:
        path = verl_tree / rel
        assert bad_sites(path) == [], rel
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    compat = verl_tree / patcher.COMPAT_REL
    compile(compat.read_bytes(), str(compat), "exec", dont_inherit=True)
    # Unguarded flash_attn.bert_padding imports are gone from the PPO path too.
    for rel in PPO_FILES:
        tree = ast.parse((verl_tree / rel).read_bytes())
        parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "flash_attn.bert_padding":
                assert isinstance(parents[id(node)], ast.Try), f"{rel}:{node.lineno}"


def test_json_report_shape(verl_tree: Path, capsys) -> None:
    code, out = patch_cli(capsys, str(verl_tree), "--check")
    assert code == 1 and out["changed"] is True and out["dry_run"] is True
    assert {f["path"] for f in out["files"]} == {*PPO_FILES, patcher.COMPAT_REL}
    assert all(f["status"] in ("patch", "add") for f in out["files"])
    names = {p["name"] for p in out["patches"]}
    assert names == {
        "autocast-compute-dtype",
        "attn-implementation",
        "flash-attn-import-guard",
        "reward-model-dtype",
        "hf-rollout-param-offload",
        "hf-rollout-one-sequence",
        "hf-rollout-lora-wrap",
        "entropy-by-rows",
        "response-logits",
        "compat-module",
        "base16-params-only",
        "base16-embedding-units",
    }
    sites = {p["name"]: p["sites"] for p in out["patches"]}
    assert len(sites["autocast-compute-dtype"]) == 5
    assert len(sites["attn-implementation"]) == 6
    assert len(sites["flash-attn-import-guard"]) == 4
    assert {s["function"] for s in sites["hf-rollout-param-offload"]} == {
        "ActorRolloutRefWorker.generate_sequences"
    }
    for site in (s for group in sites.values() for s in group):
        assert set(site) == {"file", "function", "line", "change"}


def test_manifest_and_originals(verl_tree: Path, verl_pristine: Path, capsys) -> None:
    patch_cli(capsys, str(verl_tree), "--compute-dtype", "fp16", "--attn-implementation", "eager")
    manifest = json.loads((verl_tree / patcher.MANIFEST_NAME).read_text())
    assert manifest["schema"] == 1 and manifest["verl_version"] == "0.5.0"
    assert manifest["engine"]["name"] == "oldgpu"
    assert manifest["options"] == {
        "compute_dtype": "fp16",
        "attn_implementation": "eager",
        "profile": None,
        "device": "cuda",
    }
    pristine = tree_hashes(verl_pristine)
    now = tree_hashes(verl_tree)
    for rel, rec in manifest["files"].items():
        assert rec["original_sha256"] == pristine[rel]
        assert rec["patched_sha256"] == now[rel]
        assert now[f"{patcher.ORIGINALS_DIR}/{rel}"] == pristine[rel]
    assert manifest["added"][patcher.COMPAT_REL]["sha256"] == now[patcher.COMPAT_REL]
    compat = (verl_tree / patcher.COMPAT_REL).read_text()
    assert 'BAKED_COMPUTE_DTYPE = "fp16"' in compat
    assert 'BAKED_ATTN_IMPLEMENTATION = "eager"' in compat


def _import_script(force_cuda: bool) -> str:
    lines = [
        "import importlib, importlib.util, sys",
        "assert importlib.util.find_spec('flash_attn') is None, 'flash_attn is importable'",
        "import torch",
    ]
    if force_cuda:
        # Take the `if is_cuda_available:` branches, where the flash_attn imports are.
        lines.append("torch.cuda.is_available = lambda: True")
    lines += [
        f"for name in {list(PATCHED_MODULES)!r}:",
        "    importlib.import_module(name)",
        "import verl.workers.actor.dp_actor as a",
        "print(getattr(a, 'pad_input', None).__module__ if hasattr(a, 'pad_input') else 'none')",
    ]
    return "\n".join(lines)


@needs_torch
def test_patched_package_imports_without_flash_attn(verl_tree: Path, capsys) -> None:
    pristine = run_in_tree(verl_tree, _import_script(force_cuda=True))
    assert pristine.returncode != 0 and "flash_attn" in pristine.stderr  # the test bites
    patch_cli(capsys, str(verl_tree))
    plain = run_in_tree(verl_tree, "import verl.workers.fsdp_workers\n" + _import_script(False))
    assert plain.returncode == 0, plain.stderr[-3000:]
    forced = run_in_tree(verl_tree, _import_script(force_cuda=True))
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert forced.stdout.strip().splitlines()[-1] == "verl.utils.oldgpu_compat"


@needs_torch
def test_compat_values_and_env_override(verl_tree: Path, capsys, monkeypatch) -> None:
    import torch

    patch_cli(capsys, str(verl_tree))
    spec = importlib.util.spec_from_file_location("oldgpu_compat_t", verl_tree / patcher.COMPAT_REL)
    compat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compat)
    monkeypatch.delenv("OLDGPU_COMPUTE_DTYPE", raising=False)
    monkeypatch.delenv("OLDGPU_ATTN_IMPLEMENTATION", raising=False)
    assert compat.compute_dtype() is torch.float32
    assert compat.autocast_enabled() is False and compat.autocast_dtype() is None
    assert compat.attn_implementation() == "sdpa"
    expected = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    for name, dtype in expected.items():
        monkeypatch.setenv("OLDGPU_COMPUTE_DTYPE", name)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # fp32 must not trip "target dtype is not supported"
            with torch.autocast(
                device_type="cpu",
                dtype=compat.autocast_dtype(),
                enabled=compat.autocast_enabled(),
            ):
                out = torch.randn(3, 4) @ torch.randn(4, 2)
        assert out.dtype is dtype
    monkeypatch.setenv("OLDGPU_ATTN_IMPLEMENTATION", "eager")
    assert compat.attn_implementation() == "eager"
    monkeypatch.setenv("OLDGPU_COMPUTE_DTYPE", "int8")
    with pytest.raises(ValueError, match="OLDGPU_COMPUTE_DTYPE"):
        compat.compute_dtype()


def test_revert_is_byte_identical(verl_tree: Path, verl_pristine: Path, capsys) -> None:
    patch_cli(capsys, str(verl_tree))
    assert tree_hashes(verl_tree) != tree_hashes(verl_pristine)
    code, out = patch_cli(capsys, str(verl_tree), "--revert")
    assert code == 0 and out["changed"] is True
    assert tree_hashes(verl_tree) == tree_hashes(verl_pristine)  # same files, same bytes
    assert not (verl_tree / patcher.ORIGINALS_DIR).exists()
    code, out = patch_cli(capsys, str(verl_tree), "--revert")
    assert code == 0 and out["changed"] is False


def test_second_patch_changes_nothing(verl_tree: Path, capsys) -> None:
    patch_cli(capsys, str(verl_tree))
    state = tree_state(verl_tree)
    code, out = patch_cli(capsys, str(verl_tree))
    assert code == 0 and out["changed"] is False
    assert {f["status"] for f in out["files"]} == {"unchanged"}
    assert tree_state(verl_tree) == state  # not even rewritten


def test_check(verl_tree: Path, capsys) -> None:
    state = tree_state(verl_tree)
    code, out = patch_cli(capsys, str(verl_tree), "--check")
    assert code == 1 and out["changed"] is True
    assert tree_state(verl_tree) == state
    patch_cli(capsys, str(verl_tree))
    code, out = patch_cli(capsys, str(verl_tree), "--check")
    assert code == 0 and out["changed"] is False
    # Other options than the tree was patched with: changes needed.
    code, _ = patch_cli(capsys, str(verl_tree), "--check", "--attn-implementation", "eager")
    assert code == 1


def test_diff_changes_nothing(verl_tree: Path, capsys) -> None:
    state = tree_state(verl_tree)
    code = cli.main(["patch", str(verl_tree), "--diff"])
    text = capsys.readouterr().out
    assert code == 0
    assert "--- a/verl/workers/actor/dp_actor.py" in text
    assert "+++ b/verl/workers/actor/dp_actor.py" in text
    assert (
        "-        with torch.autocast(device_type=self.device_name, dtype=torch.bfloat16):" in text
    )
    assert "+++ b/verl/utils/oldgpu_compat.py" in text
    assert tree_state(verl_tree) == state


def test_switching_options_is_revert_then_apply(
    verl_tree: Path, verl_pristine: Path, capsys
) -> None:
    patch_cli(capsys, str(verl_tree))
    code, out = patch_cli(capsys, str(verl_tree), "--attn-implementation", "eager")
    assert code == 0 and out["changed"] is True
    changed = {f["path"] for f in out["files"] if f["status"] != "unchanged"}
    assert changed == {patcher.COMPAT_REL}  # the sites call into the module; only it differs
    assert 'BAKED_ATTN_IMPLEMENTATION = "eager"' in (verl_tree / patcher.COMPAT_REL).read_text()
    manifest = json.loads((verl_tree / patcher.MANIFEST_NAME).read_text())
    assert manifest["options"]["attn_implementation"] == "eager"
    patch_cli(capsys, str(verl_tree), "--revert")
    assert tree_hashes(verl_tree) == tree_hashes(verl_pristine)


def test_tampered_tree_ispatch_refused(verl_tree: Path, capsys) -> None:
    patch_cli(capsys, str(verl_tree))
    actor = verl_tree / "verl/workers/actor/dp_actor.py"
    actor.write_bytes(actor.read_bytes() + b"# a hand edit\n")
    err = patch_refused(capsys, verl_tree, "tree-modified")
    assert "dp_actor.py" in err["message"]
    patch_refused(capsys, verl_tree, "tree-modified", "--revert")
    patch_refused(capsys, verl_tree, "tree-modified", "--check")


def test_unknown_version_ispatch_refused(verl_tree: Path, capsys) -> None:
    (verl_tree / "verl/version/version").write_text("0.4.9\n")
    err = patch_refused(capsys, verl_tree, "verl-version-unsupported")
    assert "0.4.9" in err["message"] and "0.5.0" in err["message"]


@pytest.fixture
def extra_patch_sets(tmp_path: Path, monkeypatch):
    """A second directory on the patch package's path, for modules a test adds."""
    extra = tmp_path / "patch-sets"
    extra.mkdir()
    monkeypatch.setattr(patcher, "__path__", [*patcher.__path__, str(extra)])
    registry.registry.cache_clear()
    yield extra
    registry.registry.cache_clear()
    for name in [m for m in sys.modules if m.startswith("oldgpu.patch.verl_9")]:
        del sys.modules[name]


def test_registry_finds_version_modules_by_name(extra_patch_sets: Path) -> None:
    assert registry.patch_set_modules() == [
        "oldgpu.patch.verl_0_5_0.base",
        "oldgpu.patch.verl_0_5_0.base16",
        "oldgpu.patch.verl_0_5_0.cpu",
        "oldgpu.patch.verl_0_5_0.fp16",
        "oldgpu.patch.verl_0_5_0.logits",
        "oldgpu.patch.verl_0_9_0.base",
        "oldgpu.patch.verl_0_9_0.base16",
        "oldgpu.patch.verl_0_9_0.cpu",
        "oldgpu.patch.verl_0_9_0.logits",
        "oldgpu.patch.verl_0_9_0.rollout",
    ]
    (extra_patch_sets / "verl_9_9_9").mkdir()
    (extra_patch_sets / "verl_9_9_9" / "__init__.py").write_text("")
    (extra_patch_sets / "verl_9_9_9" / "base.py").write_text(
        "from oldgpu.patch.sitepatch import SitePatch\n\n\n"
        "class Later(SitePatch):\n"
        '    name = "later-fix"\n'
        '    versions = frozenset({"9.9.9"})\n'
        '    sites = (("verl/x.py", "<module>", 1),)\n\n\n'
        "PATCHES = (Later(),)\n"
    )
    # Neither a loose module nor a package not named for a release is a patch set.
    (extra_patch_sets / "verl_9_9_8.py").write_text("raise SystemExit('not a patch set')\n")
    (extra_patch_sets / "notes").mkdir()
    (extra_patch_sets / "notes" / "__init__.py").write_text("raise SystemExit('not one')\n")
    assert patcher.supported_versions() == ["0.5.0", "0.9.0", "9.9.9"]
    (later,) = patcher.select_patches("9.9.9", patcher.Options())
    assert (later.name, later.files) == ("later-fix", ("verl/x.py",))
    # The dtype set, the two HF-rollout fixes GRPO and LoRA need, the logits set and the
    # 16-bit LoRA base's two sites.
    assert len(patcher.select_patches("0.5.0", patcher.Options())) == 11


def test_registry_refuses_a_version_module_without_patches(extra_patch_sets: Path) -> None:
    (extra_patch_sets / "verl_9_9_9").mkdir()
    (extra_patch_sets / "verl_9_9_9" / "__init__.py").write_text("")
    (extra_patch_sets / "verl_9_9_9" / "extra.py").write_text("PATCHES = ['not a patch']\n")
    with pytest.raises(RuntimeError, match=r"verl_9_9_9\.extra must export PATCHES"):
        patcher.supported_versions()


def test_version_changed_after_patching_ispatch_refused(verl_tree: Path, capsys) -> None:
    patch_cli(capsys, str(verl_tree))
    (verl_tree / "verl/version/version").write_text("0.4.9\n")
    patch_refused(capsys, verl_tree, "tree-modified")


def _drop_autocast_line(tree: Path) -> None:
    critic = tree / "verl/workers/critic/dp_critic.py"
    lines = critic.read_text().splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if "torch.autocast(" in line]
    assert len(hits) == 1
    del lines[hits[0]]
    critic.write_text("".join(lines))


def test_site_not_found_deleted_line(verl_tree: Path, capsys) -> None:
    # The with body then joins the `if "multi_modal_inputs"` block above: it still parses.
    _drop_autocast_line(verl_tree)
    err = patch_refused(capsys, verl_tree, "site-not-found")
    assert err["message"].startswith(
        "patch autocast-compute-dtype: verl/workers/critic/dp_critic.py"
    )


def test_unparsable_file_ispatch_refused(verl_tree: Path, capsys) -> None:
    critic = verl_tree / "verl/workers/critic/dp_critic.py"
    critic.write_bytes(critic.read_bytes() + b"def broken(:\n")
    err = patch_refused(capsys, verl_tree, "verl-source-unparsable")
    assert "verl/workers/critic/dp_critic.py" in err["message"]
    assert "autocast-compute-dtype" in err["message"]


def test_site_not_found_changed_shape(verl_tree: Path, capsys) -> None:
    critic = verl_tree / "verl/workers/critic/dp_critic.py"
    text = critic.read_text()
    old = "torch.autocast(device_type=self.device_name, dtype=torch.bfloat16)"
    assert text.count(old) == 1
    critic.write_text(text.replace(old, "contextlib.nullcontext()"))
    err = patch_refused(capsys, verl_tree, "site-not-found")
    assert err["message"].startswith(
        "patch autocast-compute-dtype: verl/workers/critic/dp_critic.py"
    )
    assert "DataParallelPPOCritic._forward_micro_batch" in err["message"]


def test_patched_tree_without_manifest_ispatch_refused(verl_tree: Path, capsys) -> None:
    patch_cli(capsys, str(verl_tree))
    (verl_tree / patcher.MANIFEST_NAME).unlink()
    patch_refused(capsys, verl_tree, "tree-patched-without-manifest")


@pytest.mark.parametrize(
    ("where", "nth"),
    [("replace", 1), ("replace", 6), ("replace", 14), ("fsync", 4)],
)
def test_failed_write_rolls_back(
    verl_tree: Path, verl_pristine: Path, monkeypatch, where: str, nth: int
) -> None:
    plan = patcher.plan_patch(verl_tree, patcher.Options())
    assert len([op for op in plan.ops if op.new is not None]) == 14  # 6 originals, manifest, 7
    module = transaction.os  # fsync 4: the second staged file's (after the journal's two)
    real = getattr(module, where)
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == nth:  # once: the rollback's own writes go through
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, where, flaky)
    with pytest.raises(EngineError) as exc:
        patcher.commit(plan)
    assert exc.value.name == "patch-write-failed"
    assert ("rolled back" if where == "replace" else "nothing was changed") in exc.value.message
    assert tree_hashes(verl_tree) == tree_hashes(verl_pristine)  # no temp files either


def _generate_sequences(tree: Path) -> ast.FunctionDef:
    module = ast.parse((tree / "verl/workers/fsdp_workers.py").read_bytes())
    (cls,) = [
        n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "ActorRolloutRefWorker"
    ]
    (fn,) = [
        n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "generate_sequences"
    ]
    return fn


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name | ast.Attribute)
        and (getattr(n.func, "id", None) or getattr(n.func, "attr", None)) == name
    ]  # fmt: skip


def test_hf_rollout_loads_actor_before_and_offloads_after(verl_tree: Path, capsys) -> None:
    assert _calls(_generate_sequences(verl_tree), "load_fsdp_model_to_gpu") == []  # upstream gap
    patch_cli(capsys, str(verl_tree))
    fn = _generate_sequences(verl_tree)
    (generate,) = _calls(fn, "generate_sequences")
    (load,) = _calls(fn, "load_fsdp_model_to_gpu")
    (offload,) = _calls(fn, "offload_fsdp_model_to_cpu")
    assert load.lineno < generate.lineno < offload.lineno
    for call in (load, offload):
        assert ast.unparse(call).endswith("(self.actor_module_fsdp)")
    # Only with param offload and the hf rollout (vLLM/SGLang sharding managers do it).
    (flag,) = [
        n
        for n in fn.body
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "oldgpu_reload_actor"
    ]
    assert ast.unparse(flag.value) == "self._is_offload_param and self.config.rollout.name == 'hf'"
    # The offload is after the whole rollout block, at function level.
    (block,) = [n for n in fn.body if isinstance(n, ast.With)]
    assert block.end_lineno < offload.lineno


def test_not_a_verl_tree(tmp_path: Path, capsys) -> None:
    code = cli.main(["patch", str(tmp_path), "--json"])
    assert code == 2
    assert json.loads(capsys.readouterr().out)["error"] == "not-a-verl-tree"


def test_profile_gives_the_options(verl_tree: Path, capsys) -> None:
    code, out = patch_cli(capsys, str(verl_tree), "--profile", "pascal-6.1", "--check")
    assert code == 1
    assert out["options"] == {
        "compute_dtype": "fp32",
        "attn_implementation": "sdpa",
        "profile": "pascal-6.1",
        "device": "cuda",
    }
    argv = ("--profile", "ampere", "--attn-implementation", "sdpa")
    code, out = patch_cli(capsys, str(verl_tree), *argv)
    assert code == 0
    assert (out["options"]["compute_dtype"], out["options"]["attn_implementation"]) == (
        "bf16",
        "sdpa",  # the flag wins over the profile
    )
    compat = (verl_tree / patcher.COMPAT_REL).read_text()
    assert 'BAKED_COMPUTE_DTYPE = "bf16"' in compat
    patch_refused(capsys, verl_tree, "profile-unknown", "--profile", "nosuch")
