#!/usr/bin/env bash
# Provision a local container p40-demo with the real site.yml and show what
# was installed. Re-running converges the same container again.
set -euo pipefail

# verl's step lines in the smoke job's journal ("step:N - ...", Ray may prefix
# "(TaskRunner pid=...) "). The journal is read whole into a variable before
# grep sees it: with `journalctl | grep -q` under pipefail, grep exits at its
# first match, journalctl dies of SIGPIPE writing the rest, and the pipeline
# fails just when the step is there.
step_lines() {  # $1: container
  local journal
  journal=$(podman exec "$1" journalctl -u verl-train@smoke.service -o cat --no-pager 2>/dev/null) || true
  grep -E '(^|\) )step:[0-9]+ ' <<<"$journal" || true
}

# Wait until the smoke job logs a step (0) or fails, or the rounds run out (1).
wait_for_first_step() {  # $1: container, $2: rounds, $3: seconds between them
  local round state
  for ((round = 1; round <= $2; round++)); do
    [[ -n $(step_lines "$1") ]] && return 0
    state=$(podman exec "$1" systemctl is-active verl-train@smoke.service || true)
    [[ $state == failed ]] && return 1
    sleep "$3"
  done
  return 1
}

# Sourced (tests/test_demo.py): the functions only.
[[ ${BASH_SOURCE[0]} == "$0" ]] || return 0

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
name=p40-demo
cache=${OLDGPU_CACHE:-/var/cache/oldgpu}
scripts/wheelhouse.sh
scripts/verl-mirror.sh >/dev/null
if ! podman container exists "$name"; then
  podman run -d --name "$name" --hostname "$name" --systemd=always \
    -v "$cache/wheelhouse:/srv/wheelhouse:ro" -v "$cache/verl-mirror:/srv/mirror:ro" \
    localhost/debian12-systemd /sbin/init >/dev/null
fi
[[ $(podman inspect -f '{{.State.Running}}' "$name") == true ]] || podman start "$name" >/dev/null
for _ in $(seq 30); do
  state=$(podman exec "$name" systemctl is-system-running 2>/dev/null || true)
  [[ $state == running || $state == degraded ]] && break
  sleep 1
done
start=$SECONDS
ansible-playbook -i inventory/demo.yml site.yml -l p40-hosts
echo
echo "== p40-demo provisioned in $((SECONDS - start)) s =="
podman exec "$name" sh -c '
  echo "user:        $(getent passwd verl)";
  for d in /opt/verl /var/lib/verl /var/log/verl /etc/verl/jobs; do stat -c "dir:         %n %U:%G %a" "$d"; done;
  echo "apt:         $(grep -h "^Components:" /etc/apt/sources.list.d/*.sources 2>/dev/null | sort -u | tr "\n" " ")";
  echo "systemd:     $(systemctl is-system-running)";
  echo "engine:      $(oldgpu profile --json | python3 -c "import json,sys; p=json.load(sys.stdin); print(p[\"name\"], p[\"compute_dtype\"], p[\"attn_implementation\"], p[\"rollout\"])")";
  if [ -x /opt/verl/venv/bin/python ]; then
    echo "venv:        $(readlink /opt/verl/venv)";
    /opt/verl/venv/bin/python -c "import torch, transformers, verl; print(\"python:      torch\", torch.__version__, \"transformers\", transformers.__version__, \"verl\", verl.__version__, \"from\", verl.__file__)";
  fi;
  [ -L /opt/verl/verl ] && echo "verl tree:   $(readlink /opt/verl/verl) ($(oldgpu patch /opt/verl/verl --check --json --profile cpu --compute-dtype fp32 --attn-implementation sdpa >/dev/null && echo patched, manifest matches || echo NOT patched as the profile says))"'

# The smoke job under systemd: start it (a no-op when it runs already), wait
# for its first PPO step, and show what `oldgpu status` says.
podman exec "$name" systemctl start verl-train@smoke.service
echo "== verl-train@smoke started; waiting for its first step =="
if ! wait_for_first_step "$name" 120 5; then
  echo "== no step yet after $((120 * 5)) s, or the job failed: see below and its journal =="
fi
step_lines "$name" | tail -n 2 | cut -c1-300
echo
podman exec "$name" oldgpu status
echo "(journal: podman exec $name journalctl -fu verl-train@smoke; make demo-destroy removes it)"
