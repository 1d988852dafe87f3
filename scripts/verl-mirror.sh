#!/usr/bin/env bash
# A local bare git mirror of verl for the test hosts, built from verl's sdist
# on the pip index (GitHub is unreachable here): tag v<version> is the sdist as
# published; tag v9.9.9-unknown is the same tree claiming a version the patcher
# does not know (for the refusal test). Dates and names are fixed, so the
# commits are the same on every machine. Prints the mirror's path.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${OLDGPU_CACHE:-/var/cache/oldgpu}
version=$(python3 -c 'import json,sys;print(json.load(open(sys.argv[1]))["verl"]["version"])' "$root/files/pins.json")
mirror=$cache/verl-mirror/verl.git
stamp=$mirror/.oldgpu-$version-$(sha256sum "$0" | cut -c1-12)
if [[ -f $stamp ]]; then echo "$mirror"; exit 0; fi
sdists=$cache/sdists
mkdir -p "$sdists"
[[ -f $sdists/verl-$version.tar.gz ]] ||
  python3 -m pip download -q --no-deps --no-binary :all: -d "$sdists" "verl==$version" >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xzf "$sdists/verl-$version.tar.gz" -C "$work"
cd "$work/verl-$version"
export GIT_AUTHOR_NAME=oldgpu GIT_AUTHOR_EMAIL=oldgpu@localhost GIT_COMMITTER_NAME=oldgpu \
  GIT_COMMITTER_EMAIL=oldgpu@localhost GIT_AUTHOR_DATE=2025-07-23T00:00:00Z GIT_COMMITTER_DATE=2025-07-23T00:00:00Z
git init -q -b main .
git add -A
git commit -q -m "verl $version (from the sdist)"
git tag "v$version"
echo 9.9.9 >verl/version/version
git commit -q -am "claims verl 9.9.9"
git tag v9.9.9-unknown
rm -rf "$mirror"
mkdir -p "$(dirname "$mirror")"
git clone -q --bare . "$mirror"
touch "$stamp"
echo "$mirror"
