#!/usr/bin/env bash
# oldgpu-host-driver: print a directory that holds the host NVIDIA driver's
# user-space libraries (libcuda.so.1, libnvidia-ml.so.1, ...) and nothing else,
# for LD_LIBRARY_PATH in `nix develop`.
#
# Nix-built programs do not look in the host's /usr/lib, and putting all of
# /usr/lib on LD_LIBRARY_PATH would mix the host's C library into them. So, as
# nix-gl-host does: NixOS has the driver in /run/opengl-driver/lib; elsewhere
# the driver's own libraries are found through the host's ld.so cache (or the
# usual directories) and linked into a cache directory of their own.
#
# Exit 1, with the reason on stderr, when no driver is found.
# OLDGPU_LIBCUDA_DIR: a directory holding libcuda.so.1 (skips the search).
# OLDGPU_DRIVER_SEARCH_PATH: the directories searched (colon-separated).
# OLDGPU_MIN_DRIVER: the oldest driver the pinned CUDA runs on (named when none is found).
# OLDGPU_PROC_DRIVER_VERSION: the loaded module's version file (default: the kernel's).
set -euo pipefail

cache=${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/oldgpu/host-driver
default_dirs=/run/opengl-driver/lib:/usr/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu/nvidia/current:/usr/lib64:/usr/lib:/usr/lib/wsl/lib:/usr/local/nvidia/lib64
search=${OLDGPU_DRIVER_SEARCH_PATH:-$default_dirs}

found=""
if [[ -n ${OLDGPU_LIBCUDA_DIR:-} ]]; then
  if [[ ! -e $OLDGPU_LIBCUDA_DIR/libcuda.so.1 ]]; then
    echo "oldgpu-host-driver: OLDGPU_LIBCUDA_DIR=$OLDGPU_LIBCUDA_DIR holds no libcuda.so.1" >&2
    exit 1
  fi
  found=$OLDGPU_LIBCUDA_DIR/libcuda.so.1
elif [[ -z ${OLDGPU_DRIVER_SEARCH_PATH:-} && -e /run/opengl-driver/lib/libcuda.so.1 ]]; then
  # NixOS: the driver's libraries are already a directory of their own.
  echo /run/opengl-driver/lib
  exit 0
else
  # The host's own ld.so cache knows where its distribution put the driver.
  if [[ -z ${OLDGPU_DRIVER_SEARCH_PATH:-} ]]; then
    for ldconfig in /sbin/ldconfig /usr/sbin/ldconfig /sbin/ldconfig.real; do
      [[ -x $ldconfig ]] || continue
      found=$("$ldconfig" -p 2>/dev/null | grep -E '^[[:space:]]*libcuda\.so\.1 .*x86-64' |
        head -n 1 | sed -e 's/.*=> //') || found=""
      break
    done
  fi
  if [[ -z $found ]]; then
    IFS=: read -r -a dirs <<<"$search"
    for dir in "${dirs[@]}"; do
      if [[ -e $dir/libcuda.so.1 ]]; then
        found=$dir/libcuda.so.1
        break
      fi
    done
  fi
fi

if [[ -z $found ]]; then
  cat >&2 <<EOF
oldgpu-host-driver: no NVIDIA driver library (libcuda.so.1) found.
  Looked in the host's ld.so cache and in: ${search//:/ }
  CUDA will not work in this shell; CPU work (the cpu profile, tests) does.
  Install the host's NVIDIA driver (${OLDGPU_MIN_DRIVER:-a current one} or newer for CUDA 11.8),
  or set OLDGPU_LIBCUDA_DIR to the directory that holds libcuda.so.1.
EOF
  exit 1
fi

# The driver's libraries: those beside libcuda.so.1 and beside its target.
real=$(readlink -f "$found")
srcdirs=("$(dirname "$found")")
[[ $(dirname "$real") == "${srcdirs[0]}" ]] || srcdirs+=("$(dirname "$real")")
stamp=$(stat -L -c '%n %s %Y' "$found" | sha256sum | cut -c1-16)
out=$cache/$stamp
if [[ ! -e $out/libcuda.so.1 ]]; then
  mkdir -p "$cache"
  tmp=$(mktemp -d "$cache/.tmp.XXXXXX")
  chmod 0755 "$tmp"
  for dir in "${srcdirs[@]}"; do
    for lib in "$dir"/libcuda.so* "$dir"/libcudadebugger.so* "$dir"/libnvidia-ml.so* \
      "$dir"/libnvidia-ptxjitcompiler.so* "$dir"/libnvidia-nvvm.so* "$dir"/libnvidia-gpucomp.so*; do
      [[ -e $lib ]] || continue
      ln -sfn "$(readlink -f "$lib")" "$tmp/$(basename "$lib")"
    done
  done
  rm -rf "$out"
  mv -T "$tmp" "$out"
fi

# How the driver fits the pinned CUDA (only through minor-version compatibility,
# or not at all) is the engine's answer (`oldgpu driver --json`), not this
# script's. Only the loaded module is asked (no dpkg, no dkms): entering the
# shell stays fast.
proc=${OLDGPU_PROC_DRIVER_VERSION:-/proc/driver/nvidia/version}
if [[ -r $proc ]] && command -v oldgpu >/dev/null 2>&1; then
  fit="" message=""
  cuda_fit='import json, sys; c = json.load(sys.stdin)["cuda"]; print(c["fit"]); print(c["message"])'
  if doc=$(oldgpu driver --json --proc-version-file "$proc" 2>/dev/null); then
    { read -r fit && read -r message; } < <(python3 -c "$cuda_fit" <<<"$doc") || fit=""
  fi
  case $fit in
    ok | none) ;;
    "") echo "oldgpu-host-driver: oldgpu driver cannot read $proc; how the driver fits CUDA is unknown" >&2 ;;
    *) echo "oldgpu-host-driver: $message" >&2 ;;
  esac
fi
echo "$out"
