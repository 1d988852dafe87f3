#!/usr/bin/env bash
# Set up the benchmark on the device machine (no network): unpack the carry
# (bench/pack_carry.py made it; the device tool brings .device/carry), add the fallback
# packages the machine lacks, and lay out what files/bin/verl-train needs through the
# variables it honours, as a converged host has them under /opt/verl:
#
#   OLDGPU_BIN  BENCH_HOME/bin/oldgpu: this python with this checkout's engine (src/).
#               On the GPU its `job command` plans against a P40's recorded nvidia-smi
#               line (tests/data/detect/p40.nvidia-smi.csv), as on a P40 host: the guard
#               makes verl's processes a P40, but this machine's nvidia-smi names its
#               own GPU. The doctor still judges this machine.
#   VERL_VENV   this python's venv when it runs in one; else BENCH_HOME/venv, whose
#               bin/python links to this python (the carried packages on PYTHONPATH)
#   VERL_DIR    verl 0.5.0 patched for the profile (the carry's, pascal; on CPU the
#               local sdist patched for the cpu profile). On the GPU also
#               BENCH_HOME/env/verl-tree-volta: a copy re-patched for the volta profile
#               (its fp16 loss scaler), made afresh by every call (seconds)
#
# Then it writes BENCH_HOME/env/env.sh (those, and PYTHONPATH with the guard's
# sitecustomize first), records the machine and checks that verl's imports work with
# VERL_VENV's python.
#
#   bench/setup.sh            # idempotent: a second call only re-checks
#
# Variables: PYTHON (default python3), CARRY (.device/carry), BENCH_HOME (.device/bench),
# OUT (where the records go; the device tool's output folder), BENCH_CPU=1 (a CPU run
# here: the cpu profile; without a carry for this python's version, this python's own
# packages, e.g. the engine's test venv's, which has the lock's).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=$(command -v "${PYTHON:-python3}")
CARRY=${CARRY:-$root/.device/carry}
BENCH_HOME=${BENCH_HOME:-$root/.device/bench}
OUT=${OUT:-$BENCH_HOME/out}
cpu=${BENCH_CPU:-0}
env_dir=$BENCH_HOME/env
rec=$OUT/setup
mkdir -p "$env_dir" "$rec"
say() { echo "[setup] $*" >&2; }

# The newer verl releases the carry holds (bench/pack_carry.py --release): site-<v>, verl-<v>.
releases() {
  [[ -f $CARRY/MANIFEST.json ]] || return 0
  "$PYTHON" -c 'import json, sys
for name in sorted(json.load(open(sys.argv[1]))["archives"]):
    if name.startswith("verl-"):
        print(name[len("verl-"):])' "$CARRY/MANIFEST.json"
}
py_version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
use_carry=0
if [[ -f $CARRY/MANIFEST.json ]]; then
  carry_py=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["python"])' \
    "$CARRY/MANIFEST.json")
  [[ $carry_py == "$py_version" ]] && use_carry=1
fi
if ((!use_carry)) && [[ $cpu != 1 ]]; then
  say "no carry for Python $py_version at $CARRY: run bench/pack_carry.py here first"
  exit 2
