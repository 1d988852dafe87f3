# shellcheck shell=bash
# Sourced by `nix develop` (devShells.default): the host driver's libraries and
# a venv that holds exactly the lock the python_env role installs.
#
# Why a venv and not nixpkgs' Python packages: the roles install torch
# 2.6.0+cu118 and its closure from files/requirements/cu118.lock, the build
# PyTorch publishes for CUDA 11.8 with sm_50..sm_90 kernels. nixpkgs has no
# such torch (its torch is another version, built for other CUDA releases), so
# a nixpkgs Python set could not be "the same environment". The venv is made
# with nixpkgs' Python of the pinned version by `oldgpu venv ensure`, the
# command the python_env role runs: pip installs the same lock with --no-deps,
# the engine verifies the venv (lock-check, pip check) and links it in.
#
# From the mkShell: OLDGPU_PYTHON, OLDGPU_LOCKS, OLDGPU_RUNTIME_LIBS, VERL_DIR.
# From the user:
#   OLDGPU_TORCH_INDEX_URL  PyTorch's cu118 wheel index or a mirror of it (the
#                           role's python_env_torch_index_url); needed for cu118
#   OLDGPU_INDEX_URL        the index for everything else (default: pip's config)
#   OLDGPU_WHEELHOUSE       a directory of wheels: install from it alone
#   OLDGPU_LOCK_VARIANT     cu118 (default) or pypi (the CPU hosts' lock)
#   OLDGPU_VENVS_DIR        where venvs are kept, per variant (default ~/.cache/oldgpu/venvs)

_oldgpu_field() {
  "$OLDGPU_PYTHON" -c 'import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"
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

  local dir=${OLDGPU_VENVS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/oldgpu/venvs}/$variant
  local args=(venv ensure "$lock" "$dir" --python "$OLDGPU_PYTHON" --ignore verl --keep 1 --json)
  if [[ -n ${OLDGPU_WHEELHOUSE:-} ]]; then
    args+=(--no-index --wheelhouse "$OLDGPU_WHEELHOUSE")
  else
    [[ -z ${OLDGPU_INDEX_URL:-} ]] || args+=(--index-url "$OLDGPU_INDEX_URL")
    [[ -z ${OLDGPU_TORCH_INDEX_URL:-} ]] || args+=(--extra-index-url "$OLDGPU_TORCH_INDEX_URL")
  fi
  local doc
  # Without a source for torch's cu118 build, say so rather than let pip fail
  # (a venv built before is still used).
  if [[ $variant == cu118 && -z ${OLDGPU_TORCH_INDEX_URL:-} && -z ${OLDGPU_WHEELHOUSE:-} ]] &&
    { ! doc=$(oldgpu "${args[@]}" --check) || [[ $(_oldgpu_field "$doc" built) == True ]]; }; then
    cat >&2 <<EOF
oldgpu shell: no training venv yet: torch $(grep -E '^torch==' "$lock" | cut -d= -f3) is only on
  PyTorch's cu118 wheel index. Set OLDGPU_TORCH_INDEX_URL to it (or a mirror), or
  OLDGPU_WHEELHOUSE to a directory of its wheels, and enter the shell again
  (OLDGPU_LOCK_VARIANT=pypi takes the CPU hosts' lock instead).
EOF
    return 0
  fi
  if ! doc=$(oldgpu "${args[@]}"); then
    echo "oldgpu shell: the venv could not be built from $(basename "$lock") (see above);" \
      "the shell has no training venv" >&2
    return 0
  fi
  local venv
  venv=$(_oldgpu_field "$doc" path)
  export VIRTUAL_ENV=$venv VERL_VENV=$venv OLDGPU_VENV_PYTHON=$venv/bin/python
  export PATH=$venv/bin:$PATH
  export PYTHONPATH=$VERL_DIR${PYTHONPATH:+:$PYTHONPATH}
  echo "oldgpu shell: venv $venv ($variant), verl $VERL_DIR" >&2
}

_oldgpu_shell
unset -f _oldgpu_shell _oldgpu_field
