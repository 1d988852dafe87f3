# shellcheck shell=bash
# Source me: points podman at the project's config and at storage kept outside
# the clone (CI clones anew each run; images and layers are reused).
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_cache=${OLDGPU_CACHE:-/var/cache/oldgpu}
mkdir -p "$_cache/podman/storage" "$_cache/podman/run"
cat >"$_cache/podman/storage.conf" <<CONF
[storage]
driver = "overlay"
graphroot = "$_cache/podman/storage"
runroot = "$_cache/podman/run"
CONF
export CONTAINERS_CONF=$_root/tests/podman/containers.conf
export CONTAINERS_STORAGE_CONF=$_cache/podman/storage.conf
unset _root _cache
