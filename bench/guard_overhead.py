"""The guard's cost on CPU: the same work with the guard off, ``ops``, ``ops`` ended
(what ``OLDGPU_GUARD_OPS_STEPS`` leaves after the first PPO step) and ``conversions``.

Each variant runs in a fresh interpreter (the guard arms at torch's import), with
``OLDGPU_GUARD_DEVICE=cpu`` so that the CPU tensors are the watched ones (every op's
outputs are checked, as on the GPU). Three workloads:

- ``tiny_op``: ``torch.add`` on 8-element tensors, the guard's fixed cost per aten op;
- ``train``: forward + backward of a small random Qwen2 (hidden 256, 4 layers, batch 4,
  sequence 128) with AdamW;
- ``generate``: HF ``generate`` of 32 new tokens, batch 4 (many small ops, like the
  launch-bound decoding on a GPU).

    python bench/guard_overhead.py [--repeat 5] [--rounds 3] [--json OUT.json]

Prints the minimum of each (rounds of fresh processes, interleaved: on a shared host
noise only adds time); ``--json`` writes the raw timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench_run import run_checked

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
SITE = SRC / "oldgpu" / "guard_site"
VARIANTS = ("off", "ops", "ops-ended", "conversions")


def worker(repeat: int) -> dict[str, list[float]]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if os.environ.get("OVERHEAD_END_OPS"):  # what OLDGPU_GUARD_OPS_STEPS leads to
        from oldgpu import guard

        guard.end_ops_check("guard_overhead")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    out: dict[str, list[float]] = {"tiny_op": [], "train": [], "generate": []}
    a, b = torch.ones(8), torch.ones(8)
    n_ops = 20000
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n_ops):
            torch.add(a, b)
        out["tiny_op"].append((time.perf_counter() - t) / n_ops * 1e6)  # us per op
    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1024, (4, 128))
    for i in range(repeat + 1):
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i:  # the first is warm-up
            out["train"].append(time.perf_counter() - t)
    model.eval()
    prompt = torch.randint(0, 1024, (4, 16))
    for i in range(repeat + 1):
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=True,
                pad_token_id=0,
            )
        if i:
            out["generate"].append(time.perf_counter() - t)
    return out


def run_variant(variant: str, repeat: int) -> dict[str, list[float]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SITE), str(SRC), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    )
    env.pop("OLDGPU_GUARD", None)
    env.pop("OVERHEAD_END_OPS", None)
    if variant != "off":
        env.update(
            OLDGPU_GUARD="pascal",
            OLDGPU_GUARD_DEVICE="cpu",
            OLDGPU_GUARD_DTYPE_CHECK="conversions" if variant == "conversions" else "ops",
            OLDGPU_GUARD_MEMORY_MIB="0",
        )
    if variant == "ops-ended":
        env["OVERHEAD_END_OPS"] = "1"
    out = run_checked([sys.executable, __file__, "--worker", str(repeat)], env, variant)
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="timings per process")
    parser.add_argument("--rounds", type=int, default=3, help="processes per variant")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    # Interleaved rounds, and the minimum of all: a shared host's noise only adds time.
    raw: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            for k, x in run_variant(v, args.repeat).items():
                raw[v].setdefault(k, []).extend(x)
    med = {v: {k: min(x) for k, x in r.items()} for v, r in raw.items()}
    units = {"tiny_op": "us/op", "train": "s/iter", "generate": "s/call"}
    print(f"{'workload':10} " + " ".join(f"{v:>12}" for v in VARIANTS) + "   (min; x = vs off)")
    for k in ("tiny_op", "train", "generate"):
        off = med["off"][k]
        cells = [f"{med[v][k]:7.4f} {med[v][k] / off:4.2f}x" for v in VARIANTS]
        print(f"{k:10} " + " ".join(f"{c:>12}" for c in cells) + f"   ({units[k]})")
    if args.json:
        args.json.write_text(json.dumps({"raw": raw, "median": med}, indent=2))


if __name__ == "__main__":
    main()
