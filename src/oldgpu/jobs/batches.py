"""What verl 0.5.0 asserts about a run's batch sizes, checked before it starts.

verl checks these inside its Ray workers, after the model has loaded: a job
whose overrides break one fails minutes later with a bare AssertionError (and
systemd would restart it). The composed argv is checked here instead, so the
job stops with exit 4 and a message naming the job, the keys and the numbers.

verl's rules (trainer/ppo/ray_trainer.py ``check_config``, workers/fsdp_workers.py):
- data.train_batch_size x rollout.n divides by the number of workers;
- train_batch_size >= each model's ppo_mini_batch_size;
- per worker, a mini batch is ppo_mini_batch_size x rollout.n / workers: more
  than 0, and divisible by that model's ppo_micro_batch_size_per_gpu.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from oldgpu.jobs.settings import invalid

ACTOR = "actor_rollout_ref.actor"
CRITIC = "critic"


def _int(values: Mapping[str, str], key: str) -> int | None:
    """An override's integer value; None when absent or not a plain integer (null,
    an interpolation: verl's config decides those, not the job)."""
    raw = values.get(key)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def check(job_name: str, argv: Sequence[str]) -> None:
    """Raise ``job-config-invalid`` where verl 0.5.0 would fail an assertion later."""
    values = dict(item.split("=", 1) for item in argv if "=" in item and not item.startswith("-"))
    values = {k.lstrip("+"): v for k, v in values.items()}
    workers = (_int(values, "trainer.n_gpus_per_node") or 1) * (_int(values, "trainer.nnodes") or 1)
    n = _int(values, "actor_rollout_ref.rollout.n") or 1
    train = _int(values, "data.train_batch_size")
    if train is not None and (train * n) % workers:
        raise invalid(
            f"job {job_name}: data.train_batch_size={train} x rollout.n={n} = {train * n}"
            f" sequences a step do not divide over its {workers} workers"
            " (trainer.n_gpus_per_node x trainer.nnodes)"
        )
    # The critic trains only with GAE (GRPO and the other estimators have none).
    owners = [ACTOR]
    if values.get("algorithm.adv_estimator", "gae") == "gae":
        owners.append(CRITIC)
    for owner in owners:
        mini = _int(values, f"{owner}.ppo_mini_batch_size")
        micro = _int(values, f"{owner}.ppo_micro_batch_size_per_gpu")
        if mini is None:
            continue
        if train is not None and train < mini:
            raise invalid(
                f"job {job_name}: data.train_batch_size={train} is smaller than"
                f" {owner}.ppo_mini_batch_size={mini}"
            )
        share = mini * n // workers
        if share <= 0:
            raise invalid(
                f"job {job_name}: {owner}.ppo_mini_batch_size={mini} x rollout.n={n}"
                f" leaves no sequence for each of its {workers} workers"
            )
        if micro is not None and (micro <= 0 or share % micro):
            raise invalid(
                f"job {job_name}: {owner}.ppo_micro_batch_size_per_gpu={micro} does not divide"
                f" a worker's mini batch ({owner}.ppo_mini_batch_size={mini} x rollout.n={n}"
                f" / {workers} workers = {share}); choose a divisor of {share}"
            )
