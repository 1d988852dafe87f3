#!/usr/bin/env bash
# `make test`: run each stage in order, print its time as it ends and a table
# of all stage times at the end (CI's budget is judged per stage).
set -euo pipefail
declare -a rows=()
total=$SECONDS
for stage in "$@"; do
  start=$SECONDS
  echo "[stage] $stage: start ($(date -u +%H:%M:%S))"
  if ! make --no-print-directory "$stage"; then
    echo "[stage] $stage: FAILED after $((SECONDS - start)) s"
    exit 1
  fi
  rows+=("$(printf '%-10s %6d s' "$stage" $((SECONDS - start)))")
  echo "[stage] $stage: passed in $((SECONDS - start)) s"
done
echo "[stage] times:"
printf '  %s\n' "${rows[@]}"
printf '  %-10s %6d s\n' total $((SECONDS - total))
