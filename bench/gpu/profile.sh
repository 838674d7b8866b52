#!/usr/bin/env bash
# Issue 17's benchmark: train.yml against LLaMA-Factory's example configs (bench/gpu/harness.py
# says what each phase does; bench/README.md has the commands, budget and tables).
#
# On the GPU machine, from the repository root, .whl and .cache/collections carried (device tool):
#   bash bench/gpu/profile.sh setup goal-1.5b goal-0.5b shard-none shard-zero2
# Here, the dry run on the CPU with the tiny model (same phases, local connection):
#   PROFILE_MODE=cpu bash bench/gpu/profile.sh setup goal-0.5b shard-zero2
# Here, in seconds, any command left for the GPU machine: each phase planned and checked, not
# launched (bench/gpu/dry.py; bench/tests/test_dry_run.py runs every phase so in CI):
#   PROFILE_MODE=dry BENCH=baselines GPU_CAP_GIB=24 bash bench/gpu/profile.sh setup cards24-14blora
# Issue 21's baselines (a)-(d) and targets (bench/gpu/baselines.py):
#   BENCH=baselines bash bench/gpu/profile.sh setup base-1.5b
#   BENCH=baselines GPU_CAP_GIB=24 bash bench/gpu/profile.sh setup target-1.5b
#
# Environment: OUT (where results go; the device tool sets it), DEADLINE_S (seconds after which no
# phase starts; default 480), GPU_MEMORY_GIB (sets gpu_memory_gib, the planning knob, on the nodes instead of
# leaving it to the node facts), PRODUCT_EXTRA (JSON extra vars for every train.yml run).
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 ANSIBLE_FORCE_COLOR=0
mode=${PROFILE_MODE:-gpu}
out=${OUT:-/tmp/profile-out}
mkdir -p "$out"
if [[ $mode == gpu ]]; then
  for need in .whl/llamafactory-*.whl .whl/ansible_core-*.whl .cache/collections/ansible_collections/community/general; do
    [[ -e $need ]] || { echo "missing $need: run bench/gpu/wheels.py here and carry .whl and .cache/collections"; exit 2; }
  done
  # The image's own environment (torch 2.11.0+cu130) gets the carried wheels: train.yml's launcher
  # runs <cluster_env_dir>/bin/llamafactory-cli, so they go where that is, not into a --target dir.
  env=/opt/torch/.venv
  echo "=== $(date +%T) install $(ls .whl/*.whl | wc -l) carried wheels into $env (no index, no deps)"
  "$env/bin/python3" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  python=$env/bin/python3 playbook=$env/bin/ansible-playbook
  base=/opt/llama-cluster work=/tmp/profile-work
elif [[ $mode == dry ]]; then
  python=${PYTHON:-$PWD/.venv/bin/python} playbook=ansible-playbook
  base=/opt/llama-cluster work=$(mktemp -d)
else
  cache=${LLAMA_CLUSTER_CACHE:-$HOME/.cache/llama-cluster}
  python=${LLAMA_CLUSTER_TRAIN_PYTHON:-$cache/venv-train/bin/python}
  playbook=$PWD/.venv/bin/ansible-playbook
  base=${DRY_BASE:-/tmp/gpu-dry/cluster} work=${DRY_WORK:-/tmp/gpu-dry/work}
fi
args=(run --mode "${mode/dry/gpu}" --playbook "$playbook" --out "$out" --work "$work"
      --base-dir "$base" --deadline-s "${DEADLINE_S:-480}")
[[ $mode == dry ]] && args+=(--dry)
[[ -n ${GPU_MEMORY_GIB:-} ]] && args+=(--gpu-memory-gib "$GPU_MEMORY_GIB")
[[ -n ${PRODUCT_EXTRA:-} ]] && args+=(--product-extra "$PRODUCT_EXTRA")
# BENCH=baselines runs bench/gpu/baselines.py (issue 21's comparisons; GPU_CAP_GIB emulates a
# smaller GPU there) with the same set-up.
bench=${BENCH:-harness}
[[ -n ${GPU_CAP_GIB:-} ]] && args+=(--gpu-cap-gib "$GPU_CAP_GIB")
exec "$python" "bench/gpu/$bench.py" "${args[@]}" "$@"
