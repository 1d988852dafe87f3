"""The oldgpu-hf rollout in the real verl 0.9.0 (the sdist, cpu-patched), in its own venv.

verl 0.9.0 needs numpy 2, transformers 5 and Ray, which the engine's test venv (the
0.5.0 lock) does not have: these tests run the venv ``scripts/engine-venv.sh`` builds
from the release's lock ($VERL09_VENV, which ``make unit`` sets) in subprocesses, and
skip without it.
The 2-step GRPO run itself is opt-in (OLDGPU_VERL09_SMOKE=1: about ten minutes on two
cores).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from conftest import fresh_copy

from oldgpu import cli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("VERL09_VENV", "/tmp/verl09-venv"))
PYTHON = VENV / "bin" / "python"

needs_venv = pytest.mark.skipif(
    not PYTHON.exists(),
    reason=f"needs the verl 0.9.0 venv at {VENV} (scripts/verl09-cpu-smoke.sh builds it)",
)


@pytest.fixture(scope="module")
def cpu_tree(verl09_pristine: Path, tmp_path_factory) -> Path:
    tree = fresh_copy(verl09_pristine, tmp_path_factory.mktemp("verl09-cpu"))
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["patch", str(tree), "--profile", "cpu", "--json"]) == 0
    return tree


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("assets")
    proc = subprocess.run(
        [str(PYTHON), "-m", "oldgpu", "smoke-assets", "--out", str(out), "--json"],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def run_verl(tree: Path, script: str, **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("OLDGPU_", "VERL_"))}
    environ.update(
        PYTHONPATH=f"{tree}:{ROOT / 'src'}",
        VERL_USE_EXTERNAL_MODULES="oldgpu.verl_plugin.hook",
        PYTHONDONTWRITEBYTECODE="1",
        **env,
    )
    proc = subprocess.run(
        [str(PYTHON), "-c", textwrap.dedent(script)],
        cwd=tree,
        env=environ,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()


@needs_venv
def test_verl_finds_the_rollout_by_name_in_a_fresh_process(cpu_tree):
    (line,) = run_verl(
        cpu_tree,
        """
        import json
        import verl
        from verl.workers.rollout.base import get_rollout_class
        from verl.workers.rollout.replica import get_rollout_replica_class
        adapter = get_rollout_class("oldgpu-hf", "async")
        replica = get_rollout_replica_class("oldgpu-hf")
        print(json.dumps([adapter.__module__, adapter.__name__, replica.__module__,
                          [c.__name__ for c in replica.__mro__]]))
        """,
    )
    module, name, replica_module, mro = json.loads(line)
    assert (module, name) == ("oldgpu.rollout.adapter", "HFServerAdapter")
    assert replica_module == "oldgpu.rollout.replica" and "RolloutReplica" in mro


@needs_venv
def test_the_cpu_platform_only_when_asked(cpu_tree):
    script = """
        from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device
        shim = hasattr(get_torch_device(), "memory_allocated")
        print(get_device_name(), get_nccl_backend(), shim)
        """
    assert run_verl(cpu_tree, script, VERL_PLATFORM="cpu") == ["cpu gloo True"]
    # Without VERL_PLATFORM, verl decides as ever (this host has no GPU: its CUDA fallback).
    assert run_verl(cpu_tree, script)[-1].split()[0] == "cuda"


@needs_venv
def test_the_server_answers_the_agent_loops_call_with_a_token_output(cpu_tree, assets):
    """HFRolloutServer as the agent loop calls it (no Ray cluster: the class itself), with
    weights pushed through the adapter's buckets."""
    (line,) = run_verl(
        cpu_tree,
        f"""
        import asyncio, json
        import torch
        from omegaconf import OmegaConf
        from transformers import AutoModelForCausalLM
        from verl.workers.config import RolloutConfig
        from verl.workers.rollout.replica import RolloutMode, TokenOutput
        from oldgpu.rollout.adapter import buckets
        from oldgpu.rollout.sampling import SamplingUnsupported
        from oldgpu.rollout.server import HFRolloutServer

        model_path = {str(assets / "model")!r}
        # weights=copy: the server's own model, filled through the adapter's buckets
        config = RolloutConfig(name="oldgpu-hf", tensor_model_parallel_size=1,
                               prompt_length=32, response_length=8, load_format="dummy",
                               engine_kwargs={{"oldgpu-hf": {{"weights": "copy"}}}})
        model_config = OmegaConf.create({{"path": model_path}})

        async def main():
            server = HFRolloutServer(config, model_config, RolloutMode.HYBRID, replica_rank=0)
            await server.launch_server()
            trained = AutoModelForCausalLM.from_pretrained(model_path)
            sent = 0
            for bucket in buckets(trained.state_dict().items(), 1 << 16):
                sent += await server.load_weights(bucket)
            await server.end_weight_update(global_steps=3)
            params = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0,
                          logprobs=True)
            outs = await asyncio.gather(*[
                server.generate(prompt_ids=[1, 10 + i, 11, 12], sampling_params=dict(params),
                                request_id=str(i))
                for i in range(5)
            ])
            greedy = await server.generate(
                prompt_ids=[1, 10, 11, 12], request_id="g",
                sampling_params=dict(temperature=0, top_p=1.0, top_k=-1, logprobs=False))
            stats = await server.stats()
            refused = []
            for bad in ({{"n": 2}}, {{"stop": ["</answer>"]}}, {{"logit_bias": {{}}}}):
                try:
                    await server.generate(prompt_ids=[1, 2], request_id="x", sampling_params=bad)
                except SamplingUnsupported as exc:
                    refused.append(exc.key)
            # full_determinism: a per-replica seed, as vLLM's server: same prompt, same answer
            server.config.full_determinism = True
            seeded = [await server.generate(prompt_ids=[1, 10, 11, 12], request_id=str(i),
                                            sampling_params=dict(params)) for i in range(2)]
            stats["refused"] = refused
            stats["seeded_equal"] = seeded[0].token_ids == seeded[1].token_ids
            return sent, outs, greedy, stats

        sent, outs, greedy, stats = asyncio.run(main())
        assert all(isinstance(o, TokenOutput) for o in outs + [greedy])
        print(json.dumps(dict(
            sent=sent,
            lengths=[(len(o.token_ids), len(o.log_probs)) for o in outs],
            max_lp=max(lp for o in outs for lp in o.log_probs),
            steps=[o.extra_fields["global_steps"] for o in outs],
            reasons=sorted({{o.stop_reason for o in outs}}),
            greedy_log_probs=greedy.log_probs,
            stats=stats,
        )))
        """,
        VERL_PLATFORM="cpu",
    )
    doc = json.loads(line)
    assert doc["sent"] > 0
    assert all(1 <= n <= 8 and n == m for n, m in doc["lengths"])
    assert doc["max_lp"] <= 1e-6
    assert doc["steps"] == [3] * 5
    assert doc["reasons"] == ["completed"]
    assert doc["greedy_log_probs"] is None
    assert doc["stats"]["largest_batch"] == 5  # the five arrived together: one batch
    assert doc["stats"]["refused"] == ["n", "stop", "logit_bias"]
    assert doc["stats"]["seeded_equal"]


