"""Time one rollout pass's decode step on the GPU, alone: the oldgpu-hf decode loop
(rollout/decode.py) with and without its grouped attention and reserved KV cache, and
HF ``generate``, on the bench's Qwen2.5-0.5B-shaped model in fp32, at a GRPO step's
rows. Run it with each release's interpreter (transformers 4.51 for 0.5.0, 5.10 for
0.9.0) after bench/setup.sh:

    source .device/bench/env/env.sh
    $BENCH_PYTHON bench/decode_step.py --label t4            # 0.5.0's packages
    $VERL_VENV_0_9_0/bin/python bench/decode_step.py --label t5

``--python-mode`` adds a pass-through TorchDispatchMode around the pass, as the P40
guard's dtype check leaves on a thread after its window (every aten op through Python).
Writes one JSON line per variant to $OUT/decode_step.jsonl and a profiler table of the
loop as built to $OUT/decode_profile-<label>.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.utils._python_dispatch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from oldgpu.rollout import decode as decode_mod  # noqa: E402
from oldgpu.rollout.sampling import Request  # noqa: E402


class PassThrough(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Off:
    def __enter__(self):
        return False

    def __exit__(self, *exc):
        return False


def requests(rows: int, width: int, steps: int, vocab: int) -> list[Request]:
    rng = random.Random(0)
    out = []
    for _ in range(rows):
        n = rng.randint(width // 3, width)
        prompt = tuple(rng.randrange(100, vocab - 100) for _ in range(n))
        out.append(Request(prompt_ids=prompt, max_tokens=steps, logprobs=True, ignore_eos=True))
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--model", default=str(ROOT / ".device/bench/assets/bench/model"))
    ap.add_argument("--rows", type=int, default=448)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeat", type=int, default=2, help="best of this many timings")
    ap.add_argument("--count-ops", action="store_true",
                    help="count the aten ops a decode step dispatches (no timing)")  # fmt: skip
    args = ap.parse_args()
    import transformers

    out_dir = Path(os.environ.get("OUT", "/tmp"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, torch_dtype=torch.float32, attn_implementation="sdpa"
    )
    dev = torch.device(args.device)
    model = model.to(dev).eval().requires_grad_(False)
    reqs = requests(args.rows, args.width, args.steps, model.config.vocab_size)
    one = [Request(prompt_ids=r.prompt_ids, max_tokens=1, ignore_eos=True) for r in reqs]
    real_attention = decode_mod.grouped_decode_attention
    real_cache = decode_mod.reserved_cache

    def run(grouped: bool, reserved: bool, mode: bool, batch=reqs):
        decode_mod.grouped_decode_attention = real_attention if grouped else _Off
        decode_mod.reserved_cache = real_cache if reserved else (lambda m, c: None)
        ctx = PassThrough() if mode else contextlib.nullcontext()
        with ctx:
            return decode_mod.decode(model, batch, pad_token_id=0, eos_ids=(), device=dev)

    def generate():
        ids, mask = decode_mod.left_padded(reqs, 0, dev)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.steps,
                       min_new_tokens=args.steps, do_sample=True, top_k=0, top_p=1.0,
                       temperature=1.0, pad_token_id=0, use_cache=True)  # fmt: skip

    if args.count_ops:
        return count_ops(run, reqs, args, out_dir)
    variants = [
        ("decode stock", dict(grouped=False, reserved=False, mode=False)),
        ("decode grouped", dict(grouped=True, reserved=False, mode=False)),
        ("decode grouped+reserved", dict(grouped=True, reserved=True, mode=False)),
        ("decode stock, python mode", dict(grouped=False, reserved=False, mode=True)),
        ("decode grouped+reserved, python mode", dict(grouped=True, reserved=True, mode=True)),
    ]
    card = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    with open(out_dir / "decode_step.jsonl", "a") as log:
        for name, kw in variants:
            run(**kw, batch=reqs[:8])  # warm up
            prefill = min(timed(lambda kw=kw: run(**kw, batch=one)) for _ in range(args.repeat))
            total = min(timed(lambda kw=kw: run(**kw)) for _ in range(args.repeat))
            row = {"label": args.label, "variant": name, "rows": args.rows,
                   "steps": args.steps, "prefill_s": round(prefill, 4),
                   "total_s": round(total, 4),
                   "ms_per_step": round(1000 * (total - prefill) / (args.steps - 1), 2),
                   "transformers": transformers.__version__,
                   "torch": torch.__version__,
                   "device": card}  # fmt: skip
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(json.dumps(row), flush=True)
        total = min(timed(generate) for _ in range(args.repeat))
        row = {"label": args.label, "variant": "HF generate", "rows": args.rows,
               "steps": args.steps, "total_s": round(total, 4),
               "ms_per_step": round(1000 * total / args.steps, 2),
               "transformers": transformers.__version__}  # fmt: skip
        log.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    from torch.profiler import ProfilerActivity, profile

    short = [Request(prompt_ids=r.prompt_ids, max_tokens=8, logprobs=True, ignore_eos=True)
             for r in reqs]  # fmt: skip
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        run(grouped=True, reserved=True, mode=False, batch=short)
    by = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=by, row_limit=25)
    (out_dir / f"decode_profile-{args.label}.txt").write_text(table)
    print(table[:6000], flush=True)
    return 0


COUNTED = (
    ("decode stock", {"grouped": False, "reserved": False}),
    ("decode grouped", {"grouped": True, "reserved": False}),
    ("decode grouped+reserved", {"grouped": True, "reserved": True}),
)


def count_ops(run, reqs, args, out_dir: Path) -> int:
    """Aten ops a decode step dispatches, per variant: a counting dispatch mode over a
    pass of 9 and one of 5 tokens, the difference over 4 (the prefill cancels out)."""
    import collections

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    def counted(steps: int, **kw) -> collections.Counter:
        batch = [Request(prompt_ids=r.prompt_ids, max_tokens=steps, logprobs=True,
                         ignore_eos=True) for r in reqs]  # fmt: skip
        with Count() as c:
            run(**kw, mode=False, batch=batch)
        return c.ops

    with open(out_dir / "decode_ops.jsonl", "a") as log:
        for name, kw in COUNTED:
            long, short = counted(9, **kw), counted(5, **kw)
            per = {k: (long[k] - short[k]) / 4 for k in long if long[k] != short[k]}
            row = {"label": args.label, "variant": name, "rows": len(reqs),
                   "ops_per_step": sum(per.values()),
                   "top": sorted(per.items(), key=lambda kv: -kv[1])[:8]}  # fmt: skip
            log.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
