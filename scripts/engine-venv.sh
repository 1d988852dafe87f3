#!/usr/bin/env bash
# The venv the engine's tests run in: the same lock the test hosts install
# (torch, transformers, verl's dependencies) plus pytest at the controller's
# pins, all from the shared wheelhouse. Built, verified and linked by the
# engine's own `oldgpu venv ensure` (run from src/: nothing is installed yet),
# kept outside the clone, named by the lock's hash; prints the venv's path.
#   scripts/engine-venv.sh [LOCK NAME]   # another lock's test venv under venvs/NAME:
#   scripts/engine-venv.sh files/requirements/verl-0.9.0.lock verl09  # verl 0.9.0's CPU tests
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
lock=$root/${1:-files/requirements/pypi.lock}
name=${2:-engine}
cache=${OLDGPU_CACHE:-/var/cache/oldgpu}
wheelhouse=${OLDGPU_WHEELHOUSE:-$cache/wheelhouse}
# pytest and what it needs (pip check names anything missing from this list).
test_pins=$(grep -E '^(pytest|pluggy|iniconfig|pygments)==' "$root/requirements/controller.txt")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pins_file=$tmp/engine-test-pins.txt
echo "$test_pins" >"$pins_file"
"$root/scripts/wheelhouse.sh" "$lock" >&2
"$root/scripts/wheelhouse.sh" "$pins_file" >&2
extras=()
for pin in $test_pins; do extras+=(--extra "$pin"); done
doc=$(PYTHONPATH=$root/src python3 -m oldgpu venv ensure "$lock" "$cache/venvs/$name" \
  --no-index --wheelhouse "$wheelhouse" "${extras[@]}" --keep 1 --json)
python3 -c 'import json, sys; print(json.loads(sys.argv[1])["path"])' "$doc"
