"""``oldgpu smoke-assets``: a tiny model and a GSM8K-shaped data set, built offline.

For a real PPO smoke run (CI, the cpu profile) where nothing can be downloaded:

- ``OUT/model``: a random Qwen2 (hidden 64, 2 layers, 4 heads, 2 KV heads, MLP 128,
  tied embeddings; about 100K parameters) in safetensors, with a byte-level BPE
  tokenizer trained here on the generated text. It speaks ChatML like Qwen2-Instruct:
  ``<|im_start|>``/``<|im_end|>``, eos ``<|im_end|>``, pad ``<|endoftext|>``.
- ``OUT/raw/{train,test}.jsonl``: arithmetic word problems in GSM8K's published form
  (``question``, and an ``answer`` ending in ``#### N``).
- ``OUT/data/{train,test}.parquet``: those, through ``oldgpu data gsm8k``'s code.

Everything follows from ``--seed``: the same seed gives byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from oldgpu import data, subcommand
from oldgpu.output import EngineError, Result

REQUIRES = ("torch", "transformers", "tokenizers", "pyarrow")

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)  # ids 0, 1, 2
# Qwen2-Instruct's ChatML, without its default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MODEL_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "tie_word_embeddings": True,
}
MAX_POSITIONS = 512
VOCAB_TARGET = 512  # the trainer stops earlier if the corpus has fewer merges
DEFAULT_ROWS = 48

NAMES = ("Ava", "Ben", "Cleo", "Dev", "Emma", "Finn", "Gia", "Hugo", "Iris", "Jon", "Kai", "Lena")
ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "coins")


# --- the data set ---


def _problem(rng: random.Random) -> dict[str, str]:
    """One word problem; the answer is worked like GSM8K's (``<<a+b=c>>``, ``#### c``)."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.choice(("add", "sub", "mul"))
    if kind == "add":
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        c = a + b
        question = (
            f"{name} has {a} {item}. {other} gives {name} {b} more. "
            f"How many {item} does {name} have now?"
        )
        work = f"{name} has {a} + {b} = <<{a}+{b}={c}>>{c} {item}."
    elif kind == "sub":
        a = rng.randint(20, 90)
        b = rng.randint(1, a - 1)
        c = a - b
        question = (
            f"{name} had {a} {item} and gave {b} of them to {other}. "
            f"How many {item} does {name} have left?"
        )
        work = f"{name} has {a} - {b} = <<{a}-{b}={c}>>{c} {item} left."
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        c = a * b
        question = f"{name} fills {a} boxes with {b} {item} each. How many {item} are in the boxes?"
        work = f"There are {a} * {b} = <<{a}*{b}={c}>>{c} {item} in the boxes."
    return {"question": question, "answer": f"{work}\n#### {c}"}


def problems(rows: int, seed: int) -> dict[str, list[dict[str, str]]]:
    """``rows`` problems, a quarter of them (at least one) the test split."""
    rng = random.Random(seed)
    generated = [_problem(rng) for _ in range(rows)]
    n_test = max(1, rows // 4)
    return {"train": generated[:-n_test], "test": generated[-n_test:]}


def _write_jsonl(rows: list[dict[str, str]], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")  # question, answer: as GSM8K


# --- the tokenizer and the model ---


def _corpus(splits: dict[str, list[dict[str, str]]]) -> list[str]:
    """The text the tokenizer learns: the rows as the chat template renders them."""
    texts = []
    for rows in splits.values():
        for row in rows:
            texts.append(
                f"{IM_START}user\n{row['question']} {data.INSTRUCTION}{EOS_TOKEN}\n"
                f"{IM_START}assistant\n{row['answer']}{EOS_TOKEN}\n"
            )
    return texts


def build_tokenizer(
    texts: list[str], vocab: int = VOCAB_TARGET, max_length: int = MAX_POSITIONS
) -> Any:
    """A byte-level BPE trained on ``texts``, speaking ChatML (bench/ppo_bench.py's too)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, EOS_TOKEN],
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def build_model(tokenizer: Any, seed: int) -> Any:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=pad_id,  # as Qwen2: <|endoftext|>
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
        # No sliding window (transformers warns about it for sdpa even when unused).
        use_sliding_window=False,
        sliding_window=None,
        **MODEL_SHAPE,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG alone
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id
    )
    return model.eval()


# --- all of it ---


def build(out: Path, rows: int = DEFAULT_ROWS, seed: int = 0) -> dict[str, Any]:
    """Write OUT/model, OUT/raw and OUT/data; each replaces what was there, whole."""
    if rows < 2:
        raise EngineError("options-invalid", f"--rows {rows}: need at least 2 (train and test)")
    # No hub: everything is made here; a lookup would be a bug, so make it fail.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    missing = [m for m in REQUIRES if not _importable(m)]
    if missing:
        raise EngineError(
            "python-package-missing",
            f"smoke-assets needs {', '.join(missing)}; run with the training venv's python",
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    splits = problems(rows, seed)
    staging = Path(tempfile.mkdtemp(dir=out, prefix=".smoke-assets-"))
    try:
        raw = {split: staging / "raw" / f"{split}.jsonl" for split in data.SPLITS}
        for split, target in raw.items():
            _write_jsonl(splits[split], target)
        converted = data.gsm8k(raw["train"], raw["test"], staging / "data")
        tokenizer = build_tokenizer(_corpus(splits))
        model = build_model(tokenizer, seed)
        tokenizer.save_pretrained(staging / "model")
        model.save_pretrained(staging / "model", safe_serialization=True)
        params = sum(p.numel() for p in model.parameters())
        for path in staging.rglob("*"):  # some writers create files 0600
            path.chmod(0o755 if path.is_dir() else 0o644)
        for part in ("model", "raw", "data"):
            target = out / part
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            os.replace(staging / part, target)
    except OSError as exc:
        raise EngineError("smoke-assets-write-failed", f"{out}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    model_dir = out / "model"
    return {
        "out": str(out),
        "seed": seed,
        "model": {
            "path": str(model_dir),
            "files": sorted(p.name for p in model_dir.iterdir()),
            "parameters": params,
            "vocab_size": len(tokenizer),
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            **MODEL_SHAPE,
        },
        "raw": {split: str(out / "raw" / f"{split}.jsonl") for split in data.SPLITS},
        "data": {
            split: {"path": str(out / "data" / f"{split}.parquet"), "rows": f["rows"]}
            for split, f in converted["files"].items()
        },
    }


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# --- CLI ---


def add_parser(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    summary = "build a tiny Qwen2 and a GSM8K-shaped data set offline, for smoke runs"
    parser = subcommand.add(
        subparsers, common, "smoke-assets", run, __doc__, help=summary, whole_doc=True
    )
    parser.add_argument("--out", type=Path, required=True, help="writes OUT/{model,raw,data}")
    parser.add_argument(
        "--rows", type=int, default=DEFAULT_ROWS, help=f"problems in all (default {DEFAULT_ROWS})"
    )
    parser.add_argument("--seed", type=int, default=0, help="default 0")


def run(args: argparse.Namespace) -> Result:
    payload = build(args.out, args.rows, args.seed)
    m = payload["model"]
    lines = [
        f"{m['path']}: Qwen2, {m['parameters']} parameters, vocab {m['vocab_size']} "
        f"({', '.join(m['files'])})",
        *(f"{d['path']}: {d['rows']} rows" for d in payload["data"].values()),
        *(f"{path}: GSM8K as published" for path in payload["raw"].values()),
    ]
    return Result(payload, "\n".join(lines))
