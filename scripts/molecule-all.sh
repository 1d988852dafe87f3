#!/usr/bin/env bash
# Run every scenario; fail if any fails or if its verifier collected no test
# (molecule passes a scenario whose tests folder is empty).
# fleet starts its hosts from the image that the jobs scenario commits after its
# converge and idempotence (its side_effect step, which then writes
# $OLDGPU_JOBS_IMAGE_READY): given both, the fleet waits for that mark of this
# run, and is skipped when the jobs scenario ended without it.
# Two lanes run side by side (OLDGPU_MOLECULE_LANES=1: one after the other): jobs
# then default in one, the other scenarios (nvidia, trixie) and then the fleet in the other (the
# jobs image is ready long before the fleet's turn). Why: one scenario alone
# leaves a core idle much of the time (one ansible process, apt downloads, a job's
# restart delay, Ray's start); two keep both busy (the unit tests run beside them:
# the CPU is saturated while both lanes run), so the gain is that idle time, and
# the lanes are balanced so that neither runs long alone at the end. Seconds on the
# clean-clone run of 2026-12-06: jobs 1,181, default 232 | nvidia 807, fleet 375
# (jobs then fleet had made one lane of 1,556 s, the other 1,039).
LANE_ONE=(jobs default)
set -euo pipefail
logs=${OLDGPU_CACHE:-/var/cache/oldgpu}/logs
mkdir -p "$logs"
results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT

# A scenario's row for make test's table (scripts/test-stages.sh), if it asked.
scenario_time() {
  [[ -z ${OLDGPU_STAGE_TIMES:-} ]] || printf 'molecule/%s %d %s\n' "$1" "$2" "$3" >>"$OLDGPU_STAGE_TIMES"
}

# One scenario: its log, its verdict in $results/<scenario>.
run_one() {
  local s=$1 log=$logs/molecule-$1.log start=$SECONDS clean passed
  echo "[molecule] $s (log: $log)"
  if ! ANSIBLE_NOCOLOR=1 PY_COLORS=0 molecule test -s "$s" >"$log" 2>&1; then
    sed 's/\x1b\[[0-9;]*m//g' "$log" | tail -n 80 | sed "s/^/[$s] /"
    echo "[molecule] $s FAILED after $((SECONDS - start)) s"
    echo failed >"$results/$s"
    scenario_time "$s" $((SECONDS - start)) FAILED
    return
  fi
  clean=$(sed 's/\x1b\[[0-9;]*m//g' "$log")
  # (no match is an answer here, not a failure of the script: || true under pipefail)
  passed=$(grep -Eo '[0-9]+ passed' <<<"$clean" | tail -n1 | cut -d' ' -f1 || true)
  if [[ -z $passed || $passed -eq 0 ]] || grep -q "no tests ran\|collected 0 items" <<<"$clean"; then
    echo "[molecule] $s ran no test: that is a failure"
    echo failed >"$results/$s"
    scenario_time "$s" $((SECONDS - start)) "FAILED (no test)"
    return
  fi
  grep -E '^\s*│?\s*=+ .*(passed|failed).* =+' <<<"$clean" | tail -n1 | sed "s/^/[$s] /" || true
  echo "[molecule] $s ok: $passed passed in $((SECONDS - start)) s"
  echo ok >"$results/$s"
  scenario_time "$s" $((SECONDS - start)) "$passed passed"
}

# The fleet, when this run has jobs too: wait for the jobs image of this run.
fleet_ready() {
  [[ " $* " == *" jobs "* ]] || return 0
  while [[ ! -e $OLDGPU_JOBS_IMAGE_READY ]]; do
    [[ -e $results/jobs ]] && break  # the jobs scenario ended
    sleep 1
  done
  [[ -e $OLDGPU_JOBS_IMAGE_READY ]]
}

# Scenarios one after another.
lane() {
  local s
  for s in "$@"; do
    if [[ $s == fleet ]] && ! fleet_ready "${scenarios[@]}"; then
      echo "[molecule] fleet skipped: the jobs scenario failed before it committed the image the fleet's hosts start from"
      echo failed >"$results/fleet"
      scenario_time fleet 0 "FAILED (skipped: no jobs image)"
      continue
    fi
    run_one "$s"
  done
}

scenarios=("$@")
export OLDGPU_JOBS_IMAGE_READY=$results/jobs-image-ready
first=() second=()
# In LANE_ONE's order (jobs first: its image is the fleet's), whatever order given.
for s in "${LANE_ONE[@]}"; do
  [[ " $* " != *" $s "* ]] || first+=("$s")
done
for s in "$@"; do
  [[ " ${LANE_ONE[*]} " == *" $s "* || $s == fleet ]] || second+=("$s")
done
# The fleet last, whatever order the scenarios were given in.
[[ " $* " == *" fleet "* ]] && second+=(fleet)

start=$SECONDS
if [[ ${OLDGPU_MOLECULE_LANES:-2} == 1 || ${#first[@]} -eq 0 || ${#second[@]} -eq 0 ]]; then
  lane "${first[@]}" "${second[@]}"
else
  echo "[molecule] two lanes: ${first[*]} | ${second[*]}"
  lane "${first[@]}" &
  one=$!
  lane "${second[@]}" &
  two=$!
  wait "$one" || true
  wait "$two" || true
fi

status=0
for s in "$@"; do
  verdict=$(cat "$results/$s" 2>/dev/null || echo "not run")
  printf '[molecule] %-8s %s\n' "$s" "$verdict"
  [[ $verdict == ok ]] || status=1
done
echo "[molecule] all scenarios in $((SECONDS - start)) s"
exit $status
