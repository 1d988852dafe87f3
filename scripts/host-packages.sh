#!/usr/bin/env bash
# Distribution packages the controller needs: podman (with runc, as crun
# refuses this kind of machine's cgroups), debootstrap for the test image, the
# PCI ID database the engine reads. Installs only what is missing.
set -euo pipefail
need=(podman runc uidmap slirp4netns fuse-overlayfs debootstrap pciutils pci.ids git python3-venv)
missing=()
for p in "${need[@]}"; do
  # A comparison, not `| grep -q`: under pipefail an early-exiting grep can fail the pipe.
  [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == "install ok installed" ]] || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[host] installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
