#!/usr/bin/env bash
# Run every scenario; fail if any fails or if its verifier collected no test
# (molecule passes a scenario whose tests folder is empty).
# fleet starts its hosts from the image that the jobs scenario commits: given
# both, jobs runs first, and a failed jobs run skips the fleet (the image would be
# an older run's, or none).
set -euo pipefail
logs=${OLDGPU_CACHE:-/var/cache/oldgpu}/logs
mkdir -p "$logs"
status=0
order=()
for s in "$@"; do
  [[ $s == fleet && " $* " == *" jobs "* ]] || order+=("$s")
  [[ $s == jobs && " $* " == *" fleet "* ]] && order+=(fleet)
done
failed=" "
for s in "${order[@]}"; do
  if [[ $s == fleet && $failed == *" jobs "* ]]; then
    echo "[molecule] fleet skipped: the jobs scenario failed, and the fleet's hosts start from its image"
    status=1
    continue
  fi
  log=$logs/molecule-$s.log
  echo "[molecule] $s (log: $log)"
  start=$SECONDS
  if ! ANSIBLE_NOCOLOR=1 PY_COLORS=0 molecule test -s "$s" >"$log" 2>&1; then
    sed 's/\x1b\[[0-9;]*m//g' "$log" | tail -n 80
    echo "[molecule] $s FAILED"
    status=1
    failed+="$s "
    continue
  fi
  clean=$(sed 's/\x1b\[[0-9;]*m//g' "$log")
  passed=$(grep -Eo '[0-9]+ passed' <<<"$clean" | tail -n1 | cut -d' ' -f1)
  if [[ -z $passed || $passed -eq 0 ]] || grep -q "no tests ran\|collected 0 items" <<<"$clean"; then
    echo "[molecule] $s ran no test: that is a failure"
    status=1
    failed+="$s "
    continue
  fi
  grep -E '^\s*│?\s*=+ .*(passed|failed).* =+' <<<"$clean" | tail -n1 || true
  echo "[molecule] $s ok: $passed passed in $((SECONDS - start)) s"
done
exit $status
