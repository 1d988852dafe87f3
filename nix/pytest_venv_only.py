"""pytest plugin for checks.engine-tests (`-p pytest_venv_only`).

The engine is standard-library Python, and the flake's check runs its tests
on a plain interpreter. A test that fails because a package of the training
venv is missing here (torch, tensorboard, ...) is reported as skipped, with
the reason: `make unit` runs it in the engine's venv, which has the lock.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    excinfo = call.excinfo
    if report.passed or excinfo is None or not excinfo.errisinstance(ModuleNotFoundError):
        return
    missing = (excinfo.value.name or "").split(".")[0]
    if missing and missing != "oldgpu":
        report.outcome = "skipped"
        report.longrepr = (
            str(item.path),
            item.location[1] or 0,
            f"needs {missing} (the training venv's): runs in make unit",
        )
