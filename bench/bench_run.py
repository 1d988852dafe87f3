"""Running a step of a benchmark in another process: its output, or the benchmark ends.

The bench scripts run the engine, a fresh interpreter per variant, or a build in a
subprocess; a step that fails ends the whole run with what the step printed, since a
benchmark that goes on past a broken step only measures the breakage.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence


def run_checked(argv: Sequence[str], env: Mapping[str, str], what: str) -> str:
    """``argv``'s stdout; on a non-zero exit, SystemExit with ``what``, the code, the output."""
    proc = subprocess.run(list(argv), env=dict(env), capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout
