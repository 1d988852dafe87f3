#!/usr/bin/env bash
# The venv the engine's tests run in: the same lock the test hosts install
# (torch, transformers, verl's dependencies), from the shared wheelhouse,
# plus pytest. Kept outside the clone, keyed by the lock's hash; prints its path.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
lock=$root/files/requirements/pypi.lock
cache=${OLDGPU_CACHE:-/var/cache/oldgpu}
wheelhouse=${OLDGPU_WHEELHOUSE:-$cache/wheelhouse}
pytest_pin=$(grep -E '^pytest==' "$root/requirements/controller.txt")
key=$(cat "$lock" <(echo "$pytest_pin") | sha256sum | cut -c1-16)
venv=$cache/venvs/engine-$key
if [[ ! -f $venv/.complete ]]; then
  "$root/scripts/wheelhouse.sh" "$lock" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  echo "[engine-venv] installing $(basename "$lock") into $venv" >&2
  "$venv/bin/python" -m pip install -q --no-index --find-links "$wheelhouse" -r "$lock" >&2
  "$venv/bin/python" -m pip install -q "$pytest_pin" >&2
  # pip resolves silently around conflicts; the pins must have held.
  "$venv/bin/python" - "$lock" >&2 <<'PY'
import sys
from importlib.metadata import version
want = dict(l.strip().split("==") for l in open(sys.argv[1]) if "==" in l and not l.startswith("#"))
for name in ("torch", "triton", "transformers"):
    assert version(name) == want[name], f"{name} {version(name)} != lock {want[name]}"
PY
  touch "$venv/.complete"
fi
echo "$venv"