@needs_venv
@pytest.mark.skipif(
    os.environ.get("OLDGPU_VERL09_SMOKE") != "1", reason="the 2-step run is opt-in (minutes)"
)
def test_grpo_trains_two_steps_on_the_cpu(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "verl09-cpu-smoke.sh")],
        env={**os.environ, "VERL09_WORK": str(tmp_path), "STEPS": "2"},
        capture_output=True,
        text=True,
        check=False,
        timeout=3000,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "step:2" in out, out[-6000:]


# A stand-in for the model only: it "writes" a fixed script, one token a step, from the
# full history it is fed (so the server's batching, KV-row dropping and stop handling
# all run for real). Turn 1 calls the tool, then the GLM observation (stop) token, then
# junk that only a server ignoring stop_token_ids would return; turn 2, once the tool's
# answer is in the prompt, answers and ends with the EOS.
SCRIPTED_MODEL = """
import types
import torch

class ScriptedCache:
    def __init__(self, rows, scripts):
        self.rows, self.scripts, self.fed = rows, scripts, []
    def batch_select_indices(self, index):
        keep = index.tolist()
        self.rows = [self.rows[i] for i in keep]
        self.scripts = [self.scripts[i] for i in keep]

class Scripted(torch.nn.Module):
    def __init__(self, tokenizer, turn1, turn2, tool_marker):
        super().__init__()
        self.tok, self.turn1, self.turn2, self.marker = tokenizer, turn1, turn2, tool_marker
        self.vocab = len(tokenizer)
        self.rows_fed = []

    def forward(self, input_ids, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache=True, logits_to_keep=0):
        self.rows_fed.append(input_ids.shape[0])
        if past_key_values is None:
            rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]
            scripts = [self.turn2 if self.marker in self.tok.decode(r) else self.turn1
                       for r in rows]
            cache = ScriptedCache([[] for _ in rows], scripts)
        else:
            cache = past_key_values
            for row, t in zip(cache.rows, input_ids[:, 0].tolist()):
                row.append(t)
        logits = torch.zeros(input_ids.shape[0], 1, self.vocab)
        for i, (done, script) in enumerate(zip(cache.rows, cache.scripts)):
            logits[i, 0, script[min(len(done), len(script) - 1)]] = 40.0
        return types.SimpleNamespace(logits=logits, past_key_values=cache)
"""


