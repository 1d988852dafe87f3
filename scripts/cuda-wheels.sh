#!/usr/bin/env bash
# Put the CUDA 11.8 wheels that Debian 13 hosts install (files/pins.json cuda.wheels:
# nvcc, runtime, cupti, nvrtc, cccl) into the shared wheelhouse, once, so that the
# trixie scenario's host installs them offline like every other wheel.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${OLDGPU_CACHE:-/var/cache/oldgpu}
req=$cache/requirements/cuda-wheels.txt
mkdir -p "${req%/*}"
python3 -c 'import json, sys
wheels = json.load(open(sys.argv[1]))["cuda"]["wheels"]
print("\n".join(f"{name}=={version}" for name, version in sorted(wheels.items())))' \
  "$root/files/pins.json" >"$req.tmp"
mv "$req.tmp" "$req"
exec "$root/scripts/wheelhouse.sh" "$req"
