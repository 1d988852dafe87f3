#!/usr/bin/env bash
# Set up the controller once: a venv with the pinned tools and the engine, and
# the Ansible collections the roles use, unpacked from the `ansible` wheel on
# the configured pip index (Galaxy is unreachable from our machines and from
# many air-gapped fleets). Re-running is cheap: each step checks its stamp.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
venv=${OLDGPU_VENV:-$root/.venv}
cache=${OLDGPU_CACHE:-/var/cache/oldgpu}
python=${PYTHON:-python3}
lock=$root/requirements/controller.txt
pins=$root/requirements/controller.in
collections=(community/general ansible/posix containers/podman)

log() { printf '[bootstrap] %s\n' "$*"; }

mkdir -p "$cache"
lock_hash=$(sha256sum "$lock" "$root/pyproject.toml" | sha256sum | cut -c1-16)
if [[ ! -x $venv/bin/python || "$(cat "$venv/.oldgpu-lock" 2>/dev/null)" != "$lock_hash" ]]; then
  log "creating $venv from $(basename "$lock")"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -r "$lock"
  "$venv/bin/python" -m pip install -q --no-deps -e "$root"
  echo "$lock_hash" >"$venv/.oldgpu-lock"
else
  log "venv up to date ($venv)"
fi

ansible_version=$(sed -n 's/^ansible==\([^ ]*\).*/\1/p' "$pins")
[[ -n $ansible_version ]] || { echo "no ansible== pin in $pins" >&2; exit 1; }
dest=$root/.collections
stamp=$dest/.from-ansible-$ansible_version
if [[ ! -f $stamp ]]; then
  wheel_dir=$cache/wheels/ansible-$ansible_version
  if ! ls "$wheel_dir"/ansible-"$ansible_version"-*.whl >/dev/null 2>&1; then
    log "downloading ansible==$ansible_version (for its collections)"
    "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: -d "$wheel_dir" "ansible==$ansible_version"
  fi
  wheel=$(ls "$wheel_dir"/ansible-"$ansible_version"-*.whl | head -n1)
  rm -rf "$dest" && mkdir -p "$dest"
  patterns=()
  for c in "${collections[@]}"; do patterns+=("ansible_collections/$c/*"); done
  log "unpacking ${collections[*]}"
  "$venv/bin/python" - "$wheel" "$dest" "${patterns[@]}" <<'PY'
import fnmatch, sys, zipfile
wheel, dest, *patterns = sys.argv[1:]
with zipfile.ZipFile(wheel) as zf:
    members = [n for n in zf.namelist() if any(fnmatch.fnmatch(n, p) for p in patterns)]
    zf.extractall(dest, members)
print(f"{len(members)} files")
PY
  touch "$stamp"
else
  log "collections up to date ($dest)"
fi
log "ok: activate with 'source $venv/bin/activate'"
