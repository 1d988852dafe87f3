"""``oldgpu guard``: the P40 guard, on CPU (the watched device made ``cpu`` for tests)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from oldgpu import guard
from oldgpu.output import EngineError

SRC = guard.SITE_DIR.parents[1]  # src/, on the child processes' path


# -- the policy (no torch needed) -------------------------------------------------------


def test_unset_or_off_means_no_guard() -> None:
    assert guard.policy_from_env({}) is None
    for value in ("", "0", "off", "no", "false", " OFF "):
        assert guard.policy_from_env({guard.ENV_GUARD: value}) is None


def test_pascal_policy() -> None:
    p = guard.policy_from_env({guard.ENV_GUARD: "pascal"})
    assert p is not None
    assert (p.profile, p.compute_capability, p.gpu_name) == ("pascal-6.1", "6.1", "Tesla P40")
    assert p.forbidden_dtypes == ("bfloat16", "float16")  # the profile's dtype is fp32
    assert not (p.tf32 or p.flash_sdp or p.cudnn_sdp or p.torch_compile or p.flash_attn)
    assert p.mem_efficient_sdp  # sm50+
    assert p.memory_mib == 23040  # 22.5 GiB of the P40's 24
    assert (p.device, p.dtype_check, p.ops_steps, p.log) == ("cuda", "ops", 0, None)
    assert guard.policy_from_env({guard.ENV_GUARD: "1"}) == p
    assert guard.policy_from_env({guard.ENV_GUARD: "pascal-6.1"}) == p


def test_policy_variables() -> None:
    env = {
        guard.ENV_GUARD: "pascal",
        guard.ENV_DTYPE: "fp16",
        guard.ENV_MEMORY: "11264",
        guard.ENV_DEVICE: "cpu",
        guard.ENV_DTYPE_CHECK: "conversions",
        guard.ENV_OPS_STEPS: "8",
        guard.ENV_LOG: "/tmp/x.log",
    }
    p = guard.policy_from_env(env)
    assert p.forbidden_dtypes == ("bfloat16",)
    assert (p.memory_mib, p.device, p.dtype_check, p.ops_steps, p.log) == (
        11264,
        "cpu",
        "conversions",
        8,
        "/tmp/x.log",
    )
    assert (
        guard.policy_from_env({guard.ENV_GUARD: "pascal", guard.ENV_MEMORY: "0"}).memory_mib is None
    )


def test_other_old_profiles() -> None:
    volta = guard.policy_for("volta")
    assert volta.torch_compile and not volta.flash_attn and not volta.tf32
    assert volta.gpu_name.startswith("Tesla V100")
    # fp16 profiles: fp16 allowed, bf16 refused; the card's memory (32 GB V100, 16 GB T4).
    assert (volta.compute_dtype, volta.forbidden_dtypes) == ("fp16", ("bfloat16",))
    assert volta.memory_mib == 32 * 1024 - 1536
    turing = guard.policy_for("turing-7.5")
    assert (turing.compute_dtype, turing.forbidden_dtypes) == ("fp16", ("bfloat16",))
    assert turing.memory_mib == 16 * 1024 - 1536 and not turing.flash_attn
    # The fp32 baseline on a V100: fp16 refused too.
    fp32 = guard.policy_from_env({guard.ENV_GUARD: "volta", guard.ENV_DTYPE: "fp32"})
    assert fp32.forbidden_dtypes == ("bfloat16", "float16")
    kepler = guard.policy_for("kepler")
    assert not kepler.mem_efficient_sdp  # below sm50: math only
    assert guard.policy_for("pascal-6.0").gpu_name.startswith("Tesla P100")


@pytest.mark.parametrize(
    ("env", "error"),
    [
        ({guard.ENV_GUARD: "ampere"}, "guard-profile-unsupported"),
        ({guard.ENV_GUARD: "cpu"}, "guard-profile-unsupported"),
        ({guard.ENV_GUARD: "gtx"}, "guard-profile-unknown"),
        ({guard.ENV_GUARD: "pascal", guard.ENV_DTYPE: "bf16"}, "guard-dtype-invalid"),
        ({guard.ENV_GUARD: "pascal", guard.ENV_DTYPE_CHECK: "x"}, "guard-dtype-check-invalid"),
        ({guard.ENV_GUARD: "pascal", guard.ENV_MEMORY: "lots"}, "guard-memory-invalid"),
        ({guard.ENV_GUARD: "pascal", guard.ENV_OPS_STEPS: "x"}, "guard-ops-steps-invalid"),
    ],
)
def test_policy_refusals(env: dict[str, str], error: str) -> None:
    with pytest.raises(EngineError) as exc:
        guard.policy_from_env(env)
    assert exc.value.name == error


def test_memory_fraction() -> None:
    gib = 1024**3
    assert guard.memory_fraction(23040, 141 * gib) == pytest.approx(22.5 / 141)
    assert guard.memory_fraction(23040, 16 * gib) == 1.0  # never above the device
    assert guard.memory_fraction(23040, 0) == 1.0


def test_environment_puts_the_site_dir_first(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", f"/a{os.pathsep}{guard.SITE_DIR}{os.pathsep}/b")
    env = guard.environment("pascal", "/tmp/g.log")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(guard.SITE_DIR), "/a", "/b"]
    assert env[guard.ENV_GUARD] == "pascal" and env[guard.ENV_LOG] == "/tmp/g.log"
    assert (guard.SITE_DIR / "sitecustomize.py").is_file()


# -- flash-attn looks uninstalled (no torch needed) --------------------------------------


@pytest.fixture
def fake_flash_attn(tmp_path, monkeypatch) -> Path:
    """An importable flash_attn package with metadata, as where it is installed."""
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = '2.7.4'\n")
    (pkg / "bert_padding.py").write_text("def pad_input(*a):\n    return a\n")
    (tmp_path / "flash_attn_2_cuda.py").write_text("")
    dist = tmp_path / "flash_attn-2.7.4.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flash_attn\nVersion: 2.7.4\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    for name in [n for n in sys.modules if n.startswith("flash_attn")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


@pytest.fixture
def no_torch_guard():
    """The guard with its import-time parts only (torch not armed by it here)."""
    guard.uninstall()
    policy = guard.policy_for("pascal", device="cpu", memory_mib=None)
    yield policy
    guard.uninstall()
    for name in [n for n in sys.modules if n.startswith("flash_attn")]:
        del sys.modules[name]


def test_flash_attn_blocked(fake_flash_attn, no_torch_guard) -> None:
    assert importlib.util.find_spec("flash_attn") is not None  # really there
    assert importlib.metadata.version("flash_attn") == "2.7.4"
    importlib.import_module("flash_attn")
    del sys.modules["flash_attn"]
    guard._STATE.policy = no_torch_guard
    guard._STATE.installed = True
    guard._block_flash_attn()
    for name in ("flash_attn", "flash_attn.bert_padding", "flash_attn_2_cuda"):
        with pytest.raises(ModuleNotFoundError, match="No module named 'flash_attn"):
            importlib.import_module(name)
    assert importlib.util.find_spec("flash_attn") is None  # what transformers asks
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("flash-attn")
    # verl's guarded import (oldgpu patch's flash-attn-import-guard) takes its fallback.
    namespace: dict = {}
    exec(
        "try:\n    from flash_attn.bert_padding import pad_input\n"
        "except ImportError:\n    pad_input = 'fallback'\n",
        namespace,
    )
    assert namespace["pad_input"] == "fallback"
    importlib.import_module("json")  # everything else imports as before
    guard.uninstall()
    assert importlib.util.find_spec("flash_attn") is not None


def test_triton_message_is_inductors() -> None:
    message = guard.triton_too_old_message("Tesla P40", "6.1")
    assert message.startswith("Found Tesla P40 which is too old")
    assert message.endswith("but your device is of CUDA capability 6.1")
    torch = pytest.importorskip("torch")
    # torch 2.6 raises it in _inductor/scheduler.py, newer ones in _inductor/exc.py
    # (GPUTooOldForTriton), in pieces of string literals.
    inductor = Path(torch.__file__).parent / "_inductor"
    sources = [p for p in (inductor / "scheduler.py", inductor / "exc.py") if p.is_file()]
    if not sources:
        pytest.skip("this torch has no inductor source")
    text = "".join(p.read_text(encoding="utf-8") for p in sources)
    for piece in (
        "which is too old to be supported by the triton GPU compiler, ",
        "which is used as the backend. Triton only supports devices of CUDA Capability >= 7.0, ",
        "but your device is of CUDA capability ",
    ):
        assert piece.strip() in text
        assert piece in message + " "


# -- torch, in this process (watched device: cpu) ----------------------------------------


@pytest.fixture
def armed(tmp_path):
    torch = pytest.importorskip("torch")
    guard.uninstall()
    log = tmp_path / "guard.jsonl"
    policy = guard.policy_for("pascal", device="cpu", memory_mib=None, log=str(log))
    guard.install(policy)
    assert guard._STATE.torch_armed
    yield torch, log
    guard.uninstall()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def events(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_bf16_and_fp16_tensors_raise_with_op_and_site(armed) -> None:
    torch, log = armed
    x = torch.ones(4)
    assert (x * 2).dtype == torch.float32  # fp32 is the policy's
    with pytest.raises(guard.GuardViolation) as exc:
        x.to(torch.bfloat16)
    err = exc.value
    assert err.name == "guard-dtype"
    assert err.op == "aten._to_copy.default"
    assert "test_guard.py" in err.site and "test_bf16_and_fp16" in err.site
    assert "Tesla P40" in str(err) and "bfloat16" in str(err)
    with pytest.raises(guard.GuardViolation, match=r"aten\.zeros"):
        torch.zeros(2, 2, dtype=torch.float16)  # factory functions too
    with pytest.raises(guard.GuardViolation):
        torch.nn.Linear(4, 4).half()  # modules
    with pytest.raises(guard.GuardViolation):
        torch.ones(2, dtype=torch.bfloat16)
    kinds = [e["kind"] for e in events(log) if e["event"] == "violation"]
    assert kinds == ["guard-dtype"] * 4
    assert next(e["event"] for e in events(log)) == "armed"


def test_fp16_allowed_when_the_policy_is_fp16(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    guard.uninstall()
    guard.install(guard.policy_for("pascal", device="cpu", memory_mib=None, compute_dtype="fp16"))
    try:
        assert torch.ones(2).half().dtype == torch.float16
        with pytest.raises(guard.GuardViolation):
            torch.ones(2).bfloat16()
    finally:
        guard.uninstall()


def test_a_16bit_base_may_be_stored_and_converted_but_not_computed_in() -> None:
    """OLDGPU_GUARD_STORAGE_DTYPES=bf16 (a LoRA job's base_dtype): a P40 can hold and
    convert bf16 (bit moves), never multiply, attend or reduce in it."""
    torch = pytest.importorskip("torch")
    guard.uninstall()
    env = {"OLDGPU_GUARD": "pascal", "OLDGPU_GUARD_DEVICE": "cpu", "OLDGPU_GUARD_MEMORY_MIB": "0"}
    guard.install(guard.policy_from_env({**env, "OLDGPU_GUARD_STORAGE_DTYPES": "bf16"}))
    try:
        w = torch.randn(8, 8).to(torch.bfloat16)  # stored at 16 bits
        flat = torch.cat([w.view(-1), w.t().reshape(-1)])  # FSDP flattens it
        up = flat[:64].view(8, 8).float()  # and upcasts a unit just in time
        assert up.dtype == torch.float32 and torch.equal(up, w.float())
        x = torch.randn(2, 8)
        assert (x @ up).dtype == torch.float32  # fp32 math on the upcast copy
        arithmetic = [
            lambda: w @ w,
            lambda: torch.nn.functional.linear(x.bfloat16(), w),
            lambda: w.sum(),
            lambda: w * 2,
            lambda: torch.softmax(w, -1),  # attention's core (CPU's SDPA upcasts bf16 itself)
            lambda: torch.bmm(w[None], w[None]),
        ]
        for op in arithmetic:
            with pytest.raises(guard.GuardViolation, match="bfloat16 is not allowed"):
                op()
        with pytest.raises(guard.GuardViolation):  # fp16 was not asked for
            torch.ones(2).half()
    finally:
        guard.uninstall()
    with pytest.raises(guard.GuardViolation):  # without the variable, storage is refused too
        guard.install(guard.policy_from_env(env))
        try:
            torch.ones(2).bfloat16()
        finally:
            guard.uninstall()
    with pytest.raises(EngineError, match="expected bf16 and/or fp16"):
        guard.policy_from_env({**env, "OLDGPU_GUARD_STORAGE_DTYPES": "int8"})


def test_other_devices_are_not_watched() -> None:
    torch = pytest.importorskip("torch")
    guard.uninstall()
    guard.install(guard.policy_for("pascal", memory_mib=None))  # watches cuda
    try:
        assert torch.ones(2).bfloat16().dtype == torch.bfloat16  # a CPU tensor: allowed
    finally:
        guard.uninstall()


def test_backward_and_training_in_fp32_pass(armed) -> None:
    torch, log = armed
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    attn = torch.nn.functional.scaled_dot_product_attention(
        torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), is_causal=True
    )
    assert attn.dtype == torch.float32
    assert not [e for e in events(log) if e["event"] == "violation"]


def test_autocast_to_bf16_raises(armed) -> None:
    torch, _log = armed
    with (
        pytest.raises(guard.GuardViolation) as exc,
        torch.autocast(device_type="cpu", dtype=torch.bfloat16),
    ):
        pass
    assert exc.value.name == "guard-autocast"
    with torch.autocast(device_type="cpu", enabled=False):  # verl patched for fp32
        assert (torch.ones(2) @ torch.ones(2)).dtype == torch.float32


def test_torch_compile_raises_pascals_error(armed) -> None:
    torch, _log = armed

    def f(x):
        return x + 1

    compiled = torch.compile(f, dynamic=True)  # like verl's entropy_from_logits
    with pytest.raises(guard.GuardViolation) as exc:
        compiled(torch.ones(2))
    assert exc.value.name == "guard-torch-compile"
    assert "Triton only supports devices of CUDA Capability >= 7.0" in str(exc.value)
    assert "CUDA capability 6.1" in str(exc.value)

    @torch.compile
    def g(x):
        return x * 2

    with pytest.raises(guard.GuardViolation):
        g(torch.ones(2))
    module = torch.compile(torch.nn.Linear(2, 2))
    with pytest.raises(guard.GuardViolation):
        module(torch.ones(1, 2))
    assert torch.compile(f, backend="eager") is not None  # no Triton there


def test_triton_kernels_raise(armed, tmp_path) -> None:
    torch, _ = armed
    pytest.importorskip("triton")
    # @triton.jit reads its source from a file.
    src = tmp_path / "kern.py"
    src.write_text(
        "import triton\n\n@triton.jit\ndef add_one(x_ptr):\n    pass\n", encoding="utf-8"
    )
    spec = importlib.util.spec_from_file_location("kern", src)
    kern = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kern)
    with pytest.raises(guard.GuardViolation) as exc:
        kern.add_one[(1,)](torch.ones(2))
    assert exc.value.name == "guard-triton" and "Triton only supports" in str(exc.value)


def test_tf32_and_sdpa_flags(armed) -> None:
    torch, log = armed
    assert torch.get_float32_matmul_precision() == "highest"
    assert not torch.backends.cuda.matmul.allow_tf32
    assert not torch.backends.cudnn.allow_tf32
    assert not torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.math_sdp_enabled()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.enable_flash_sdp(True)
    assert not torch.backends.cuda.matmul.allow_tf32
    assert not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
    assert not torch.backends.cuda.flash_sdp_enabled()
    ignored = [e["what"] for e in events(log) if e["event"] == "ignored"]
    assert len(ignored) == 4
    assert not [e for e in events(log) if e["event"] == "violation"]  # not violations


def test_new_threads_are_guarded(armed) -> None:
    torch, _log = armed
    caught: list[BaseException] = []

    def work() -> None:
        try:
            torch.ones(3).bfloat16()
        except guard.GuardViolation as exc:
            caught.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert len(caught) == 1 and "in work" in caught[0].site


def test_ops_check_ends_after_the_optimizer_steps(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    guard.uninstall()
    log = tmp_path / "g.jsonl"
    guard.install(
        guard.policy_for("pascal", device="cpu", memory_mib=None, log=str(log), ops_steps=2)
    )
    try:
        lin = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        for _step in range(2):
            with pytest.raises(guard.GuardViolation):
                torch.ones(1).half()
            lin(torch.ones(1, 2)).sum().backward()
            opt.step()
        assert torch.ones(1).half().dtype == torch.float16  # per-op check over
        with pytest.raises(guard.GuardViolation):  # autocast is still guarded
            torch.autocast("cpu", dtype=torch.bfloat16).__enter__()
        ended = [e for e in events(log) if e["event"] == "ops-check-ended"]
        assert len(ended) == 1 and ended[0]["popped"]
    finally:
        guard.uninstall()


def test_a_thread_other_than_the_optimizers_drops_its_mode_after_the_window(tmp_path) -> None:
    """0.9.0's rollout decodes on another thread than the one that steps the optimizer:
    once the window ends, that thread's next module call takes its mode off (no aten op
    of it goes through Python any more), as a real P40 would run it."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    guard.uninstall()
    log = tmp_path / "g.jsonl"
    guard.install(
        guard.policy_for("pascal", device="cpu", memory_mib=None, log=str(log), ops_steps=1)
    )
    ready, go, done = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def rollout() -> None:
        lin = torch.nn.Linear(2, 2)
        lin(torch.ones(1, 2))
        seen["before"] = type(_get_current_dispatch_mode()).__name__
        ready.set()
        go.wait(120)
        seen["between"] = torch.ones(1).half().dtype  # checks off at once
        lin(torch.ones(1, 2))  # the next module call drops the mode
        seen["after"] = _get_current_dispatch_mode()
        done.set()

    try:
        thread = threading.Thread(target=rollout, name="rollout")
        thread.start()
        assert ready.wait(120)  # the rollout thread has used its mode before the window ends
        lin = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        lin(torch.ones(1, 2)).sum().backward()
        opt.step()  # ends the window on this thread
        go.set()
        assert done.wait(120)
        thread.join()
        assert seen == {"before": "DtypeGuardMode", "between": torch.float16, "after": None}
        dropped = [e for e in events(log) if e["event"] == "ops-mode-dropped"]
        assert [e["thread"] for e in dropped] == ["rollout"]
    finally:
        guard.uninstall()


