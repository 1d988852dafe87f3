"""Polling a test host until something holds, for the scenarios' testinfra tests."""

from __future__ import annotations

import time

import pytest


def wait_for(what, check, timeout=900, every=2):
    """``check()``'s first truthy answer, polled every ``every`` s; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")
