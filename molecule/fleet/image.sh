#!/usr/bin/env bash
# The fleet scenario's dependency step: build localhost/oldgpu-stack:fleet (the
# Containerfile beside this script) from the jobs scenario's image, or stop at
# once, before any host is created, when that image is missing.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
base=localhost/oldgpu-stack:jobs
image=localhost/oldgpu-stack:fleet
if ! podman image exists "$base"; then
  cat >&2 <<MSG
fleet-image-missing: $base does not exist. The fleet's three hosts start from the
jobs scenario's converged host, which its side_effect step commits as that image.
Run the jobs scenario first (make molecule SCENARIOS="jobs fleet", or
molecule test -s jobs), then the fleet.
MSG
  exit 2
fi
if ! podman volume exists oldgpu-jobs-venvs; then
  echo "fleet-venvs-missing: the volume oldgpu-jobs-venvs (the jobs scenario's venvs) does not exist. Run the jobs scenario first." >&2
  exit 2
fi
base_id=$(podman image inspect --format '{{.Id}}' "$base")
old_id=$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)
old_base=$(podman image inspect --format '{{index .Labels "org.oldgpu.base"}}' "$image" 2>/dev/null || true)
# Cached: a rebuild takes a few seconds only when the jobs image changed.
podman build --pull=never --quiet --label "org.oldgpu.base=$base_id" -t "$image" \
  -f "$here/Containerfile" "$here" >/dev/null
new_id=$(podman image inspect --format '{{.Id}}' "$image")
echo "fleet image: $image ($new_id) from $base ($base_id)"
# Each jobs run commits a new image of several GB: drop the previous fleet image
# and the jobs image it came from once nothing names them (the cache would fill up).
if [[ -n $old_id && $old_id != "$new_id" ]]; then
  podman rmi "$old_id" >/dev/null 2>&1 || true
  if [[ -n $old_base && $old_base != "$base_id" ]] &&
    [[ $(podman image inspect --format '{{len .RepoTags}}' "$old_base" 2>/dev/null) == 0 ]]; then
    podman rmi "$old_base" >/dev/null 2>&1 || true
  fi
fi
