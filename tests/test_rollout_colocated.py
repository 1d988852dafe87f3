"""oldgpu-hf generating in the trainer's process (``rollout/colocated.py``), in the real
verl 0.9.0 venv: a real FSDP1-wrapped policy (gloo, one rank, on the CPU) inside a
fused worker as verl builds it, reached the way the server reaches it.

The whole path through Ray and verl's trainer runs in the jobs scenario's 0.9.0 job and
in ``scripts/verl09-cpu-smoke.sh``; here the pieces that decide: the worker found by
its rollout, the root unit's parameters summoned, the same tokens and log-probs as the
plain model with the same weights, the module's training mode restored, and a worker
without the policy refused by name.
"""

from __future__ import annotations

import json

from test_rollout_verl09 import assets, cpu_tree, needs_venv, run_verl  # noqa: F401

SCRIPT = """
import json, os, types
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
import functools
from transformers import AutoModelForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
from oldgpu.rollout import colocated
from oldgpu.rollout.hf_engine import HFGenerator
from oldgpu.rollout.sampling import Limits, make_request

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo", rank=0, world_size=1)
path = {model!r}
torch.manual_seed(0)
plain = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
trained = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={{Qwen2DecoderLayer}})
fsdp = FSDP(trained, auto_wrap_policy=wrap, device_id=torch.device("cpu"), use_orig_params=False)
fsdp.train()

adapter = types.SimpleNamespace()
adapter.policy = colocated.PolicyGenerator(pad_token_id=0, eos_token_ids=[1],
                                           logprobs_mode="processed_logprobs")
role = types.SimpleNamespace(rollout=adapter, actor=types.SimpleNamespace(
    engine=types.SimpleNamespace(module=fsdp, is_param_offload_enabled=False)))
fused = types.SimpleNamespace(worker_dict={{"actor_rollout": role}})
colocated.register(0, adapter)

limits = Limits(prompt_length=16, response_length=8, max_model_len=64)
params = dict(temperature=0, top_p=1.0, top_k=-1, logprobs=True)
requests = [make_request([2, 10 + i, 11, 12], params, limits, request_id=str(i))
            for i in range(3)]
got = colocated.run_batch(fused, 0, requests)
want = HFGenerator(plain, pad_token_id=0, eos_token_ids=[1], device="cpu").generate(requests)
gap = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.log_probs, w.log_probs))
try:
    colocated.run_batch(types.SimpleNamespace(worker_dict={{}}), 0, requests)
    refused = None
except colocated.PolicyNotFound as exc:
    refused = type(exc).__name__
try:
    colocated.run_batch(fused, 7, requests)
    unknown = None
except colocated.PolicyNotFound as exc:
    unknown = str(exc)
print(json.dumps(dict(
    same_tokens=[g.token_ids for g in got] == [w.token_ids for w in want],
    lengths=[len(g.token_ids) for g in got],
    gap=gap,
    training=fsdp.training,
    refused=refused,
    unknown=unknown,
    released=colocated.release(fused, 0) == os.getpid(),
)))
"""


@needs_venv
def test_the_trainer_process_generates_from_its_fsdp_policy(cpu_tree, assets):  # noqa: F811
    (line,) = run_verl(cpu_tree, SCRIPT.format(model=str(assets / "model")), VERL_PLATFORM="cpu")
    doc = json.loads(line)
    assert doc["same_tokens"], doc
    assert all(1 <= n <= 8 for n in doc["lengths"])
    assert doc["gap"] < 1e-5
    assert doc["training"] is True  # eval() for generation only
    assert doc["refused"] == "PolicyNotFound"
    assert "replica 7" in doc["unknown"]
    assert doc["released"]
