"""``oldgpu smoke-assets``: the tiny Qwen2, its tokenizer and the GSM8K-shaped data (CPU)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from oldgpu import cli, smoke
from oldgpu import data as gsm8k_data
from oldgpu.output import EngineError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pq = pytest.importorskip("pyarrow.parquet")


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("smoke")
    payload = smoke.build(out, rows=48, seed=0)
    return out, payload


def test_layout(assets) -> None:
    out, payload = assets
    assert sorted(tree_hashes(out)) == [
        "data/test.parquet",
        "data/train.parquet",
        "model/config.json",
        "model/generation_config.json",
        "model/model.safetensors",
        "model/special_tokens_map.json",
        "model/tokenizer.json",
        "model/tokenizer_config.json",
        "raw/test.jsonl",
        "raw/train.jsonl",
    ]
    assert payload["data"]["train"]["rows"] == 36 and payload["data"]["test"]["rows"] == 12
    assert payload["model"]["path"] == str(out / "model")


def test_model_loads(assets) -> None:
    out, payload = assets
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    tok = transformers.AutoTokenizer.from_pretrained(out / "model")
    cfg = model.config
    assert cfg.model_type == "qwen2" and type(model).__name__ == "Qwen2ForCausalLM"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (64, 2, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.tie_word_embeddings and cfg.vocab_size == len(tok)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert sum(p.numel() for p in model.parameters()) == payload["model"]["parameters"]
    assert model.dtype is torch.float32
    assert (out / "model" / "model.safetensors").stat().st_mode & 0o777 == 0o644
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Ava has 3 apples."}], add_generation_prompt=True
    )
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok))
    gen = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert gen.shape[1] <= len(ids) + 4
    assert model.generation_config.pad_token_id == tok.pad_token_id


def test_tokenizer_and_chat_template(assets) -> None:
    out, _ = assets
    tok = transformers.AutoTokenizer.from_pretrained(out / "model")
    assert tok.is_fast
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tok.eos_token_id != tok.pad_token_id
    messages = [
        {"role": "user", "content": "Ben has 12 coins. How many? Let's think step by step."},
        {"role": "assistant", "content": "12 + 0 = <<12+0=12>>12\n#### 12"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>user\nBen has 12 coins. How many? Let's think step by step.<|im_end|>\n"
        "<|im_start|>assistant\n12 + 0 = <<12+0=12>>12\n#### 12<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: every text round-trips
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2
    assert ids.count(tok.eos_token_id) == 2  # the special tokens are single tokens
    odd = "Zoë paid €5 — 🙂 tab\tand\nnewline"
    assert tok.decode(tok(odd, add_special_tokens=False)["input_ids"]) == odd


def test_data_is_gsm8k_shaped(assets) -> None:
    out, _ = assets
    for split in gsm8k_data.SPLITS:
        raw = gsm8k_data.read_gsm8k(out / "raw" / f"{split}.jsonl")
        rows = pq.read_table(out / "data" / f"{split}.parquet").to_pylist()
        assert len(rows) == len(raw)
        for row, src in zip(rows, raw, strict=True):
            assert row["data_source"] == "openai/gsm8k"
            assert row["prompt"][0]["content"].startswith(src["question"] + " Let's think")
            # The worked step <<a op b=c>> and the final "#### c" agree.
            a, op, b, c = re.search(r"<<(\d+)([-+*])(\d+)=(\d+)>>", src["answer"]).groups()
            assert int(c) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            assert src["answer"].endswith(f"\n#### {c}")
            assert row["reward_model"] == {"ground_truth": c, "style": "rule"}
            assert row["extra_info"]["split"] == split
    # Written through `oldgpu data gsm8k`'s code: converting the raw files gives the same bytes.
    again = out.parent / (out.name + "-again")
    gsm8k_data.gsm8k(out / "raw" / "train.jsonl", out / "raw" / "test.jsonl", again)
    for split in gsm8k_data.SPLITS:
        name = f"{split}.parquet"
        assert (again / name).read_bytes() == (out / "data" / name).read_bytes()


def test_deterministic_for_a_seed(assets, tmp_path: Path) -> None:
    out, _ = assets
    smoke.build(tmp_path / "same", rows=48, seed=0)
    assert tree_hashes(tmp_path / "same") == tree_hashes(out)
    smoke.build(tmp_path / "other", rows=48, seed=1)
    other = tree_hashes(tmp_path / "other")
    mine = tree_hashes(out)
    assert other["model/model.safetensors"] != mine["model/model.safetensors"]
    assert other["data/train.parquet"] != mine["data/train.parquet"]


def test_cli_and_rebuild(tmp_path: Path, capsys) -> None:
    target = tmp_path / "assets"
    (target / "model").mkdir(parents=True)
    (target / "model" / "stale.bin").write_bytes(b"old")  # a rebuild replaces the whole part
    code = cli.main(["smoke-assets", "--out", str(target), "--rows", "8", "--seed", "3", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0
    assert payload["data"]["train"]["rows"] == 6 and payload["data"]["test"]["rows"] == 2
    assert not (target / "model" / "stale.bin").exists()
    assert not [p for p in target.iterdir() if p.name.startswith(".")]  # no staging left
    for split in ("train", "test"):
        assert Path(payload["data"][split]["path"]).is_file()
        assert Path(payload["raw"][split]).is_file()


def test_too_few_rows(tmp_path: Path) -> None:
    with pytest.raises(EngineError) as exc:
        smoke.build(tmp_path, rows=1)
    assert exc.value.name == "options-invalid"
