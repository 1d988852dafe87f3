#!/usr/bin/env bash
# One device call of the benchmark: set up (idempotent), then run settings in turn, each
# through files/bin/verl-train (bench/ppo_bench.py: a job env file, then the start script).
#
#   bench/run.sh [--smoke|--cpu] [--no-guard] [SETTING STEPS]...
#   bench/run.sh b 3 grpo-lora 3          # the planner's PPO; GRPO + LoRA
#   bench/run.sh setup                    # only the setup and its records
#   bench/run.sh --smoke a 2 b 2 learn 2  # all of it on CPU with the smoke model
#   bench/run.sh --cpu learn 25           # the learning check's own model, on CPU
#
# Settings: `python3 bench/ppo_bench.py settings` (a, b, grpo, grpo-lora, grpo-lora-1p5b,
# learn, learn-grpo; fp16-volta, fp32-volta, learn-fp16 under the volta guard). Steps >= 2
# are the timed ones.
#   bench/run.sh fp16-volta 3 fp32-volta 3 learn-fp16 20   # fp16 + loss scaler vs fp32
# The whole call keeps within BENCH_BUDGET_S (default 540 s, the device tool allows 600):
# a run still going at the deadline is stopped and keeps the steps it finished, and a
# setting is skipped when less than BENCH_MIN_LEFT_S (90 s) is left. The runs stay on
# the machine in .device/bench/runs (a later call on the same warm machine adds to them);
# after each setting $OUT gets summary.md (every run there so far), bench.json,
# setup.txt and logs.tar.xz, so a call cut off still returns what it finished.
set -uo pipefail
t_start=$(date +%s)
root=$(cd "$(dirname "$0")/.." && pwd)
export BENCH_HOME=${BENCH_HOME:-$root/.device/bench}
OUT=${OUT:-$BENCH_HOME/out}
export OUT
BUDGET=${BENCH_BUDGET_S:-540}
export PYTHONUNBUFFERED=1
smoke=0
cpu=0
guard_flag=()
pairs=()
while (($#)); do
  case $1 in
    --smoke) smoke=1 cpu=1 ;;
    --cpu) cpu=1 ;;
    --no-guard) guard_flag=(--no-guard) ;;
    setup) ;;
    *) [[ $# -ge 2 ]] || { echo "usage: $0 [--smoke|--cpu] [SETTING STEPS]..." >&2; exit 2; }
       pairs+=("$1" "$2"); shift ;;
  esac
  shift
done
runs=$BENCH_HOME/runs
[[ $cpu == 1 ]] && runs=$BENCH_HOME/runs-cpu
mkdir -p "$runs" "$OUT"

# A run left over from an earlier call that was cut off: end it (by the pids of its
# session, which the bench recorded) before it holds the GPU against this one.
for f in "$runs"/*/session.pid; do
  [[ -f $f ]] || continue
  sid=$(cat "$f")
  for pid in $(ps -eo pid=,sid= | awk -v s="$sid" '$2 == s {print $1}'); do
    echo "[run] ending pid $pid, left from an earlier call's run" >&2
    kill -9 "$pid" 2>/dev/null
  done
  rm -f "$f"
done

BENCH_CPU=$cpu OUT=$BENCH_HOME/setup-out "$root/bench/setup.sh" || exit $?
# shellcheck source=/dev/null
source "$BENCH_HOME/env/env.sh"
py=${BENCH_PYTHON:-python3}
scale_flag=()
[[ $cpu == 1 ]] && scale_flag=(--cpu)
[[ $smoke == 1 ]] && scale_flag=(--smoke)

export_out() {
  "$py" "$root/bench/ppo_bench.py" export "$runs" "$OUT" --setup "$BENCH_HOME/setup-out/setup" >&2
}
export_out   # the setup's records, before any run
i=0
while ((i < ${#pairs[@]})); do
  setting=${pairs[i]} steps=${pairs[i + 1]}
  i=$((i + 2))
  now=$(date +%s)
  deadline=$((t_start + BUDGET - 25))   # leave time for the export
  if ((deadline - now < ${BENCH_MIN_LEFT_S:-90})); then
    echo "[run] skipping $setting: $((deadline - now)) s left in this call" >&2
    continue
  fi
  echo "[run] $setting: $steps steps, $((deadline - now)) s left" >&2
  "$py" "$root/bench/ppo_bench.py" run "$setting" --steps "$steps" --out "$runs/$setting" \
    --deadline "$deadline" "${scale_flag[@]}" "${guard_flag[@]}"
  echo "[run] $setting: rc $?" >&2
  export_out
done
cat "$OUT/summary.md"
echo "[run] done in $(( $(date +%s) - t_start )) s" >&2
