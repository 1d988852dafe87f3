#!/usr/bin/env bash
# Provision a local container p40-demo with the real site.yml and show what
# was installed. Re-running converges the same container again.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
name=p40-demo
if ! podman container exists "$name"; then
  podman run -d --name "$name" --hostname "$name" --systemd=always localhost/debian12-systemd /sbin/init >/dev/null
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
  echo "systemd:     $(systemctl is-system-running)"'
echo "(make demo-destroy removes it)"
