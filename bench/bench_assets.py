"""The benchmark's assets, built offline on the machine: a model of a given shape with
random weights (fp32) and a tokenizer from ``oldgpu smoke-assets``' builder, and a
GSM8K-shaped parquet in the engine's layout (``oldgpu data``) whose prompts are padded
towards the prompt length; or ``oldgpu smoke-assets``' model and data themselves.

    HOME/assets/KIND/{model,data,assets.json}     # written once, reused when complete
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from oldgpu import data as gsm8k
from oldgpu import plan as planner
from oldgpu import smoke

# -- assets -------------------------------------------------------------------------------

QWEN25 = {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
KINDS: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B's and -1.5B's config shapes (the planner's table); the tokenizer is
    # smaller than their vocabulary: ids stay below it, the rows past it are never read.
    "bench": {"shape": "qwen2.5-0.5b", "prompt": 256, "response": 256, "rows": 640},
    "bench-1.5b": {"shape": "qwen2.5-1.5b", "prompt": 256, "response": 256, "rows": 640},
    "bench-3b": {"shape": "qwen2.5-3b", "prompt": 256, "response": 256, "rows": 640},
    # Qwen2.5-7B's shape, written as a bf16 checkpoint (as Qwen's own are): the LoRA job
    # stores it at 16 bits (base_dtype) and computes in fp32.
    "bench-7b": {
        "shape": "qwen2.5-7b",
        "prompt": 256,
        "response": 256,
        "rows": 640,
        "dtype": "bfloat16",
    },
    # The LoRA learning check's model (issue 35): Qwen2.5-0.5B's shape with the learn
    # kind's prompt and response, its vocabulary the tokenizer's (a random policy over
    # 152K ids would rarely sample a real token), a bf16 checkpoint so that the fp32 base
    # and the base stored at bf16 start from the same weights.
    "learn-0.5b": {
        "shape": "qwen2.5-0.5b",
        "vocab": "tokenizer",
        "prompt": 64,
        "response": 32,
        "rows": 640,
        "dtype": "bfloat16",
    },
    "learn": {
        "model": dict(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=704,
            max_position_embeddings=1024,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        "prompt": 64,
        "response": 32,
        "rows": 640,
    },
    # What ``oldgpu smoke-assets`` builds; the prompt and response of the smoke job.
    "smoke": {"prompt": 128, "response": 16, "rows": smoke.DEFAULT_ROWS},
}
FILLER = (
    "The market opens at 9 in the morning and closes at 5 in the evening.",
    "Every box on the shelf is the same size and holds the same number of things.",
    "Nobody else takes or adds anything while this happens.",
    "The question only asks about the total at the very end of the day.",
    "Some of the numbers in this story do not matter for the answer.",
    "Think about each step before writing the final number.",
    "There are 7 days in a week and 12 months in a year.",
    "A dozen means 12, and half a dozen means 6.",
    "The weather was sunny, and the streets were busy with people.",
    "All the prices are in whole dollars.",
)
CONFIG_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)


def model_shape(kind: str) -> dict[str, Any]:
    spec = KINDS[kind]
    if "shape" not in spec:
        return dict(spec["model"])
    s = planner.SHAPES[spec["shape"]]
    keys = [k for k in CONFIG_KEYS if not (k == "vocab_size" and spec.get("vocab") == "tokenizer")]
    return {
        **{k: getattr(s, k) for k in keys},
        "max_position_embeddings": s.max_position_embeddings,
        **QWEN25,
    }


def prompt_tokens(tokenizer: Any, content: str) -> int:
    messages = [{"role": "user", "content": content}]
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def pad_question(tokenizer: Any, question: str, target: int, rng: random.Random) -> str:
    """Append filler sentences while the chat prompt stays within ``target`` tokens."""
    text = question
    while True:
        longer = f"{text} {rng.choice(FILLER)}"
        if prompt_tokens(tokenizer, f"{longer} {gsm8k.INSTRUCTION}") > target:
            return text
        text = longer


def build_model(shape: dict[str, Any], tokenizer: Any, seed: int, dtype: str = "float32") -> Any:
    """A Qwen2 of ``shape`` with random weights in ``dtype``, built on the GPU when there
    is one (a 7B shape in fp32 is 30 GB: built at its checkpoint's 16 bits directly)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    pad_id = tokenizer.convert_tokens_to_ids(smoke.PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(smoke.EOS_TOKEN)
    shape = dict(shape)
    shape.setdefault("vocab_size", len(tokenizer))
    config = Qwen2Config(
        **shape,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype=dtype,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=shape["num_hidden_layers"],
    )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model = model.to("cpu")
    if torch.cuda.is_available():
        # The benchmark's own process keeps its CUDA context for the runs after this: its
        # cache need not stay too (it counted 3,130 MiB in the device-wide peak).
        torch.cuda.empty_cache()
    return model


def build_assets(kind: str, home: Path, seed: int = 0) -> dict[str, Any]:
    """HOME/assets/KIND/{model,data}: written once; a complete one is reused."""
    spec = KINDS[kind]
    out = home / "assets" / kind
    done = out / "assets.json"
    if done.exists():
        return json.loads(done.read_text())
    t0 = time.time()
    if kind == "smoke":
        built = smoke.build(out, spec["rows"], seed)
        model_dir = Path(built["model"]["path"])
        files = {split: Path(d["path"]) for split, d in built["data"].items()}
        params, lengths = built["model"]["parameters"], []
        tokenizer_size = built["model"]["vocab_size"]
    else:
        rng = random.Random(seed)
        splits = smoke.problems(spec["rows"], seed)
        texts = [f"{p['question']} {gsm8k.INSTRUCTION}" for rows in splits.values() for p in rows]
        texts += [p["answer"] for rows in splits.values() for p in rows] + list(FILLER) * 20
        tokenizer = smoke.build_tokenizer(texts)
        model = build_model(model_shape(kind), tokenizer, seed, spec.get("dtype", "float32"))
        model_dir = out / "model"
        tokenizer.save_pretrained(model_dir)
        model.save_pretrained(model_dir, safe_serialization=True)
        params = sum(p.numel() for p in model.parameters())
        del model
        # Prompts padded towards the prompt length (verl left-pads to it).
        target = spec["prompt"] - 2 if kind.startswith("bench") else spec["prompt"] // 2
        files, lengths = {}, []
        for split, rows in splits.items():
            padded = [
                dict(p, question=pad_question(tokenizer, p["question"], target, rng)) for p in rows
            ]
            lengths += [
                prompt_tokens(tokenizer, f"{p['question']} {gsm8k.INSTRUCTION}") for p in padded
            ]
            files[split] = out / "data" / f"{split}.parquet"
            gsm8k.write_parquet(gsm8k.verl_rows(padded, split), files[split])
        tokenizer_size = len(tokenizer)
    config = json.loads((model_dir / "config.json").read_text())
    doc = {
        "kind": kind,
        "model": str(model_dir),
        "train": str(files["train"]),
        "test": str(files["test"]),
        "params": params,
        "config": {k: config[k] for k in CONFIG_KEYS},
        "tokenizer_size": tokenizer_size,
        "prompt_tokens": {
            "min": min(lengths),
            "mean": round(statistics.mean(lengths), 1),
            "max": max(lengths),
        }
        if lengths
        else None,
        "prompt_length": spec["prompt"],
        "response_length": spec["response"],
        "seconds": round(time.time() - t0, 1),
    }
    done.write_text(json.dumps(doc, indent=1))
    return doc
