#!/usr/bin/env bash
# `make test`: run each stage in order, print its time as it ends and a table
# of all stage times at the end of every run, passed or failed (the next
# regression shows itself in the table; a failed stage says FAILED and the
# stages after it are absent). A stage written a+b runs make a and make b side
# by side (their prerequisites made by the stages before: `make prepare`), each
# line of a's output marked [a]; it fails if either fails. The molecule
# scenarios add their own rows (scripts/molecule-all.sh writes them to
# $OLDGPU_STAGE_TIMES). The first line says which caches the run found.
set -euo pipefail
cache=${OLDGPU_CACHE:-/var/cache/oldgpu}
declare -a rows=()
total=$SECONDS
tmp=$(mktemp -d)
export OLDGPU_STAGE_TIMES=$tmp/scenarios

row() { rows+=("$(printf '%-18s %6d s  %s' "$1" "$2" "${3:-}")"); }

# The table, whatever ended the run; the scenarios' rows under molecule's.
table() {
  local rc=$? r name secs verdict
  trap '' TERM INT # an exit that did not come through finish (set -e)
  [[ -z $running ]] || row "$running" $((SECONDS - start)) "stopped"
  echo "[stage] times ($cache_state caches):"
  local shown=''
  for r in "${rows[@]}"; do
    printf '  %s\n' "$r"
    # The scenarios under molecule's row, or under the stage that was stopped in it.
    if [[ -z $shown && ($r == "molecule "* || $r == *" stopped") && -s $OLDGPU_STAGE_TIMES ]]; then
      while read -r name secs verdict; do
        printf '    %-16s %6d s  %s\n' "$name" "$secs" "$verdict"
      done <"$OLDGPU_STAGE_TIMES"
      shown=1
    fi
  done
  printf '  %-18s %6d s  %s\n' total $((SECONDS - total)) "$( ((rc == 0)) && echo passed || echo FAILED)"
  rm -rf "$tmp"
}

# What a fresh machine lacks: the test image's storage, the wheelhouse, the venvs.
found=()
for d in podman/storage wheelhouse venvs; do [[ -d $cache/$d ]] && found+=("$d"); done
case ${#found[@]} in
  0) cache_state=cold ;;
  3) cache_state=warm ;;
  *) cache_state="partly warm (${found[*]})" ;;
esac
echo "[stage] caches in $cache: $cache_state"
# Every way out ignores TERM and ^C first, then exits into the table. A run stopped
# from outside (CI's time limit, ^C) gets a TERM twice: the process group's, then the
# one make passes on to its children. The second, run as a trap inside the EXIT trap,
# used to exit before the table was printed (issue 33).
finish() {
  trap '' TERM INT
  exit "$1"
}
trap table EXIT
trap 'finish 143' TERM INT

# One make target beside others: its lines marked, its time and status in $tmp.
beside() {
  local stage=$1 start=$SECONDS rc=0
  make --no-print-directory -o bootstrap -o image -o prepare "$stage" 2>&1 |
    sed -u "/^\[/!s/^/[$stage] /" || rc=$?
  echo "$rc $((SECONDS - start))" >"$tmp/$stage"
}

running='' start=$SECONDS
for stage in "$@"; do
  start=$SECONDS running=$stage
  echo "[stage] $stage: start ($(date -u +%H:%M:%S))"
  if [[ $stage == *+* ]]; then
    IFS=+ read -ra parts <<<"$stage"
    for part in "${parts[@]}"; do beside "$part" & done
    wait
    failed=()
    for part in "${parts[@]}"; do
      read -r rc secs <"$tmp/$part"
      if [[ $rc == 0 ]]; then
        row "$part" "$secs"
        echo "[stage] $part: passed in $secs s"
      else
        row "$part" "$secs" FAILED
        echo "[stage] $part: FAILED after $secs s"
        failed+=("$part")
      fi
    done
    row "($stage)" $((SECONDS - start)) "$( ((${#failed[@]})) && echo FAILED)"
    running=''
    [[ ${#failed[@]} -eq 0 ]] || finish 1
    echo "[stage] $stage: passed in $((SECONDS - start)) s"
    continue
  fi
  if ! make --no-print-directory "$stage"; then
    running=''
    row "$stage" $((SECONDS - start)) FAILED
    echo "[stage] $stage: FAILED after $((SECONDS - start)) s"
    finish 1
  fi
  running=''
  row "$stage" $((SECONDS - start))
  echo "[stage] $stage: passed in $((SECONDS - start)) s"
done
finish 0
