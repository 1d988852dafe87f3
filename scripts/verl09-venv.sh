#!/usr/bin/env bash
# The venv verl 0.9.0's CPU tests run in (tests/test_rollout_verl09.py and the 0.9.0
# rollout tests): the release's own lock (files/requirements/verl-0.9.0.lock, the one the
# jobs scenario installs) plus pytest at the controller's pins, all from the shared
# wheelhouse that `make prepare` fills. Built, verified and linked by `oldgpu venv
# ensure`, kept outside the clone, named by the lock's hash; prints the venv's path.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
lock=$root/files/requirements/verl-0.9.0.lock
cache=${OLDGPU_CACHE:-/var/cache/oldgpu}
wheelhouse=${OLDGPU_WHEELHOUSE:-$cache/wheelhouse}
test_pins=$(grep -E '^(pytest|pluggy|iniconfig|pygments)==' "$root/requirements/controller.txt")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pins_file=$tmp/verl09-test-pins.txt
echo "$test_pins" >"$pins_file"
"$root/scripts/wheelhouse.sh" "$lock" >&2
"$root/scripts/wheelhouse.sh" "$pins_file" >&2
extras=()
for pin in $test_pins; do extras+=(--extra "$pin"); done
doc=$(PYTHONPATH=$root/src python3 -m oldgpu venv ensure "$lock" "$cache/venvs/verl09" \
  --no-index --wheelhouse "$wheelhouse" "${extras[@]}" --keep 1 --json)
python3 -c 'import json, sys; print(json.loads(sys.argv[1])["path"])' "$doc"