def test_conversions_check(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    guard.uninstall()
    guard.install(
        guard.policy_for("pascal", device="cpu", memory_mib=None, dtype_check="conversions")
    )
    try:
        for convert in (
            lambda t: t.to(torch.bfloat16),
            lambda t: t.half(),
            lambda t: t.bfloat16(),
            lambda t: t.type(torch.float16),
        ):
            with pytest.raises(guard.GuardViolation):
                convert(torch.ones(2))
        with pytest.raises(guard.GuardViolation):
            torch.nn.Linear(2, 2).to(torch.bfloat16)
        assert torch.ones(2).to(torch.float64).dtype == torch.float64
    finally:
        guard.uninstall()


def test_check_reports_and_probes_without_logging(armed) -> None:
    _torch, log = armed
    before = len(events(log))
    doc = guard.check()
    assert doc["active"] and doc["policy"]["profile"] == "pascal-6.1"
    t = doc["torch"]
    assert t["armed"] and not t["sdp_flash"] and not t["cuda_matmul_allow_tf32"]
    assert t["torch_compile_guarded"] and t["dtype_mode_on_this_thread"]
    probes = doc["probes"]
    assert probes["dtype_bfloat16"] == "raises guard-dtype"
    assert probes["dtype_float16"] == "raises guard-dtype"
    assert probes["autocast_bf16"] == "raises guard-autocast"
    assert probes["torch_compile"] == "raises guard-torch-compile"
    assert probes["flash_attn_import"].startswith("blocked")
    assert len(events(log)) == before  # probes are not violations
    assert "Tesla P40" in guard._text(doc)


def test_uninstall_restores(armed) -> None:
    torch, _ = armed
    guard.uninstall()
    assert torch.ones(2).bfloat16().dtype == torch.bfloat16
    assert not getattr(torch.compile, "_oldgpu_guard", False)
    assert torch.backends.cuda.flash_sdp_enabled()
    assert guard.active() is None


# -- activation through the environment, in fresh processes ------------------------------


def _run(code: str, env_extra: dict[str, str], python: str = sys.executable, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLDGPU_GUARD")}
    env["PYTHONPATH"] = os.pathsep.join([str(guard.SITE_DIR), str(SRC)])
    env.update(env_extra)
    return subprocess.run(
        [python, "-c", code], env=env, capture_output=True, text=True, check=False, **kw
    )


CHILD = """
import json, sys
import torch
import oldgpu.guard as g
out = {"active": g.active() is not None}
try:
    torch.ones(2).to(torch.bfloat16)
    out["bf16"] = "allowed"
except Exception as exc:
    out["bf16"] = type(exc).__name__
try:
    import flash_attn
    out["flash_attn"] = "imported"
except ImportError:
    out["flash_attn"] = "blocked"
out["sdp_flash"] = torch.backends.cuda.flash_sdp_enabled()
print(json.dumps(out))
"""


def test_environment_activates_the_guard_in_a_new_process(tmp_path, fake_flash_attn) -> None:
    pytest.importorskip("torch")
    log = tmp_path / "guard.jsonl"
    env = {
        guard.ENV_GUARD: "pascal",
        guard.ENV_DEVICE: "cpu",
        guard.ENV_LOG: str(log),
        guard.ENV_MEMORY: "0",
    }
    env["PYTHONPATH"] = os.pathsep.join([str(guard.SITE_DIR), str(SRC), str(fake_flash_attn)])
    proc = _run(CHILD, env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {
        "active": True,
        "bf16": "GuardViolation",
        "flash_attn": "blocked",
        "sdp_flash": False,
    }
    kinds = [e["event"] for e in events(log)]
    assert kinds[0] == "armed" and "violation" in kinds


def test_unset_leaves_the_process_alone(tmp_path, fake_flash_attn) -> None:
    pytest.importorskip("torch")
    env = {"PYTHONPATH": os.pathsep.join([str(guard.SITE_DIR), str(SRC), str(fake_flash_attn)])}
    proc = _run(CHILD, env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"active": False, "bf16": "allowed", "flash_attn": "imported", "sdp_flash": True}


def test_sitecustomize_is_lazy_and_chains(tmp_path) -> None:
    """The guard never imports torch itself, and the shadowed sitecustomize still runs."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = '1'\n")
    code = "import os, sys; print(os.environ.get('CHAINED'), 'torch' in sys.modules)"
    env = {
        guard.ENV_GUARD: "pascal",
        "PYTHONPATH": os.pathsep.join([str(guard.SITE_DIR), str(SRC), str(other)]),
    }
    python = shutil.which("python3") or sys.executable
    proc = _run(code, env, python=python, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "False"]  # chained; torch never imported
    assert "NOT armed" not in proc.stderr


def test_bad_profile_is_reported_not_fatal(tmp_path) -> None:
    log = tmp_path / "g.jsonl"
    proc = _run("print('up')", {guard.ENV_GUARD: "ampere", guard.ENV_LOG: str(log)})
    assert proc.returncode == 0 and proc.stdout.strip() == "up"
    assert "NOT armed" in proc.stderr
    assert events(log)[0]["event"] == "install-failed"


def test_cli_check_and_env(tmp_path) -> None:
    pytest.importorskip("torch")
    env = {guard.ENV_GUARD: "pascal", guard.ENV_DEVICE: "cpu", guard.ENV_MEMORY: "0"}
    code = "import sys; from oldgpu import cli; sys.exit(cli.main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, "guard", "--check", "--json"],
        env={**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(guard.SITE_DIR), str(SRC)])},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["active"] and doc["sitecustomize_on_path"]
    assert doc["probes"]["dtype_bfloat16"] == "raises guard-dtype"
    proc = subprocess.run(
        [sys.executable, "-c", code, "guard", "--env", "--profile", "pascal", "--json"],
        env={k: v for k, v in os.environ.items() if not k.startswith("OLDGPU_GUARD")}
        | {"PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    env_doc = json.loads(proc.stdout)
    assert env_doc["OLDGPU_GUARD"] == "pascal"
    assert env_doc["PYTHONPATH"].split(os.pathsep)[0] == str(guard.SITE_DIR)


def test_cli_check_inactive_fails() -> None:
    code = "import sys; from oldgpu import cli; sys.exit(cli.main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, "guard", "--check", "--no-probe"],
        env={k: v for k, v in os.environ.items() if not k.startswith("OLDGPU_GUARD")}
        | {"PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert "not active" in proc.stdout


def test_a_violation_survives_pickling_as_ray_sends_it() -> None:
    """A worker's violation reaches the driver whole (Ray pickles exceptions)."""
    import pickle

    err = guard.GuardViolation("guard-dtype", "aten.mm made bf16", op="aten.mm", site="x.py:1")
    back = pickle.loads(pickle.dumps(err))
    assert (back.name, back.message, back.op, back.site) == (
        "guard-dtype",
        "aten.mm made bf16",
        "aten.mm",
        "x.py:1",
    )
