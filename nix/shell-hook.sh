# shellcheck shell=bash
# Sourced by `nix develop` (devShells.default): the host driver's libraries and
# a venv that holds exactly the lock the python_env role installs.
#
# Why a venv and not nixpkgs' Python packages: the roles install torch
# 2.6.0+cu118 and its closure from files/requirements/cu118.lock, the build
# PyTorch publishes for CUDA 11.8 with sm_50..sm_90 kernels. nixpkgs has no
# such torch (its torch is another version, built for other CUDA releases), so
# a nixpkgs Python set could not be "the same environment". The venv is made
# with nixpkgs' Python of the pinned version, by pip from the same lock with
# --no-deps, then checked with `oldgpu lock-check` like the role does.
#
# From the mkShell: OLDGPU_PYTHON, OLDGPU_LOCKS, OLDGPU_RUNTIME_LIBS, VERL_DIR.
# From the user:
#   OLDGPU_TORCH_INDEX_URL  PyTorch's cu118 wheel index or a mirror of it (the
#                           role's python_env_torch_index_url); needed for cu118
#   OLDGPU_INDEX_URL        the index for everything else (default: pip's config)
#   OLDGPU_WHEELHOUSE       a directory of wheels: install from it alone
#   OLDGPU_LOCK_VARIANT     cu118 (default) or pypi (the CPU hosts' lock)
#   OLDGPU_VENVS_DIR        where venvs are kept (default ~/.cache/oldgpu/venvs)

_oldgpu_build_venv() {
  local lock=$1 venv=$2
  local sources=()
  if [[ -n ${OLDGPU_WHEELHOUSE:-} ]]; then
    sources+=(--no-index --find-links "$OLDGPU_WHEELHOUSE")
  else
    [[ -z ${OLDGPU_INDEX_URL:-} ]] || sources+=(--index-url "$OLDGPU_INDEX_URL")
    [[ -z ${OLDGPU_TORCH_INDEX_URL:-} ]] || sources+=(--extra-index-url "$OLDGPU_TORCH_INDEX_URL")
  fi
  echo "oldgpu shell: installing $(basename "$lock") into $venv" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  if "$OLDGPU_PYTHON" -m venv "$venv" &&
    "$venv/bin/python" -m pip install --no-deps --no-cache-dir --disable-pip-version-check \
      --progress-bar off -q -r "$lock" "${sources[@]}" &&
    oldgpu lock-check "$lock" --python "$venv/bin/python" --ignore verl >&2 &&
    "$venv/bin/python" -m pip check >&2; then
    touch "$venv/.complete"
    return 0
  fi
  rm -rf "$venv"
  echo "oldgpu shell: the venv could not be built from $(basename "$lock") (see above);" \
    "the shell has no training venv" >&2
  return 1
}

_oldgpu_shell() {
  local variant=${OLDGPU_LOCK_VARIANT:-cu118}
  local lock=$OLDGPU_LOCKS/$variant.lock
  if [[ ! -f $lock ]]; then
    echo "oldgpu shell: OLDGPU_LOCK_VARIANT=$variant: no such lock (cu118 or pypi)" >&2
    return 0
  fi

  local driver
  if driver=$(oldgpu-host-driver); then
    LD_LIBRARY_PATH=$driver:$OLDGPU_RUNTIME_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  else
    LD_LIBRARY_PATH=$OLDGPU_RUNTIME_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  export LD_LIBRARY_PATH

  local venvs=${OLDGPU_VENVS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/oldgpu/venvs}
  local key
  key=$({
    cat "$lock"
    printf '%s' "$OLDGPU_PYTHON"
  } | sha256sum | cut -c1-16)
  local venv=$venvs/$variant-$key
  if [[ ! -e $venv/.complete ]]; then
    if [[ $variant == cu118 && -z ${OLDGPU_TORCH_INDEX_URL:-} && -z ${OLDGPU_WHEELHOUSE:-} ]]; then
      cat >&2 <<EOF
oldgpu shell: no training venv yet: torch $(grep -E '^torch==' "$lock" | cut -d= -f3) is only on
  PyTorch's cu118 wheel index. Set OLDGPU_TORCH_INDEX_URL to it (or a mirror), or
  OLDGPU_WHEELHOUSE to a directory of its wheels, and enter the shell again
  (OLDGPU_LOCK_VARIANT=pypi takes the CPU hosts' lock instead).
EOF
      return 0
    fi
    _oldgpu_build_venv "$lock" "$venv" || return 0
  fi
  export VIRTUAL_ENV=$venv VERL_VENV=$venv OLDGPU_VENV_PYTHON=$venv/bin/python
  export PATH=$venv/bin:$PATH
  export PYTHONPATH=$VERL_DIR${PYTHONPATH:+:$PYTHONPATH}
  echo "oldgpu shell: venv $venv ($variant), verl $VERL_DIR" >&2
}

_oldgpu_shell
unset -f _oldgpu_shell _oldgpu_build_venv
