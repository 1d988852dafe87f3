"""A user's checks of a training job under systemd: it trains, checkpoints, resumes."""

import json
import re
import time

import pytest
from playbook import PROJECT, playbook

UNIT = "verl-train@smoke.service"
STATE = "/var/lib/verl/jobs/smoke"
CKPT = f"{STATE}/checkpoints"
# The first run's steps; test_jobs_faults.py raises total_steps and resumes from there.
FIRST_STEPS = 2
RUN_TIMEOUT_S = 900
# The smoke job's secrets, as molecule.yml declares them (test_jobs_faults checks where they go).
SECRETS = {"WANDB_API_KEY": "wandb-test-0f3a9c51", "HF_TOKEN": "hf_test_7d2e51b8"}


def show(host, *props, unit=UNIT):
    out = host.check_output(f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props))
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def run_to_end(host, unit=UNIT):
    """Start the unit and wait until systemd says it ended; its journal since the start."""
    cursor = host.check_output("journalctl -n0 --show-cursor -q | sed -n 's/^-- cursor: //p'")
    host.check_output(f"systemctl start {unit}")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        state = show(host, "ActiveState", "SubState", unit=unit)
        if state["ActiveState"] in ("inactive", "failed"):
            break
        time.sleep(5)
    else:
        pytest.fail(f"{unit} still {state} after {RUN_TIMEOUT_S} s")
    after = f"--after-cursor '{cursor}'" if cursor else ""
    journal = host.check_output(f"journalctl -u {unit} {after} -o cat --no-pager")
    return show(host, "Result", "ExecMainStatus", "ActiveState", unit=unit), journal


def steps_logged(journal):
    """{step: metrics line} from verl's console logger ("step:N - key:value - ...")."""
    return {int(m.group(1)): m.group(0) for m in re.finditer(r"step:(\d+) - .*", journal)}


@pytest.fixture(scope="module")
def first_run(host):
    return run_to_end(host)


def test_start_script_and_unit_are_installed(host):
    script = host.file("/opt/verl/bin/verl-train")
    assert (script.user, script.group, script.mode) == ("root", "root", 0o755)
    unit = host.file("/etc/systemd/system/verl-train@.service")
    assert (unit.user, unit.mode) == ("root", 0o644)
    # One template for both front-ends: byte for byte the project's file.
    assert unit.content_string == (PROJECT / "files/systemd/verl-train@.service").read_text()
    assert host.service(UNIT).is_enabled


def test_env_file_is_private_to_root_and_the_group(host):
    env = host.file("/etc/verl/jobs/smoke.env")
    assert (env.user, env.group, env.mode) == ("root", "verl", 0o640)
    assert "VERL_JOB_TOTAL_STEPS='2'" in env.content_string


def test_unit_passes_systemd_verify_and_scores_5_or_better(host):
    out = host.run(f"systemd-analyze security --no-pager {UNIT}")
    score = re.search(r"Overall exposure level for \S+: ([\d.]+)", out.stdout)
    assert score, out.stdout[-2000:] + out.stderr
    assert float(score.group(1)) <= 5.0
    verify = host.run(f"systemd-analyze verify {UNIT}")
    assert verify.rc == 0, verify.stderr


def test_job_ran_as_verl_and_succeeded(host, first_run):
    result, journal = first_run
    assert result["Result"] == "success", journal[-4000:]
    assert result["ExecMainStatus"] == "0"
    assert "as user verl" in journal
    assert show(host, "User")["User"] == "verl"


def test_journal_shows_every_step_with_reward_and_kl(first_run):
    _, journal = first_run
    steps = steps_logged(journal)
    assert sorted(steps) == list(range(1, FIRST_STEPS + 1)), journal[-4000:]
    for line in steps.values():
        assert "critic/score/mean:" in line
        assert "actor/kl_loss:" in line
        assert "actor/pg_loss:" in line and "critic/vf_loss:" in line


def test_checkpoints_are_owned_by_verl(host, first_run):
    for step in range(1, FIRST_STEPS + 1):
        ckpt = host.file(f"{CKPT}/global_step_{step}")
        assert ckpt.is_directory and ckpt.user == "verl"
        assert host.file(f"{CKPT}/global_step_{step}/actor").is_directory
    latest = host.file(f"{CKPT}/latest_checkpointed_iteration.txt")
    assert latest.content_string.strip() == str(FIRST_STEPS)


def test_tensorboard_events_and_log_file(host, first_run):
    events = host.check_output(f"find {STATE}/tensorboard -name 'events.out.tfevents.*'")
    assert events.strip(), "no tensorboard event files"
    log = host.file("/var/log/verl/smoke.log")
    assert log.user == "verl"
    assert "step:1 -" in log.content_string


def test_status_reports_the_job(host, first_run):
    doc = json.loads(host.check_output("oldgpu status --json smoke"))
    (job,) = doc["jobs"]
    assert job["name"] == "smoke" and job["total_steps"] == FIRST_STEPS
    assert job["metrics"]["last_step"] == FIRST_STEPS
    assert job["checkpoint"]["step"] == FIRST_STEPS
    assert job["unit"]["state"] == "inactive"
    assert job["metrics"]["reward"] is not None and job["metrics"]["kl"] is not None


