#!/usr/bin/env bash
# Fill the shared wheelhouse with every wheel of a lock, once. Test hosts get it
# mounted as python_env_wheelhouse, and the engine's test venv installs from it,
# so a CI run downloads each wheel at most once. sdists are built into wheels
# here so no host ever compiles anything.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
lock=${1:-$root/files/requirements/pypi.lock}
cache=${OLDGPU_CACHE:-/var/cache/oldgpu}
dir=${OLDGPU_WHEELHOUSE:-$cache/wheelhouse}
stamp=$dir/.lock-$(sha256sum "$lock" | cut -c1-16)
if [[ -f $stamp ]]; then
  echo "[wheelhouse] up to date for $(basename "$lock") ($dir)"
  exit 0
fi
mkdir -p "$dir"
echo "[wheelhouse] filling $dir from $(basename "$lock")"
python3 -m pip wheel -q --no-deps --prefer-binary -r "$lock" -w "$dir"
touch "$stamp"
echo "[wheelhouse] $(find "$dir" -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1)"
