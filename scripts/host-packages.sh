#!/usr/bin/env bash
# Distribution packages the controller needs: podman (with runc, as crun
# refuses this kind of machine's cgroups), debootstrap for the test image, the
# PCI ID database the engine reads. Installs only what is missing, which needs
# root; a user who is not root passes when every package is there, and is told
# the command that installs the missing ones otherwise (exit 15,
# host-packages-missing), before anything changes.
set -euo pipefail
need=(podman runc uidmap slirp4netns fuse-overlayfs debootstrap pciutils pci.ids git python3-venv)
missing=()
for p in "${need[@]}"; do
  # A comparison, not `| grep -q`: under pipefail an early-exiting grep can fail the pipe.
  [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == "install ok installed" ]] || missing+=("$p")
done
((${#missing[@]})) || exit 0
if [[ $(id -u) -ne 0 ]]; then
  printf '[host] host-packages-missing: %s not installed, and installing needs root\n' "${missing[*]}" >&2
  printf '[host]   fix: sudo apt-get install --no-install-recommends %s\n' "${missing[*]}" >&2
  printf '[host] Nothing was changed.\n' >&2
  exit 15
fi
echo "[host] installing ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
