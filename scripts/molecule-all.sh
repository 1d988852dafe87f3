#!/usr/bin/env bash
# Run every scenario; fail if any fails or if its verifier collected no test
# (molecule passes a scenario whose tests folder is empty).
# fleet starts its hosts from the image that the jobs scenario commits: given
# both, jobs runs first, and a failed jobs run skips the fleet (the image would be
# an older run's, or none).
# Two lanes run side by side (OLDGPU_MOLECULE_LANES=1: one after the other): jobs
# and fleet in one, the other scenarios in the other. Why: one scenario alone
# leaves a core idle much of the time (one ansible process, apt downloads, a job's
# restart delay, Ray's start); two keep both busy, so the gain is that idle time.
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
  passed=$(grep -Eo '[0-9]+ passed' <<<"$clean" | tail -n1 | cut -d' ' -f1)
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

# Scenarios one after another; the fleet only after a jobs run that passed.
lane() {
  local s
  for s in "$@"; do
    if [[ $s == fleet && " $* " == *" jobs "* && $(cat "$results/jobs") != ok ]]; then
      echo "[molecule] fleet skipped: the jobs scenario failed, and the fleet's hosts start from its image"
      echo failed >"$results/fleet"
      scenario_time fleet 0 "FAILED (skipped: jobs failed)"
      continue
    fi
    run_one "$s"
  done
}

chain=() others=()
for s in "$@"; do
  case $s in
    jobs | fleet) chain+=("$s") ;;
    *) others+=("$s") ;;
  esac
done
# jobs before fleet, whatever order they were given in.
[[ ${#chain[@]} -eq 2 ]] && chain=(jobs fleet)

start=$SECONDS
if [[ ${OLDGPU_MOLECULE_LANES:-2} == 1 || ${#chain[@]} -eq 0 || ${#others[@]} -eq 0 ]]; then
  lane "${chain[@]}" "${others[@]}"
else
  echo "[molecule] two lanes: ${chain[*]} | ${others[*]}"
  lane "${chain[@]}" &
  first=$!
  lane "${others[@]}" &
  second=$!
  wait "$first" || true
  wait "$second" || true
fi

status=0
for s in "$@"; do
  verdict=$(cat "$results/$s" 2>/dev/null || echo "not run")
  printf '[molecule] %-8s %s\n' "$s" "$verdict"
  [[ $verdict == ok ]] || status=1
done
echo "[molecule] all scenarios in $((SECONDS - start)) s"
exit $status
