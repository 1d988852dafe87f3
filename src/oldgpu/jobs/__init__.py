"""``oldgpu job``: one training job's settings, and the verl command they make.

A job is declared once (Ansible's ``verl_jobs`` or the NixOS module's
``services.verl-train.jobs``) and lands on the host as ``/etc/verl/jobs/<name>.env``:
only what the user chose. Everything derived — the profile of the GPUs fitted
now, the planner's batch sizes and offload — is decided here when the job
starts, so a card swap needs no re-provisioning.

``FIELDS`` is the one list of job settings; the role's argument specs and the
Nix module's options are tested against it. The env file format is
``KEY='value'`` per line: systemd's EnvironmentFile= and a shell's ``.`` read it
alike, so values may hold neither a quote nor a newline.

Exit codes the unit's RestartPreventExitStatus= names: 3, the doctor's
preflight failed (``oldgpu.doctor.DOCTOR_FAILED``); 4, this job's settings are
invalid (``CONFIG_INVALID``).

Where each part lives (a new setting goes into ``settings.py``):

* ``settings.py``: the fields (``FIELDS``), their defaults and checks (``job_from_mapping``;
  ``check_for_unit``, what the unit's sandbox hides), the env file (``render_env``,
  ``parse_env``, ``load_job``);
* ``unit.py``: what ``verl-train@.service`` hides from a job, read from the unit file;
* ``compose.py``: the job on this host: its profile, cards, plan, overrides, argv and
  environment (``compose``, ``compose_for_host``);
* ``cli.py``: ``oldgpu job``'s sub-commands.
"""

from __future__ import annotations

from oldgpu.jobs.cli import add_dir_args, add_parser, run_command, run_env, run_fields
from oldgpu.jobs.compose import (
    compose,
    compose_for_host,
    environment,
    job_overrides,
    merge_overrides,
    override_key,
    plan_inputs,
    resolve_profile,
)
from oldgpu.jobs.settings import (
    CONFIG_INVALID,
    ENV_FIELDS,
    ENV_PREFIX,
    FIELD_BY_NAME,
    FIELDS,
    FORBIDDEN,
    JOBS_DIR,
    LOG_DIR,
    NAME_RE,
    PROTECTED_HOME,
    REQUIRED,
    STATE_DIR,
    Field,
    Job,
    check_for_unit,
    job_from_env,
    job_from_mapping,
    job_names,
    load_job,
    parse_env,
    render_env,
)

__all__ = [
    "CONFIG_INVALID",
    "ENV_FIELDS",
    "ENV_PREFIX",
    "FIELDS",
    "FIELD_BY_NAME",
    "FORBIDDEN",
    "JOBS_DIR",
    "LOG_DIR",
    "NAME_RE",
    "PROTECTED_HOME",
    "REQUIRED",
    "STATE_DIR",
    "Field",
    "Job",
    "add_dir_args",
    "add_parser",
    "check_for_unit",
    "compose",
    "compose_for_host",
    "environment",
    "job_from_env",
    "job_from_mapping",
    "job_names",
    "job_overrides",
    "load_job",
    "merge_overrides",
    "override_key",
    "parse_env",
    "plan_inputs",
    "render_env",
    "resolve_profile",
    "run_command",
    "run_env",
    "run_fields",
]
