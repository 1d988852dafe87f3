#!/usr/bin/env bash
# Set up the benchmark environment on the device machine (no network): unpack the carry
# (bench/pack_carry.py made it; the device tool brings .device/carry), add the fallback
# packages the machine lacks, write an env file with PYTHONPATH, record the machine, and
# check that verl and its dependencies import.
#
#   bench/setup.sh            # idempotent: a second call only re-checks
#
# Variables: PYTHON (default python3), CARRY (.device/carry), BENCH_HOME (.device/bench),
# OUT (where the records go; the device tool's output folder), BENCH_CPU=1 (a CPU test
# here: the verl tree is patched for the cpu profile from the local sdist instead).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
CARRY=${CARRY:-$root/.device/carry}
BENCH_HOME=${BENCH_HOME:-$root/.device/bench}
OUT=${OUT:-$BENCH_HOME/out}
env_dir=$BENCH_HOME/env
rec=$OUT/setup
mkdir -p "$env_dir" "$rec"
say() { echo "[setup] $*" >&2; }

[[ -f $CARRY/MANIFEST.json ]] || { say "no carry at $CARRY: run bench/pack_carry.py here first"; exit 2; }
stamp=$(sha256sum "$CARRY/MANIFEST.json" | cut -c1-16)-${BENCH_CPU:-0}
if [[ ! -f $env_dir/.complete || $(cat "$env_dir/.complete") != "$stamp" ]]; then
  t0=$(date +%s)
  rm -rf "${env_dir:?}"/*
  for a in site fallback ray verl engine; do
    [[ -f $CARRY/$a.tar.xz ]] || { say "missing $CARRY/$a.tar.xz"; exit 2; }
    xz -dc "$CARRY/$a.tar.xz" | tar -x -C "$env_dir"
  done
  if [[ ${BENCH_CPU:-0} == 1 ]]; then
    # CPU: the same verl, patched for the cpu profile (gloo, no GPU resources, ...).
    sdist=${VERL_SDIST:-/var/cache/oldgpu/sdists/verl-0.5.0.tar.gz}
    rm -rf "$env_dir/verl-tree" "$env_dir/verl-src"
    mkdir -p "$env_dir/verl-src"
    tar -xzf "$sdist" -C "$env_dir/verl-src"
    src=$(echo "$env_dir"/verl-src/verl-*)
    PYTHONPATH=$env_dir/engine "$PYTHON" -m oldgpu patch "$src" --profile cpu >&2
    mkdir -p "$env_dir/verl-tree"
    mv "$src/verl" "$src/.oldgpu-patch.json" "$env_dir/verl-tree/"
    rm -rf "$env_dir/verl-src"
  fi
  # Fallback packages: only those this python cannot import on its own.
  : > "$env_dir/fallback-used.txt"
  mkdir -p "$env_dir/extra"
  while read -r dist mods; do
    # shellcheck disable=SC2086
    if ! env -u PYTHONPATH "$PYTHON" - $mods >/dev/null 2>&1 <<'PY'
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
PY
    then
      cp -a "$env_dir/fallback/$dist/." "$env_dir/extra/"
      echo "$dist" >> "$env_dir/fallback-used.txt"
    fi
  done < <("$PYTHON" - "$env_dir/fallback/index.json" <<'PY'
import json, sys
for dist, info in sorted(json.load(open(sys.argv[1])).items()):
    print(dist, " ".join(info["modules"]))
PY
)
  rm -rf "$env_dir/fallback"
  say "unpacked in $(( $(date +%s) - t0 )) s; fallback packages added: $(tr '\n' ' ' < "$env_dir/fallback-used.txt")"
  # The guard's sitecustomize first, then the carried packages before the machine's own.
  pp="$env_dir/engine/oldgpu/guard_site:$env_dir/engine:$env_dir/site:$env_dir/ray:$env_dir/verl-tree:$env_dir/extra"
  cat > "$env_dir/env.sh" <<EOF
# Written by bench/setup.sh: source before running verl here.
export PYTHONPATH="$pp"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_HOME="$BENCH_HOME/hf-home"
export TOKENIZERS_PARALLELISM=true
export RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0
export PYTHONNOUSERSITE=1
export BENCH_PYTHON="$PYTHON"
EOF
  echo "$stamp" > "$env_dir/.complete"
fi

# shellcheck source=/dev/null
source "$env_dir/env.sh"
{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(hostname)"
  echo "python: $("$PYTHON" -c 'import sys; print(sys.version.split()[0])')"
  echo "torch: $("$PYTHON" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
  echo "cpus: $(nproc)"
  echo "memory: $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
  echo "fallback packages added: $(tr '\n' ' ' < "$env_dir/fallback-used.txt")"
} | tee "$rec/machine.txt" >&2
if command -v nvidia-smi >/dev/null; then
  nvidia-smi > "$rec/nvidia-smi.txt" 2>&1 || true
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader \
    | tee -a "$rec/machine.txt" >&2 || true
fi
cp "$CARRY/MANIFEST.json" "$rec/carry-manifest.json"

# Everything verl's PPO path imports, from the carry.
"$PYTHON" - > "$rec/imports.json" <<'PY'
import importlib, json, sys
mods = ["verl", "ray", "transformers", "tokenizers", "tensordict", "hydra", "omegaconf",
        "datasets", "torchdata", "peft", "accelerate", "codetiming", "pylatexenc",
        "huggingface_hub", "pyarrow", "pandas", "numpy", "torch"]
out = {}
for name in mods:
    m = importlib.import_module(name)
    out[name] = {"version": getattr(m, "__version__", "?"), "file": getattr(m, "__file__", "?")}
import verl.trainer.main_ppo  # noqa: E402  (hydra, ray, the trainer, the workers' imports)
import verl.workers.fsdp_workers  # noqa: E402
from verl.utils import oldgpu_compat  # the patch's runtime shim
out["oldgpu_compat"] = {"dtype": str(oldgpu_compat.compute_dtype()),
                        "attn": oldgpu_compat.attn_implementation()}
json.dump(out, sys.stdout, indent=1)
PY
"$PYTHON" - "$rec/imports.json" >&2 <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    print(f"[setup] {k:16} {v.get('version', v)}")
PY
# What the guard enforces here (probes run on the GPU when there is one).
OLDGPU_GUARD=pascal OLDGPU_GUARD_DEVICE=${OLDGPU_GUARD_DEVICE:-cuda} \
  "$PYTHON" -m oldgpu guard --check > "$rec/guard-check.txt" 2>&1 ||
  say "WARNING: oldgpu guard --check failed (the runs' guard logs will tell more)"
sed 's/^/[setup] /' "$rec/guard-check.txt" >&2
say "ready: source $env_dir/env.sh"
