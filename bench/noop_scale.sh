#!/usr/bin/env bash
# A no-op provision.yml on 2 and on 8 lab nodes, in one run (issue 16: 8 nodes within 1.5x of 2):
#
#   bench/noop_scale.sh            REPEAT=2 (no-op runs per size), KEEP=1 keeps the lab and image
#
# A provisioned lab node holds about 9.5 GB (its environment and its wheelhouse copy), so eight
# provisioned from scratch do not fit on a small disk. Instead one node is provisioned, committed
# as an image, and the eight nodes start from that image: they share its layers and each holds
# only what it changes. provision.yml then makes the eight a cluster (SSH mesh, firewall rules,
# hosts, facts for the new addresses), and the no-op runs are timed after that. The 2-node figure
# is the same: two of the eight as a cluster of their own (an inventory with only them),
# converged first, then timed. Clones share the committed node's SSH host keys and machine-id;
# nothing provision.yml does depends on those being unique.
# Writes a markdown table to stdout and $RESULTS/table.md (default runs/bench-noop-scale/).
set -euo pipefail
cd "$(dirname "$0")/.."
export LLAMA_CLUSTER_CACHE=${LLAMA_CLUSTER_CACHE:-$HOME/.cache/llama-cluster}
export ANSIBLE_NOCOLOR=1
LAB=llama-lab-s
IMAGE=llama-cluster-node
TAG=bench-provisioned
RESULTS=${RESULTS:-runs/bench-noop-scale}
REPEAT=${REPEAT:-2}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
ansible_playbook=.venv/bin/ansible-playbook

lab() {
  "$ansible_playbook" playbooks/lab.yml -e lab_cluster_name="$LAB" \
    -e lab_cluster_inventory_path="$RESULTS/inventory.yml" "$@" >>"$RESULTS/lab.log" 2>&1 \
    || { tail -30 "$RESULTS/lab.log"; return 1; }
}
cleanup() {
  [[ ${KEEP:-0} == 1 ]] && return
  lab -e lab_state=absent || true
  docker image rm -f "$IMAGE:$TAG" >/dev/null 2>&1 || true
}
trap cleanup EXIT

# provision LABEL INVENTORY: one provision.yml run; prints "seconds playbook-cpu nodes-cpu all-cpu
# changed-per-node", CPU in core-seconds: ansible-playbook's with its forks and ssh clients (its
# process tree, from `times`), the nodes' (Docker's cgroup: every container, and only the lab's
# run here), every core's busy time (/proc/stat). all - nodes is the controller's whole share,
# ssh's persistent connections included.
provision() {
  local label=$1 inventory=$2 start end busy0 busy1 nodes0 nodes1 tree
  start=$(date +%s.%N)
  busy0=$(busy) nodes0=$(nodes_ns)
  tree=$(
    "$ansible_playbook" -i "$inventory" provision.yml >"$RESULTS/$label.log" 2>&1 \
      || { tail -40 "$RESULTS/$label.log" >&2; exit 1; }
    times # its second line: the children's user and system time
  )
  busy1=$(busy) nodes1=$(nodes_ns)
  end=$(date +%s.%N)
  printf '%.1f %.1f %.1f %.1f %s\n' "$(echo "$end - $start" | bc)" \
    "$(echo "$tree" | tail -n 1 | .venv/bin/python -c 'import re, sys
print(sum(int(m) * 60 + float(s) for m, s in re.findall(r"(\d+)m([\d.]+)s", sys.stdin.read())))')" \
    "$(echo "($nodes1 - $nodes0) / 10^9" | bc -l)" \
    "$(echo "($busy1 - $busy0) / $(getconf CLK_TCK)" | bc -l)" \
    "$(sed -n '/PLAY RECAP/,$p' "$RESULTS/$label.log" | grep -oE "^$LAB-node[0-9]+ +: ok=[0-9]+ +changed=[0-9]+" \
      | sed -E 's/ +: ok=[0-9]+ +changed=/=/' | paste -sd, -)"
}

# Busy clock ticks of every core since boot: all but idle and iowait.
busy() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }
# CPU nanoseconds of every Docker container (cgroup v1 with the cgroupfs driver, or v2).
nodes_ns() {
  if [[ -r /sys/fs/cgroup/cpuacct/docker/cpuacct.usage ]]; then
    cat /sys/fs/cgroup/cpuacct/docker/cpuacct.usage
  elif [[ -r /sys/fs/cgroup/system.slice/cpu.stat ]]; then
    echo $(($(awk '/^usage_usec/{print $2}' /sys/fs/cgroup/system.slice/cpu.stat) * 1000))
  else
    echo 0
  fi
}

loadavg() { cut -d' ' -f1-3 /proc/loadavg; }

echo "$(date -u +%FT%TZ) one node, provisioned and committed as $IMAGE:$TAG" >&2
lab -e lab_state=absent
lab -e lab_nodes=1
provision seed "$RESULTS/inventory.yml" >/dev/null
docker commit "$LAB-node1" "$IMAGE:$TAG" >/dev/null
lab -e lab_state=absent

echo "$(date -u +%FT%TZ) eight nodes from the image" >&2
lab -e lab_nodes=8 -e lab_cluster_image_tag="$TAG"
cp "$RESULTS/inventory.yml" "$RESULTS/inventory8.yml"
.venv/bin/python - "$RESULTS/inventory8.yml" "$RESULTS/inventory2.yml" <<'PY'
import sys, yaml
inventory = yaml.safe_load(open(sys.argv[1]))
workers = inventory["all"]["children"]["cluster"]["children"]["workers"]
workers["hosts"] = dict(list(workers["hosts"].items())[:1])
yaml.safe_dump(inventory, open(sys.argv[2], "w"), sort_keys=False)
PY

table=$RESULTS/table.md
{
  echo "| nodes | run | provision.yml s | CPU s: ansible-playbook | nodes | all cores | changed per node | load average before |"
  echo "|---:|---|---:|---:|---:|---:|---|---|"
} >"$table"
for size in 8 2; do
  inventory=$RESULTS/inventory$size.yml
  echo "$(date -u +%FT%TZ) $size nodes: converge, then $REPEAT no-op runs" >&2
  before=$(loadavg)
  read -r took tree nodes all changed < <(provision "converge$size" "$inventory")
  echo "| $size | converge (makes them a $size-node cluster) | $took | $tree | $nodes | $all | $changed | $before |" >>"$table"
  for i in $(seq "$REPEAT"); do
    before=$(loadavg)
    read -r took tree nodes all changed < <(provision "noop$size-$i" "$inventory")
    echo "| $size | no-op $i | $took | $tree | $nodes | $all | $changed | $before |" >>"$table"
  done
done
echo "" >>"$table"
echo "Load average after: $(loadavg). $(nproc) cores; $(date -u +%FT%TZ)." >>"$table"
cat "$table"
