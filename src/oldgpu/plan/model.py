"""The model the planner plans for: its shape (from config.json or a built-in) and the
bytes per element each role keeps for a compute dtype."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oldgpu.output import EngineError


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what each role keeps, for one compute dtype."""

    master: int  # the sharded weights FSDP trains (fp32 in both modes)
    grad: int  # the sharded gradient
    adam: int  # Adam's two moments
    compute: int  # activations, logits, KV cache, the unsharded compute copy
    ref: int  # the reference model's weights


# fp32: 4 + 4 + 8 = 16 bytes per trained parameter. bf16 mixed precision keeps fp32
# master weights, gradients and moments (16 bytes) and computes with a bf16 copy
# (+2 bytes while a role computes); verl loads the ref in bf16. fp16 (volta, turing)
# keeps FSDP's weights in fp32 (param_dtype fp32, for the loss scaler's fp32 grads)
# and autocast computes with fp16 copies (+2 bytes, as bf16's); the ref stays fp32.
PRECISIONS = {
    "fp32": Precision(master=4, grad=4, adam=8, compute=4, ref=4),
    "fp16": Precision(master=4, grad=4, adam=8, compute=2, ref=4),
    "bf16": Precision(master=4, grad=4, adam=8, compute=2, ref=2),
}


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    attention_bias: bool = True  # Qwen2 has q/k/v biases
    max_position_embeddings: int | None = None

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def layer_params(self) -> int:
        h, d = self.hidden_size, self.dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        return attn + 3 * h * self.intermediate_size + 2 * h

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def params(self) -> int:
        """Parameters of the causal LM (actor, ref)."""
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params()
        return (
            self.embedding_params()
            + self.num_hidden_layers * self.layer_params()
            + self.hidden_size
            + lm_head
        )

    def critic_params(self) -> int:
        """The critic: the same trunk with a value head (hidden -> 1) for the lm_head."""
        trunk = self.embedding_params() + self.num_hidden_layers * self.layer_params()
        return trunk + self.hidden_size + self.hidden_size + 1


# Built-in shapes: the config.json values of the models named "<family>-<size>".
# hidden, layers, heads, kv heads, intermediate, vocab, tie_word_embeddings.
SHAPES: dict[str, ModelShape] = {
    "qwen2.5-0.5b": ModelShape(896, 24, 14, 2, 4864, 151936, True, max_position_embeddings=32768),
    "qwen2.5-1.5b": ModelShape(1536, 28, 12, 2, 8960, 151936, True, max_position_embeddings=32768),
    "qwen2.5-3b": ModelShape(2048, 36, 16, 2, 11008, 151936, True, max_position_embeddings=32768),
    "qwen2.5-7b": ModelShape(3584, 28, 28, 4, 18944, 152064, False, max_position_embeddings=32768),
}


def family_of(name: str) -> str:
    return name.rsplit("-", 1)[0]


# family -> its shapes' names, smallest first (what `oldgpu plan --largest` walks).
FAMILIES: dict[str, tuple[str, ...]] = {
    family: tuple(
        sorted((n for n in SHAPES if family_of(n) == family), key=lambda n: SHAPES[n].params())
    )
    for family in dict.fromkeys(family_of(n) for n in SHAPES)
}

_REQUIRED_CONFIG_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


def shape_from_config(config: Mapping[str, Any]) -> ModelShape:
    """A ModelShape from a Hugging Face config.json's fields."""
    if "hidden_size" not in config and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]  # multimodal configs nest the language model
    missing = [k for k in _REQUIRED_CONFIG_KEYS if not isinstance(config.get(k), int)]
    if missing:
        raise EngineError(
            "plan-model-config-invalid",
            f"config.json lacks integer {', '.join(missing)}; pass --model-shape instead",
        )

    # A zero or negative dimension divides by zero or plans a model of negative size.
    def positive(key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EngineError(
                "plan-model-config-invalid",
                f"config.json's {key} is {value!r}: must be a positive integer",
            )

    for key in _REQUIRED_CONFIG_KEYS:
        positive(key, config[key])
    for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        if config.get(key) is not None:
            positive(key, config[key])
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    model_type = str(config.get("model_type", ""))
    bias = config.get("attention_bias", model_type.startswith("qwen2"))
    return ModelShape(
        hidden_size=config["hidden_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=int(kv),
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=int(config.get("head_dim") or 0),
        attention_bias=bool(bias),
        max_position_embeddings=config.get("max_position_embeddings"),
    )


def load_model_dir(path: str | Path) -> ModelShape:
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise EngineError(
            "plan-model-config-missing", f"{config_path} does not exist (pass --model-shape)"
        ) from exc
    except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise EngineError("plan-model-config-invalid", f"{config_path}: {exc}") from exc
    if not isinstance(config, Mapping):
        raise EngineError("plan-model-config-invalid", f"{config_path} is not a JSON object")
    return shape_from_config(config)