fi
stamp=$({
  cat "$CARRY/MANIFEST.json" 2>/dev/null || true
  echo "$PYTHON $py_version cpu=$cpu carry=$use_carry"
} | sha256sum | cut -c1-16)
if [[ ! -f $env_dir/.complete || $(cat "$env_dir/.complete") != "$stamp" ]]; then
  t0=$(date +%s)
  rm -rf "${env_dir:?}"/*
  archives=()
  # shellcheck disable=SC2046
  ((use_carry)) && archives=(site fallback ray verl $(releases | sed 's/.*/site-& verl-&/'))
  for a in "${archives[@]}"; do
    [[ -f $CARRY/$a.tar.xz ]] || { say "missing $CARRY/$a.tar.xz"; exit 2; }
    xz -dc "$CARRY/$a.tar.xz" | tar -x -C "$env_dir"
  done
  if [[ $cpu == 1 ]]; then
    # CPU: the same verl, patched for the cpu profile (gloo, no GPU resources, ...).
    sdist=${VERL_SDIST:-/var/cache/oldgpu/sdists/verl-0.5.0.tar.gz}
    rm -rf "$env_dir/verl-tree" "$env_dir/verl-src"
    mkdir -p "$env_dir/verl-src"
    tar -xzf "$sdist" -C "$env_dir/verl-src"
    src=$(echo "$env_dir"/verl-src/verl-*)
    PYTHONPATH=$root/src "$PYTHON" -m oldgpu patch "$src" --profile cpu >&2
    mkdir -p "$env_dir/verl-tree"
    # The manifest and the originals too: the doctor checks the patch with them.
    mv "$src/verl" "$src/.oldgpu-patch.json" "$src/.oldgpu-originals" "$env_dir/verl-tree/"
    rm -rf "$env_dir/verl-src"
  fi
  # Fallback packages: only those this python cannot import on its own.
  : >"$env_dir/fallback-used.txt"
  mkdir -p "$env_dir/extra"
  if ((use_carry)); then
    while read -r dist mods; do
      # shellcheck disable=SC2086
      if ! env -u PYTHONPATH "$PYTHON" - $mods >/dev/null 2>&1 <<'PY'; then
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
PY
        cp -a "$env_dir/fallback/$dist/." "$env_dir/extra/"
        echo "$dist" >>"$env_dir/fallback-used.txt"
      fi
    done < <("$PYTHON" - "$env_dir/fallback/index.json" <<'PY'
import json, sys
for dist, info in sorted(json.load(open(sys.argv[1])).items()):
    print(dist, " ".join(info["modules"]))
PY
)
    rm -rf "$env_dir/fallback"
  else
    say "no carry for Python $py_version: verl's dependencies are $PYTHON's own"
  fi
  say "unpacked in $(($(date +%s) - t0)) s; fallback packages added:" \
    "$(tr '\n' ' ' <"$env_dir/fallback-used.txt")"

  # What verl-train finds through OLDGPU_BIN, VERL_VENV and VERL_DIR.
  if [[ $("$PYTHON" -c 'import sys; print(int(sys.prefix != sys.base_prefix))') == 1 ]]; then
    venv=$("$PYTHON" -c 'import sys; print(sys.prefix)')
  else
    venv=$BENCH_HOME/venv
    mkdir -p "$venv/bin"
    ln -sfn "$(readlink -f "$PYTHON")" "$venv/bin/python"
  fi
  smi=
  [[ $cpu == 1 ]] || smi=$root/tests/data/detect/p40.nvidia-smi.csv
  mkdir -p "$BENCH_HOME/bin"
  cat >"$BENCH_HOME/bin/oldgpu" <<EOF
#!/bin/bash
# Written by bench/setup.sh: the engine as verl-train calls it (OLDGPU_BIN).
# With a recording (GPU runs), \`oldgpu job command\` plans against a P40's
# nvidia-smi line instead of this machine's GPU (BENCH_SMI_FILE: another card's, for
# the volta settings); everything else is unchanged.
smi="$smi"
[[ -n \$smi && -n \${BENCH_SMI_FILE:-} ]] && smi=\$BENCH_SMI_FILE
if [[ -n \$smi && "\${1:-} \${2:-}" == "job command" ]]; then
  set -- "\$@" --nvidia-smi-file "\$smi"
fi
PYTHONPATH="$root/src\${PYTHONPATH:+:\$PYTHONPATH}" exec "$PYTHON" -m oldgpu "\$@"
EOF
  chmod 0755 "$BENCH_HOME/bin/oldgpu"
  # The guard's sitecustomize first, then the engine and the carried packages before
  # the machine's own. The verl tree is not here: verl-train puts VERL_DIR first.
  pp="$root/src/oldgpu/guard_site:$root/src"
  ((use_carry)) && pp="$pp:$env_dir/site:$env_dir/ray:$env_dir/extra"
  cat >"$env_dir/env.sh" <<EOF
