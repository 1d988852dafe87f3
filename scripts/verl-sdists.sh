#!/usr/bin/env bash
# The sdists of the newer verl releases (files/pins.json's verl_releases) in the shared
# wheelhouse, each checked against its pinned sha256 by the engine (`oldgpu verl-sdist`,
# which keeps a good copy and downloads nothing then): the test hosts' verl role takes
# them from the wheelhouse it mounts, as a fleet's hosts would from theirs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${OLDGPU_CACHE:-/var/cache/oldgpu}
dir=${OLDGPU_WHEELHOUSE:-$cache/wheelhouse}
mkdir -p "$dir"
for version in $(python3 -c 'import json,sys;print(" ".join(json.load(open(sys.argv[1])).get("verl_releases", {})))' "$root/files/pins.json"); do
  # The copy the unit tests downloaded, if any, is the mirror; else pip (the configured index).
  mirror=()
  [[ -f $cache/sdists/verl-$version.tar.gz ]] && mirror=(--mirror "$cache/sdists")
  echo "[verl-sdists] $(PYTHONPATH=$root/src python3 -m oldgpu verl-sdist "$version" "$dir" "${mirror[@]}")"
done
