"""Polling a test host until something holds, for the scenarios' testinfra tests."""

from __future__ import annotations

import time

import pytest


def wait_for(what, check, timeout=900, every=2, explain=None):
    """``check()``'s first truthy answer, polled every ``every`` s; fail after ``timeout`` s
    with ``explain()``'s account of the state (a unit's status, its journal) when given."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    seen = f"\n{explain()}" if explain else ""
    pytest.fail(f"timed out after {timeout} s waiting for {what}{seen}")
