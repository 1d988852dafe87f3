#!/usr/bin/env bash
# Set up the controller once: a venv with the pinned tools and the engine, and
# the Ansible collections the roles use, unpacked from the `ansible` wheel on
# the configured pip index (Galaxy is unreachable from our machines and from
# many air-gapped fleets). Re-running is cheap: each step checks its stamp.
#
# Root is not needed. What each step needs is checked first, before anything
# changes; each gap stops the script with a named error, its fix and its own exit code:
#   10 controller-python-missing       no interpreter at $PYTHON (default python3)
#   11 controller-python-too-old       Python < 3.11 (ansible-core 2.19 needs 3.11)
#   12 controller-python-venv-missing  no ensurepip: the distribution's python3-venv is not installed
#   13 controller-cache-unwritable     $OLDGPU_CACHE (default /var/cache/oldgpu) cannot be written
#   14 controller-checkout-unwritable  the venv's directory or the checkout (.collections) cannot be written
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
venv=${OLDGPU_VENV:-$root/.venv}
cache=${OLDGPU_CACHE:-/var/cache/oldgpu}
python=${PYTHON:-python3}
lock=$root/requirements/controller.txt
pins=$root/requirements/controller.in
collections=(community/general ansible/posix containers/podman)
dest=$root/.collections
user=$(id -un 2>/dev/null || id -u)

log() { printf '[bootstrap] %s\n' "$*"; }
refuse() { # code exit-status message fix
  printf '[bootstrap] %s: %s\n[bootstrap]   fix: %s\n[bootstrap] Nothing was changed.\n' "$1" "$3" "$4" >&2
  exit "$2"
}
# Whether this user can create or write PATH: the path itself if it exists,
# else its nearest existing parent (mkdir -p creates the rest).
can_write() {
  local p=$1
  while [[ ! -e $p ]]; do p=$(dirname "$p"); done
  [[ -d $p && -w $p && -x $p ]]
}

ansible_version=$(sed -n 's/^ansible==\([^ ]*\).*/\1/p' "$pins")
[[ -n $ansible_version ]] || { echo "no ansible== pin in $pins" >&2; exit 1; }
lock_hash=$(sha256sum "$lock" "$root/pyproject.toml" | sha256sum | cut -c1-16)
need_venv=true
[[ -x $venv/bin/python && "$(cat "$venv/.oldgpu-lock" 2>/dev/null)" == "$lock_hash" ]] && need_venv=false
stamp=$dest/.from-ansible-$ansible_version
wheel_dir=$cache/wheels/ansible-$ansible_version
need_collections=true
[[ -f $stamp ]] && need_collections=false
need_download=false
if $need_collections && ! compgen -G "$wheel_dir/ansible-$ansible_version-*.whl" >/dev/null; then
  need_download=true
fi

# --- Preflight: nothing below changes anything ---
if $need_venv; then
  command -v "$python" >/dev/null 2>&1 ||
    refuse controller-python-missing 10 "no Python interpreter '$python' on PATH" \
      "install python3 (apt-get install python3), or point PYTHON at a Python >= 3.11"
  py_version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) ||
    refuse controller-python-missing 10 "'$python' does not run" "point PYTHON at a working Python >= 3.11"
  if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    refuse controller-python-too-old 11 \
      "'$python' is Python $py_version; ansible-core 2.19 (requirements/controller.in) needs Python >= 3.11" \
      "install a newer Python and name it: on Ubuntu 22.04, apt-get install python3.11 python3.11-venv (universe), then PYTHON=python3.11 $0"
  fi
  "$python" -c 'import ensurepip, venv' 2>/dev/null ||
    refuse controller-python-venv-missing 12 \
      "'$python' (Python $py_version) has no ensurepip, so it cannot create the controller's venv" \
      "apt-get install python3-venv (or python$py_version-venv when PYTHON names a non-default Python)"
  can_write "$(dirname "$venv")" && { [[ ! -e $venv ]] || [[ -w $venv ]]; } ||
    refuse controller-checkout-unwritable 14 "$user cannot write the venv directory $venv" \
      "run from a clone you own, or set OLDGPU_VENV to a directory you can write"
fi
if $need_collections; then
  { can_write "$root" && { [[ ! -e $dest ]] || [[ -w $dest ]]; }; } ||
    refuse controller-checkout-unwritable 14 "$user cannot write $dest (the collections ansible.cfg reads)" \
      "run from a clone you own"
  if $need_download && ! can_write "$wheel_dir"; then
    refuse controller-cache-unwritable 13 "$user cannot write the cache $cache (OLDGPU_CACHE)" \
      "run as root, or set OLDGPU_CACHE to a directory you can write, e.g. OLDGPU_CACHE=\$HOME/.cache/oldgpu $0"
  fi
fi

# --- Changes ---
if $need_venv; then
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

if $need_collections; then
  if $need_download; then
    log "downloading ansible==$ansible_version (for its collections)"
    mkdir -p "$wheel_dir"
    "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: -d "$wheel_dir" "ansible==$ansible_version"
  fi
  wheel=$(compgen -G "$wheel_dir/ansible-$ansible_version-*.whl" | head -n1)
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
