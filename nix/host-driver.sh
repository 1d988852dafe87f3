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
# OLDGPU_MIN_DRIVER: the oldest driver the pinned CUDA runs on (a warning).
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

# An old driver runs CUDA 11.8 only through minor-version compatibility: say so.
if [[ -n ${OLDGPU_MIN_DRIVER:-} && -r /proc/driver/nvidia/version ]]; then
  have=$(grep -oE 'Kernel Module +[0-9.]+' /proc/driver/nvidia/version | grep -oE '[0-9.]+$' || true)
  if [[ -n $have && $(printf '%s\n%s\n' "$OLDGPU_MIN_DRIVER" "$have" | sort -V | head -n 1) != "$OLDGPU_MIN_DRIVER" ]]; then
    echo "oldgpu-host-driver: driver $have is older than $OLDGPU_MIN_DRIVER, which CUDA 11.8 asks for" >&2
  fi
fi
echo "$out"
