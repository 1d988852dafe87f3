#!/usr/bin/env bash
# The flake's offline checks (`make nix`): Debian's nix-bin (Nix 2.8), then
# tests/nix/check_flake.py, which parses every .nix file and evaluates the
# flake against the stub nixpkgs in tests/nix/stub-nixpkgs (no nixpkgs can be
# fetched here). Installs only what is missing; prints what it ran.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}

if ! command -v nix >/dev/null 2>&1; then
  echo "[nix] installing nix-bin"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nix-bin >/dev/null
fi
echo "[nix] $(nix --version)"
cd "$root"
exec "$python" -m pytest -q -p no:cacheprovider tests/nix/check_flake.py "$@"
