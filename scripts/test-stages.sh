#!/usr/bin/env bash
# `make test`: run each stage in order, print its time as it ends and a table
# of all stage times at the end (CI's budget is judged per stage). A stage
# written a+b runs make a and make b side by side (their prerequisites made by
# the stages before: `make prepare`), each line of a's output marked [a]; it
# fails if either fails.
set -euo pipefail
declare -a rows=()
total=$SECONDS
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

row() { rows+=("$(printf '%-10s %6d s' "$1" "$2")"); }

# One make target beside others: its lines marked, its time and status in $tmp.
beside() {
  local stage=$1 start=$SECONDS rc=0
  make --no-print-directory -o bootstrap -o image -o prepare "$stage" 2>&1 |
    sed -u "/^\[/!s/^/[$stage] /" || rc=$?
  echo "$rc $((SECONDS - start))" >"$tmp/$stage"
}

for stage in "$@"; do
  start=$SECONDS
  echo "[stage] $stage: start ($(date -u +%H:%M:%S))"
  if [[ $stage == *+* ]]; then
    IFS=+ read -ra parts <<<"$stage"
    for part in "${parts[@]}"; do beside "$part" & done
    wait
    failed=()
    for part in "${parts[@]}"; do
      read -r rc secs <"$tmp/$part"
      row "$part" "$secs"
      if [[ $rc == 0 ]]; then
        echo "[stage] $part: passed in $secs s"
      else
        echo "[stage] $part: FAILED after $secs s"
        failed+=("$part")
      fi
    done
    [[ ${#failed[@]} -eq 0 ]] || exit 1
    row "($stage)" $((SECONDS - start))
    echo "[stage] $stage: passed in $((SECONDS - start)) s"
    continue
  fi
  if ! make --no-print-directory "$stage"; then
    echo "[stage] $stage: FAILED after $((SECONDS - start)) s"
    exit 1
  fi
  row "$stage" $((SECONDS - start))
  echo "[stage] $stage: passed in $((SECONDS - start)) s"
done
echo "[stage] times:"
printf '  %s\n' "${rows[@]}"
printf '  %-10s %6d s\n' total $((SECONDS - total))