@needs_venv
def test_verls_tool_agent_loop_runs_multi_turn_through_the_server(cpu_tree, assets):
    """verl 0.9.0's own ToolAgentLoop (GLM tool format: its parser asks for the
    ``<|observation|>`` stop token) and its own LLMServerClient drive HFRolloutServer; only
    Ray's ``.remote`` is replaced by a direct call, and the model by a script."""
    (line,) = run_verl(
        cpu_tree,
        SCRIPTED_MODEL
        + f"""
import asyncio, json
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.tools.function_tool import FunctionTool
from verl.tools.schemas import OpenAIFunctionToolSchema
from verl.workers.config import RolloutConfig
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import RolloutMode
from oldgpu.rollout.server import HFRolloutServer

model_path = {str(assets / "model")!r}
tok = AutoTokenizer.from_pretrained(model_path)
tok.add_special_tokens({{"additional_special_tokens": [
    "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<|observation|>"]}})
enc = lambda text: tok.encode(text, add_special_tokens=False)
call = "<tool_call>add<arg_key>a</arg_key><arg_value>2</arg_value>" \\
       "<arg_key>b</arg_key><arg_value>3</arg_value></tool_call>"
junk = enc(" JUNK JUNK")
turn1 = enc(call) + enc("<|observation|>") + junk
turn2 = enc("the sum is 5") + enc("<|im_end|>")

def add(a: int, b: int) -> str:
    return f"sum={{a + b}}"

schema = OpenAIFunctionToolSchema.model_validate({{"type": "function", "function": {{
    "name": "add", "description": "Add two integers.",
    "parameters": {{"type": "object", "properties": {{
        "a": {{"type": "integer", "description": "first"}},
        "b": {{"type": "integer", "description": "second"}}}},
        "required": ["a", "b"]}}}}}})
tool = FunctionTool(name="add", fn=add, tool_schema=schema)

rollout = dict(name="oldgpu-hf", prompt_length=256, response_length=96,
               full_determinism=False,
               multi_turn=dict(max_user_turns=3, max_assistant_turns=3, max_parallel_calls=1,
                               max_tool_response_length=64, tool_response_truncate_side="middle",
                               format="glm"))
config = OmegaConf.create({{"actor_rollout_ref": {{"rollout": rollout,
                                                 "model": {{"path": model_path}}}}}})
data_config = OmegaConf.create({{"apply_chat_template_kwargs": {{}},
                                "continuous_token": {{"enable": False}}}})

class Remote:  # Ray's handle.method.remote(...) -> an awaitable, without Ray
    def __init__(self, fn):
        self.fn = fn
    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

async def main():
    server = HFRolloutServer(
        RolloutConfig(name="oldgpu-hf", tensor_model_parallel_size=1, prompt_length=256,
                      response_length=96),
        OmegaConf.create({{"path": model_path}}), RolloutMode.STANDALONE, replica_rank=0)
    await server.launch_server()
    scripted = Scripted(tok, turn1, turn2, "<|im_start|>tool")
    server.generator.model = scripted
    seen = []
    async def generate(**kw):
        seen.append(dict(kw["sampling_params"]))
        return await server.generate(**kw)
    handle = type("Handle", (), {{}})()
    handle.generate = Remote(generate)
    async def acquire(request_id):
        return "s0", handle
    lb = type("LB", (), {{}})()
    lb.acquire_server = Remote(acquire)
    lb.release_server = Remote(lambda server_id: None)
    client = LLMServerClient(config, load_balancer_handle=lb)
    loop = ToolAgentLoop(trainer_config=DictConfigWrap(config), server_manager=client,
                         tokenizer=tok, processor=None, dataset_cls=None,
                         data_config=DictConfigWrap(data_config), tools=ToolListWrap([tool]))
    params = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)
    out = await loop.run(dict(params),
                         raw_prompt=[{{"role": "user", "content": "what is 2 + 3?"}}])
    return out, seen, scripted.rows_fed

out, seen, fed = asyncio.run(main())
mask = out.response_mask
spans, start = [], 0
for i in range(1, len(mask) + 1):
    if i == len(mask) or mask[i] != mask[start]:
        spans.append((mask[start], tok.decode(out.response_ids[start:i])))
        start = i
print(json.dumps(dict(
    spans=spans, num_turns=out.num_turns, stop_ids=[s.get("stop_token_ids") for s in seen],
    observation=tok.convert_tokens_to_ids("<|observation|>"), fed=fed,
    logprobs=len(out.response_logprobs or []), response=len(out.response_ids),
)))
""",
        VERL_PLATFORM="cpu",
    )
    doc = json.loads(line)
    (model1, tool_turn, model2) = doc["spans"]
    # Turn 1 ends at the stop token, kept; the junk after it never reaches verl.
    assert model1[0] == 1 and model1[1].endswith("</tool_call><|observation|>")
    assert "JUNK" not in model1[1]
    # The tool's answer is appended (mask 0) and the next turn is generated after it.
    assert tool_turn[0] == 0 and "sum=5" in tool_turn[1] and "<|im_start|>tool" in tool_turn[1]
    assert model2 == [1, "the sum is 5<|im_end|>"]
    assert doc["num_turns"] == 4  # user, assistant, tool, assistant
    assert doc["stop_ids"] == [[doc["observation"]]] * 2
    assert doc["logprobs"] == doc["response"]


@needs_venv
def test_the_decode_tests_pass_under_the_releases_transformers():
    """oldgpu-hf decodes under 0.9.0's transformers 5, not the engine venv's 4: its
    decode, grouped-attention and reserved-cache tests run there too, none skipped."""
    files = ["test_rollout_decode.py", "test_rollout_gqa.py", "test_rollout_kv_cache.py"]
    proc = subprocess.run(
        [str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *files],
        cwd=ROOT / "tests",
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}"},
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    tail = proc.stdout[-3000:]
    assert proc.returncode == 0, tail + proc.stderr[-2000:]
    assert " passed" in tail and "skipped" not in tail, tail
