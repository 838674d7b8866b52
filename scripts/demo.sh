#!/usr/bin/env bash
# `make demo`: set up the controller, start the lab, provision it, train the tiny model on it;
# each phase is announced and timed, and a short block at the end says what was trained, where
# the results are and how long it all took. The phases are the Makefile's own targets (setup,
# lab, provision, train).
#   scripts/demo.sh     NODES (default 2), NPROC (default 1) and LAB_NAME (default llama-lab)
#                       from the environment
set -euo pipefail
cd "${0%/*}/.."

make=${MAKE:-make}
nodes=${NODES:-2}
started=$SECONDS
phases=()

took() {
  local s=$1
  if ((s >= 60)); then printf '%d min %02d s' $((s / 60)) $((s % 60)); else printf '%d s' "$s"; fi
}

phase() {
  local name=$1 t0=$SECONDS
  shift
  echo "==> demo: $name"
  if ! "$make" --no-print-directory "$@"; then
    echo "==> demo: $name failed after $(took $((SECONDS - t0))) (output above);" \
      "make lab-down removes the lab" >&2
    exit 1
  fi
  phases+=("$(printf '%-10s %s' "$name" "$(took $((SECONDS - t0)))")")
  echo "==> demo: $name done in $(took $((SECONDS - t0)))"
}

before=$(ls runs 2>/dev/null || true)
phase setup setup
# The nodes' wheels (the lab's Debian 12: Python 3.11, CPU) download on the controller while the
# lab's image builds and its nodes start: both wait on the network more than on the CPU.
# provision.yml then finds the wheelhouse complete; if this failed, it downloads the rest itself.
mkdir -p .cache
wheels_log=.cache/demo-wheelhouse.log
.venv/bin/ansible-playbook playbooks/wheelhouse.yml -e cluster_accelerator=cpu \
  -e wheelhouse_python=3.11 >"$wheels_log" 2>&1 &
wheels=$!
# One training process per node (the tests' lab runs two): the demo trains across the nodes
# without four processes importing torch on a 2-core machine.
phase lab lab NODES="$nodes" NPROC="${NPROC:-1}"
wait "$wheels" || echo "==> demo: the wheelhouse download failed ($wheels_log): provision retries it"
phase provision provision
phase train train

run=$(comm -13 <(sort <<<"$before") <(ls runs 2>/dev/null | sort) | grep -v '^datasets$' | tail -1)
loss=$(.venv/bin/python - "runs/$run/trainer_log.jsonl" <<'PY' 2>/dev/null || true
import json
import sys

losses = [json.loads(line).get("loss") for line in open(sys.argv[1]) if line.strip()]
print(next((loss for loss in reversed(losses) if loss is not None), ""))
PY
)

echo
echo "==> demo: done in $(took $((SECONDS - started)))"
printf '    %s\n' "${phases[@]}"
echo "    trained:   the tiny model on $nodes lab nodes, run ${run:-?}${loss:+, final loss $loss}"
echo "    results:   runs/${run:-<run id>}/ (training_loss.png, trainer_log.jsonl, logs/)"
echo "    next:      ansible-playbook train.yml -e model=tiny (again);" \
  "make lab-down (remove the lab)"