def test_plot_writes_a_png(host, first_run):
    out = host.check_output(f"runuser -u verl -- oldgpu plot smoke --out {STATE}/plot.png")
    png = host.file(f"{STATE}/plot.png")
    assert png.exists and png.size > 10_000, out
    head = host.check_output(f"head -c 8 {STATE}/plot.png | od -An -tx1")
    assert head.split() == ["89", "50", "4e", "47", "0d", "0a", "1a", "0a"]


GRPO_UNIT = "verl-train@grpo-lora.service"
GRPO_CKPT = "/var/lib/verl/jobs/grpo-lora/checkpoints"
GRPO_STEPS = 2
# The smoke model's 2 layers x 7 linear layers (all-linear), lora_A and lora_B each.
LORA_TENSORS = 2 * 7 * 2
SAFETENSORS_HEADER = (
    "import json, struct, sys; f = open(sys.argv[1], 'rb'); "
    "n, = struct.unpack('<Q', f.read(8)); "
    "print(json.dumps(json.loads(f.read(n))))"
)


@pytest.fixture(scope="module")
def grpo_lora_run(host):
    return run_to_end(host, GRPO_UNIT)


def test_grpo_lora_job_trains_the_adapters_without_a_critic(host, grpo_lora_run):
    result, journal = grpo_lora_run
    assert result["Result"] == "success", journal[-4000:]
    assert not host.service(GRPO_UNIT).is_enabled  # enabled: false
    # The engine composed the recipe; verl applied LoRA to the actor.
    command = next(line for line in journal.splitlines() if line.startswith("verl-train: /"))
    for key in ("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.model.lora_rank=8",
                "actor_rollout_ref.model.lora_alpha=16",
                "actor_rollout_ref.model.target_modules=all-linear",
                "+actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"):  # fmt: skip
        assert f" {key}" in command, key
    assert "critic.model.path" not in command
    assert "Applying LoRA to actor module" in journal
    steps = steps_logged(journal)
    assert sorted(steps) == list(range(1, GRPO_STEPS + 1)), journal[-4000:]
    for line in steps.values():
        assert "actor/kl_loss:" in line and "actor/pg_loss:" in line
        assert "critic/vf_loss" not in line  # no critic was built
        # 4 prompts x rollout_n 2 = 8 sequences (not 4 x 2 x 2): the tokens of the
        # batch over the mean tokens of a sequence.
        metric = {k: float(v) for k, v in re.findall(r"([\w/]+):(-?[\d.e+-]+)", line)}
        per_sequence = metric["prompt_length/mean"] + metric["response_length/mean"]
        assert round(metric["perf/total_num_tokens"] / per_sequence) == 8, line


def test_grpo_lora_checkpoint_holds_the_adapters(host, grpo_lora_run):
    step = f"{GRPO_CKPT}/global_step_{GRPO_STEPS}"
    assert host.file(f"{step}/actor").is_directory
    assert not host.file(f"{step}/critic").exists
    config = json.loads(host.file(f"{step}/actor/lora_adapter/adapter_config.json").content_string)
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    adapter = f"{step}/actor/lora_adapter/adapter_model.safetensors"
    header = json.loads(host.check_output(f'python3 -c "{SAFETENSORS_HEADER}" {adapter}'))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    # An FSDP wrap without LoRA's units saves an empty adapter; this one has them all.
    assert len(tensors) == LORA_TENSORS, sorted(tensors)
    assert all(".lora_A." in k or ".lora_B." in k for k in tensors)
    assert all(8 in v["shape"] for v in tensors.values())
    latest = host.file(f"{GRPO_CKPT}/latest_checkpointed_iteration.txt")
    assert latest.content_string.strip() == str(GRPO_STEPS)


# The actor's model shard, by the job venv's torch: each tensor's dtype, adapter or base.
SHARD_DTYPES = (
    "import collections, json, sys, torch; "
    "sd = torch.load(sys.argv[1], map_location='cpu', weights_only=False); "
    "c = collections.Counter("
    "str(v.dtype) + (' lora' if 'lora_' in k else ' base') for k, v in sd.items()); "
    "print(json.dumps(c))"
)


def test_grpo_lora_base_is_stored_at_16_bits_and_the_adapters_at_32(host, grpo_lora_run):
    """base_dtype bf16: the frozen base trained and was saved at bf16, the adapters fp32."""
    shard = f"{GRPO_CKPT}/global_step_{GRPO_STEPS}/actor/model_world_size_1_rank_0.pt"
    python = "/opt/verl/venv/bin/python"
    counts = json.loads(host.check_output(f'{python} -c "{SHARD_DTYPES}" {shard}'))
    assert counts.get("torch.float32 lora") == LORA_TENSORS, counts
    assert counts.get("torch.bfloat16 base", 0) > 0, counts
    assert set(counts) == {"torch.float32 lora", "torch.bfloat16 base"}, counts


def test_bad_job_is_refused_before_anything_changes(host):
    bad = {
        "name": "Bad Name",
        "model_path": "m",
        "train_files": "/x",
        "val_files": "/y",
        "total_steps": 1,
    }
    run = playbook("-e", json.dumps({"verl_jobs": [bad]}), "--tags", "verl_jobs")
    assert run.rc != 0
    assert "job-config-invalid" in run.output
    assert run.recap("jobs-host")["changed"] == 0
    assert not host.file("/etc/verl/jobs/Bad Name.env").exists
