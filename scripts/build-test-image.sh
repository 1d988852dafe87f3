#!/usr/bin/env bash
# Build localhost/debian12-systemd, a stock-looking Debian 12 with systemd as
# PID 1, with debootstrap from the Debian mirror this machine's apt already
# uses (no container registry is reachable). OLDGPU_TEST_SUITE=trixie builds
# localhost/debian13-systemd the same way, from the same archive. Rebuilds only
# when this recipe changes: the image carries the recipe's hash as a label.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/podman-env.sh
source "$root/scripts/podman-env.sh"
suite=${OLDGPU_TEST_SUITE:-bookworm}
case $suite in
  bookworm) release=12 ;;
  trixie) release=13 ;;
  *) echo "[image] OLDGPU_TEST_SUITE=$suite: bookworm or trixie" >&2; exit 2 ;;
esac
image=${OLDGPU_TEST_IMAGE:-localhost/debian$release-systemd}
include=systemd,systemd-sysv,dbus,python3,python3-apt,sudo,ca-certificates,procps,iproute2
recipe=$( (cat "$0"; echo "$include $suite") | sha256sum | cut -c1-16)

have=$(podman image inspect "$image" --format '{{ index .Labels "oldgpu.recipe" }}' 2>/dev/null || true)
if [[ $have == "$recipe" ]]; then
  echo "[image] $image is current (recipe $recipe)"
  exit 0
fi

# The mirror and security mirror the host's apt uses: deb822 first, then one-line.
read_mirror() {  # $1: suite to look for
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] || continue
    awk -v s="$1" 'BEGIN{RS=""} $0 ~ ("Suites:[^\n]*(^| )" s "( |$|\n)") {
        if (match($0, /URIs:[ \t]*[^ \t\n]+/)) { u=substr($0,RSTART,RLENGTH); sub(/URIs:[ \t]*/,"",u); print u; exit } }' "$f"
  done | head -n1
  if [[ -f /etc/apt/sources.list ]]; then
    awk -v s="$1" '$1=="deb" && $3==s {print $2; exit}' /etc/apt/sources.list
  fi
}
# A suite this host's apt does not list (trixie on a Debian 12 machine) comes from
# the same archive: the mirror of the host's own suite.
own=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
mirror=$(read_mirror "$suite" | head -n1)
[[ -n $mirror || -z $own ]] || mirror=$(read_mirror "$own" | head -n1)
security=$(read_mirror "$suite-security" | head -n1)
[[ -n $security || -z $own ]] || security=$(read_mirror "$own-security" | head -n1)
[[ -n $mirror ]] || { echo "[image] no Debian mirror for $suite in this host's apt sources" >&2; exit 1; }
echo "[image] building $image from $mirror (recipe $recipe)"

work=$(mktemp -d /var/tmp/oldgpu-rootfs.XXXXXX)
trap 'rm -rf "$work"' EXIT
rootfs=$work/rootfs
debootstrap --variant=minbase --include="$include" "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 ||
  { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }

# apt sources as a stock Debian 12 or 13 has them (deb822): `main` only. Enabling contrib and
# non-free is a role's job; an image that had them would make its test vacuous.
rm -f "$rootfs/etc/apt/sources.list"
{
  printf 'Types: deb\nURIs: %s\nSuites: %s %s-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' "$mirror" "$suite" "$suite"
  if [[ -n $security ]]; then
    printf '\nTypes: deb\nURIs: %s\nSuites: %s-security\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' "$security" "$suite"
  fi
} >"$rootfs/etc/apt/sources.list.d/debian.sources"

: >"$rootfs/etc/machine-id"
for unit in getty.target console-getty.service systemd-logind.service systemd-remount-fs.service; do
  ln -sf /dev/null "$rootfs/etc/systemd/system/$unit"
done
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin

tar -C "$rootfs" --numeric-owner -c . |
  podman import --quiet --change 'CMD=["/sbin/init"]' --change 'STOPSIGNAL=SIGRTMIN+3' \
    --change "LABEL=oldgpu.recipe=$recipe" - "$image" >/dev/null
echo "[image] built $image ($(podman image inspect "$image" --format '{{.Size}}') bytes)"