# Written by bench/setup.sh: source before running the bench here.
export PYTHONPATH="$pp"
export OLDGPU_BIN="$BENCH_HOME/bin/oldgpu"
export VERL_VENV="$venv"
export VERL_DIR="$env_dir/verl-tree"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_HOME="$BENCH_HOME/hf-home"
export TOKENIZERS_PARALLELISM=true
export RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0
export PYTHONNOUSERSITE=1
export BENCH_PYTHON="$PYTHON"
EOF
  # A newer release: its interpreter is this python with the release's packages in place
  # of the default's (site -> site-<v>; Ray's workers inherit the variable), and its tree;
  # `oldgpu job command` names them for a job with that verl_version (VERL_VENV_<v>,
  # VERL_DIR_<v>: oldgpu.verl_release.dirs).
  for v in $( ((use_carry)) && releases); do
    mkdir -p "$BENCH_HOME/venv-$v/bin"
    cat >"$BENCH_HOME/venv-$v/bin/python" <<WRAP
#!/bin/bash
# Written by bench/setup.sh: verl $v's interpreter on this machine.
old='$env_dir/site' new='$env_dir/site-$v'
p=":\$PYTHONPATH:"
p=\${p//":\$old:"/":\$new:"}
p=\${p#:}
export PYTHONPATH=\${p%:}
exec "$PYTHON" "\$@"
WRAP
    chmod 0755 "$BENCH_HOME/venv-$v/bin/python"
    echo "export VERL_VENV_${v//./_}=$BENCH_HOME/venv-$v VERL_DIR_${v//./_}=$env_dir/verl-tree-$v" \
      >>"$env_dir/env.sh"
  done
  echo "$stamp" >"$env_dir/.complete"
fi

# shellcheck source=/dev/null
source "$env_dir/env.sh"
if [[ $cpu != 1 ]]; then
  # The volta settings' tree: the carry's, re-patched (revert, then apply) by this
  # checkout's engine, so it always has this checkout's fp16 patch set.
  rm -rf "$env_dir/verl-tree-volta"
  cp -a "$env_dir/verl-tree" "$env_dir/verl-tree-volta"
  PYTHONPATH=$root/src "$PYTHON" -m oldgpu patch "$env_dir/verl-tree-volta" --profile volta \
    >"$rec/patch-volta.txt" 2>&1 || { say "oldgpu patch --profile volta failed"; cat "$rec/patch-volta.txt" >&2; exit 2; }
  sed 's/^/[setup] volta tree: /' "$rec/patch-volta.txt" >&2
  # Each newer release's tree likewise (pascal, as packed): a carry packed before a patch
  # set changed (0.9.0's logits set) gets this checkout's; as packed, nothing changes.
  for v in $( ((use_carry)) && releases); do
    PYTHONPATH=$root/src "$PYTHON" -m oldgpu patch "$env_dir/verl-tree-$v" --profile pascal \
      >"$rec/patch-$v.txt" 2>&1 || { say "oldgpu patch of verl $v failed"; cat "$rec/patch-$v.txt" >&2; exit 2; }
    sed "s/^/[setup] verl $v tree: /" "$rec/patch-$v.txt" >&2
  done
fi
{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(hostname)"
  echo "python: $("$PYTHON" -c 'import sys; print(sys.version.split()[0])') ($PYTHON)"
  echo "torch: $("$PYTHON" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
  echo "cpus: $(nproc)"
  echo "memory: $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
  echo "fallback packages added: $(tr '\n' ' ' <"$env_dir/fallback-used.txt")"
  echo "verl-train: $root/files/bin/verl-train with OLDGPU_BIN=$OLDGPU_BIN" \
    "VERL_VENV=$VERL_VENV VERL_DIR=$VERL_DIR"
} | tee "$rec/machine.txt" >&2
if command -v nvidia-smi >/dev/null; then
  nvidia-smi >"$rec/nvidia-smi.txt" 2>&1 || true
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader |
    tee -a "$rec/machine.txt" >&2 || true
fi
[[ -f $CARRY/MANIFEST.json ]] && cp "$CARRY/MANIFEST.json" "$rec/carry-manifest.json"

# Everything verl's training path imports, with the interpreter verl-train runs.
PYTHONPATH=$VERL_DIR:$PYTHONPATH "$VERL_VENV/bin/python" - >"$rec/imports.json" <<'PY'
import importlib, json, sys
mods = ["verl", "ray", "transformers", "tokenizers", "tensordict", "hydra", "omegaconf",
        "datasets", "torchdata", "peft", "accelerate", "codetiming", "pylatexenc",
        "huggingface_hub", "pyarrow", "pandas", "numpy", "tensorboard", "torch"]
out = {}
for name in mods:
    m = importlib.import_module(name)
    out[name] = {"version": getattr(m, "__version__", "?"), "file": getattr(m, "__file__", "?")}
import verl.trainer.main_ppo  # noqa: E402  (hydra, ray, the trainer, the workers' imports)
import verl.workers.fsdp_workers  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402,F401  (the jobs' logger)
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
# The same for each newer release, with its interpreter and tree, and the rollout server
# it loads through VERL_USE_EXTERNAL_MODULES (the engine's oldgpu-hf).
for v in $( ((use_carry)) && releases); do
  s=${v//./_}
  venv_var=VERL_VENV_$s dir_var=VERL_DIR_$s
  PYTHONPATH=${!dir_var}:$PYTHONPATH VERL_USE_EXTERNAL_MODULES=oldgpu.verl_plugin.hook \
    "${!venv_var}/bin/python" - >"$rec/imports-$v.json" <<'PY'
import importlib, json, sys
mods = ["verl", "ray", "transformers", "tokenizers", "tensordict", "hydra", "datasets",
        "peft", "accelerate", "huggingface_hub", "fastapi", "uvicorn", "numpy", "torch"]
out = {}
for name in mods:
    m = importlib.import_module(name)
    out[name] = {"version": getattr(m, "__version__", "?"), "file": getattr(m, "__file__", "?")}
import verl.trainer.main_ppo  # noqa: E402
import verl.workers.engine_workers  # noqa: E402
from verl.workers.rollout.base import _ROLLOUT_REGISTRY  # noqa: E402
from verl.utils import oldgpu_compat  # noqa: E402
out["rollout_registry"] = sorted("/".join(k) for k in _ROLLOUT_REGISTRY)
out["oldgpu_compat"] = {"dtype": str(oldgpu_compat.compute_dtype()),
                        "attn": oldgpu_compat.attn_implementation()}
json.dump(out, sys.stdout, indent=1)
PY
  "$PYTHON" - "$rec/imports-$v.json" "$v" >&2 <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    print(f"[setup] verl {sys.argv[2]}: {k:16} {v.get('version', v) if isinstance(v, dict) else v}")
PY
done
# What the guard enforces here (probes run on the GPU when there is one).
OLDGPU_GUARD=pascal OLDGPU_GUARD_DEVICE=${OLDGPU_GUARD_DEVICE:-cuda} \
  "$PYTHON" -m oldgpu guard --check >"$rec/guard-check.txt" 2>&1 ||
  say "WARNING: oldgpu guard --check failed (the runs' guard logs will tell more)"
sed 's/^/[setup] /' "$rec/guard-check.txt" >&2
# The volta settings' guard: fp16 allowed, bf16 refused, a 32 GB V100's cap.
OLDGPU_GUARD=volta OLDGPU_GUARD_DEVICE=${OLDGPU_GUARD_DEVICE:-cuda} \
  "$PYTHON" -m oldgpu guard --check >"$rec/guard-check-volta.txt" 2>&1 ||
  say "WARNING: oldgpu guard --check failed for volta"
sed 's/^/[setup] volta: /' "$rec/guard-check-volta.txt" >&2
say "ready: source $env_dir/env.sh"
