#!/usr/bin/env bash
# Measure the cluster wiring (cluster_hosts + ssh_mesh + firewall + nccl_network) and the
# preflight's reachability check on lab clusters of several sizes: first run, no-op re-run.
#   bench/wiring.sh            # 2, 4 and 8 nodes
#   bench/wiring.sh 2 4        # chosen sizes
# Needs Docker and the lab node image (playbooks/lab.yml builds it). The lab is a separate one
# (containers mol-cluster-bench-node*, its own network, key and inventory under a temp dir) and
# is removed afterwards; the lab of inventory/lab.yml is not touched. Prints a Markdown table.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source .venv/bin/activate

sizes=("$@")
[[ ${#sizes[@]} -gt 0 ]] || sizes=(2 4 8)
name=mol-cluster-bench
work=$(mktemp -d /tmp/llama-bench-wiring.XXXXXX)
# A fact cache from an earlier lab with the same host names would describe other containers.
export ANSIBLE_CACHE_PLUGIN=memory ANSIBLE_NOCOLOR=1 ANSIBLE_STDOUT_CALLBACK=default
# Per-task times at the end of each log, to see where the time goes.
export ANSIBLE_CALLBACKS_ENABLED=ansible.posix.profile_tasks

lab() {
  ansible-playbook playbooks/lab.yml -e "lab_cluster_name=$name" \
    -e "lab_cluster_state_dir=$work/state" -e "lab_cluster_inventory_path=$work/inventory.yml" "$@"
}
# lab_state=absent removes the lab by its label; removing this lab's containers by name as well
# also cleans up after labs started before the label was set (commit e219c21).
cleanup() {
  lab -e lab_state=absent >"$work/lab-down.log" 2>&1 || true
  docker ps -aq --filter "name=^${name}-node[0-9]+$" | xargs -r docker rm -f >/dev/null
  docker network rm "$name" >/dev/null 2>&1 || true
}
trap cleanup EXIT

# Runs a playbook, prints "seconds changed-total" and keeps its log.
timed() {
  local log=$1; shift
  local start end
  start=$(date +%s.%N)
  if ! ansible-playbook -i "$work/inventory.yml" "$@" >"$log" 2>&1; then
    echo "FAILED: ansible-playbook $* (see $log)" >&2
    tail -30 "$log" >&2
    exit 1
  fi
  end=$(date +%s.%N)
  local changed
  changed=$(grep -Eo 'changed=[0-9]+' "$log" | awk -F= '{ total += $2 } END { print total }')
  awk -v s="$start" -v e="$end" -v c="$changed" 'BEGIN { printf "%.1f %d\n", e - s, c }'
}

rows=()
for n in "${sizes[@]}"; do
  cleanup
  lab -e "lab_nodes=$n" >"$work/lab-up-$n.log" 2>&1 || { tail -30 "$work/lab-up-$n.log"; exit 1; }
  read -r first first_changed < <(timed "$work/wiring-first-$n.log" playbooks/wiring.yml)
  read -r again again_changed < <(timed "$work/wiring-again-$n.log" playbooks/wiring.yml)
  read -r check _ < <(timed "$work/check-$n.log" playbooks/check.yml \
    -e '{"preflight_checks": ["reachability"]}')
  rows+=("| $n | $first | $first_changed | $again | $again_changed | $check |")
  echo "nodes=$n wiring first=${first}s (changed=$first_changed) re-run=${again}s (changed=$again_changed) check=${check}s" >&2
done

echo "| nodes | wiring, first run (s) | changed | wiring, re-run (s) | changed | check.yml reachability (s) |"
echo "|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
echo "logs: $work" >&2
