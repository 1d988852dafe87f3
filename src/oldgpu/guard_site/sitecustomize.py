"""Arm oldgpu's guard in every Python process of a job when ``OLDGPU_GUARD`` is set.

Put this directory first on PYTHONPATH (``oldgpu guard --env`` prints the line). With
``OLDGPU_GUARD`` unset or empty this does nothing but hand over to the next
``sitecustomize`` on ``sys.path``, if there is one (only the first is imported by
Python). It never imports torch itself: the guard hooks torch's import, so processes
that never use torch (Ray's helpers) pay nothing. Failures are reported on stderr and
in ``$OLDGPU_GUARD_LOG``; they never stop the interpreter from starting.
"""

import os
import sys


def _arm() -> None:
    try:
        import oldgpu.guard as guard
    except ImportError:
        # The engine is not installed: use the source tree this file lives in.
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path.append(os.path.dirname(os.path.dirname(here)))
        import oldgpu.guard as guard
    guard.install()


def _chain() -> None:
    """Run the next sitecustomize on sys.path (the one this file shadows)."""
    here = os.path.dirname(os.path.abspath(__file__))
    seen_self = False
    for entry in list(sys.path):
        path = os.path.abspath(entry or os.getcwd())
        if path == here:
            seen_self = True
            continue
        candidate = os.path.join(path, "sitecustomize.py")
        if seen_self and os.path.isfile(candidate):
            import importlib.util

            name = "_oldgpu_chained_sitecustomize"
            spec = importlib.util.spec_from_file_location(name, candidate)
            if spec and spec.loader:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            return


if os.environ.get("OLDGPU_GUARD", "").strip().lower() not in ("", "0", "off", "no", "false"):
    try:
        _arm()
    except Exception as exc:  # never break interpreter start-up
        sys.stderr.write(f"oldgpu guard: NOT armed in pid {os.getpid()}: {exc!r}\n")
        log = os.environ.get("OLDGPU_GUARD_LOG")
        if log:
            try:
                import json
                import time

                line = json.dumps(
                    {
                        "event": "install-failed",
                        "pid": os.getpid(),
                        "time": time.time(),
                        "error": repr(exc),
                    }
                )
                with open(log, "a", encoding="utf-8") as fh:
                    fh.write(line + "\n")
            except OSError:
                pass
try:
    _chain()
except Exception as exc:
    sys.stderr.write(f"oldgpu guard: the next sitecustomize failed: {exc!r}\n")
