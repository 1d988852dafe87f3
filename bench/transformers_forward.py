"""Qwen2's forward (decode with a KV cache) and forward+backward in one transformers
against another, on the same torch, on the CPU: is verl 0.9.0's slower log-prob and
update phases (docs/benchmarks.md, 2026-12-07) the model code of transformers 5?

    python bench/transformers_forward.py LAYERS HIDDEN     # one JSON line

Run it with each transformers on the same torch, e.g. the 0.9.0 venv's python as it is
(transformers 5) and again with PYTHONPATH naming a directory that holds 0.5.0's
transformers 4.51.3 with its tokenizers, huggingface_hub and safetensors (and their
dist-info). Small widths on purpose: what differs between the releases is the Python
around the kernels, which a small model shows and a large one hides. The training batch
is padded as verl's are (left-padded prompts, right-padded responses).
"""

import json
import sys
import time

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

ROWS, PROMPT, STEPS = 64, 64, 64


def model(layers: int, hidden: int) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg).float().eval()


@torch.no_grad()
def decode_s_per_step(m: Qwen2ForCausalLM) -> float:
    # As the oldgpu-hf decode loop calls it: left-padded prompts, then one token a step.
    ids = torch.randint(0, 1024, (ROWS, PROMPT))
    mask = torch.ones_like(ids)
    mask[: ROWS // 2, :8] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = m(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    cache, last, tok = out.past_key_values, pos[:, -1], out.logits[:, -1].argmax(-1)
    start = time.perf_counter()
    for _ in range(STEPS):
        mask = torch.cat([mask, mask.new_ones((ROWS, 1))], 1)
        last = last + 1
        out = m(
            input_ids=tok[:, None],
            attention_mask=mask,
            position_ids=last[:, None],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1)
    return (time.perf_counter() - start) / STEPS


def train_s_per_iter(m: Qwen2ForCausalLM, iters: int = 5) -> float:
    batch = torch.randint(0, 1024, (8, 256))
    mask = torch.ones_like(batch)
    mask[:4, :40] = 0  # left-padded prompts
    mask[2:6, 200:] = 0  # right-padded responses
    m.train()
    start = time.perf_counter()
    for _ in range(iters):
        out = m(input_ids=batch, attention_mask=mask, use_cache=False)
        out.logits.float().mean().backward()
    m.eval()
    return (time.perf_counter() - start) / iters


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layers, hidden = int(sys.argv[1]), int(sys.argv[2])
    m = model(layers, hidden)
    decode_s_per_step(m), train_s_per_iter(m)  # warm-up
    decode = min(decode_s_per_step(m) for _ in range(3))
    train = min(train_s_per_iter(m) for _ in range(2))
    print(
        json.dumps(
            {
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "layers": layers,
                "hidden": hidden,
                "decode_ms_per_step": round(decode * 1000, 3),
                "train_ms_per_iter": round(train * 1000, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
