#!/usr/bin/env bash
# Filling the node environment with pip and with uv, on cold lab nodes (issue 11's "Measure"):
#
#   bench/env_install.sh [side] [1] [2]        default: all three, in this order
#
# side  one cold 2-node lab, node1 filled with pip and node2 with uv in the same provision.yml run
#       (same load, same moment), then the no-op re-run;
# 1, 2  N cold nodes with pip, then N cold nodes with uv (a fresh lab each time), each followed by
#       its no-op re-run.
# Every run is the whole provision.yml from the controller's wheelhouse (filled once beforehand:
# make test-env); "env" is the time each node spent in python_env + pytorch + llamafactory (the
# environment's creation and fill: apt, venv, uv's wheel, the torch trio, the stack), measured per
# host by bench/callback/host_times.py.
# The lab is llama-lab-$LAB_PREFIX (default e); it is removed at the end (KEEP=1 keeps the last).
# Writes a markdown table to stdout and $RESULTS (default runs/bench-env-install/), logs beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
export LLAMA_CLUSTER_CACHE=${LLAMA_CLUSTER_CACHE:-$HOME/.cache/llama-cluster}
LAB=llama-lab-${LAB_PREFIX:-e}
RESULTS=${RESULTS:-runs/bench-env-install}
mkdir -p "$RESULTS"
phases=${*:-side 1 2}
ansible_playbook=.venv/bin/ansible-playbook
export ANSIBLE_CALLBACK_PLUGINS=$PWD/bench/callback ANSIBLE_CALLBACKS_ENABLED=host_times
export ANSIBLE_STDOUT_CALLBACK=ansible.builtin.default ANSIBLE_NOCOLOR=1

lab() { env -u ANSIBLE_CALLBACKS_ENABLED "$ansible_playbook" playbooks/lab.yml -e lab_cluster_name="$LAB" "$@" >>"$RESULTS/lab.log" 2>&1; }
cleanup() { [[ ${KEEP:-0} == 1 ]] || lab -e lab_state=absent || true; }
trap cleanup EXIT

# provision LABEL INSTALLERS...: one provision.yml run; node i gets the i-th installer.
provision() {
  local label=$1 start end i=1 vars
  shift
  vars=$RESULTS/$label.inventory.yml
  { echo "all:"; echo "  hosts:"
    for installer in "$@"; do echo "    $LAB-node$i: {python_env_installer: $installer}"; i=$((i + 1)); done
  } >"$vars"
  start=$(date +%s.%N)
  LLAMA_BENCH_TIMES=$RESULTS/$label.times.json \
    "$ansible_playbook" -i inventory/lab.yml -i "$vars" provision.yml >"$RESULTS/$label.log" 2>&1 \
    || { tail -40 "$RESULTS/$label.log"; return 1; }
  end=$(date +%s.%N)
  .venv/bin/python - "$label" "$RESULTS/$label.times.json" "$RESULTS/$label.log" \
    "$(echo "$end - $start" | bc)" "$@" >>"$RESULTS/table.md" <<'PY'
import json, re, sys
label, times, log, wall, *installers = sys.argv[1:]
times = json.load(open(times))
recap = dict(re.findall(r"^(\S+)\s+: ok=\d+\s+changed=(\d+)", open(log).read(), re.M))
for i, installer in enumerate(installers, 1):
    host = next(h for h in times if h.endswith(f"-node{i}"))
    t = times[host]
    env = sum(t.get(r, 0.0) for r in ("python_env", "pytorch", "llamafactory"))
    step = lambda name: f"{t.get('step:' + name, 0):.0f}"
    print(f"| {label} | {len(installers)} | {host} | {installer} | {float(wall):.0f} | {env:.0f} "
          f"| {step('os packages')} | {step('venv')} | {step('uv bootstrap')} | {step('torch')} "
          f"| {step('stack')} | {t.get('wheelhouse', 0):.0f} | {recap.get(host, '?')} |")
PY
  tail -n "$#" "$RESULTS/table.md"
}

cold() { # cold NODES INSTALLERS...: a fresh lab of NODES nodes, a cold run and its re-run.
  local nodes=$1
  shift
  lab -e lab_state=absent
  lab -e lab_nodes="$nodes"
  provision "cold-$nodes-$(IFS=+; echo "$*")" "$@"
  provision "rerun-$nodes-$(IFS=+; echo "$*")" "$@"
}

if [[ ! -s $RESULTS/table.md ]]; then
  { echo "| run | nodes | host | installer | provision.yml s | env s | apt s | venv s | uv wheel s | torch trio s | stack s | wheelhouse sync s | changed |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"; } >"$RESULTS/table.md"
fi
for phase in $phases; do
  case $phase in
    side) cold 2 pip uv ;;
    1) cold 1 pip; cold 1 uv ;;
    2) cold 2 pip pip; cold 2 uv uv ;;
    *) echo "unknown phase $phase (side, 1, 2)" >&2; exit 2 ;;
  esac
done
cat "$RESULTS/table.md"
