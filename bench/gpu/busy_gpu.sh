#!/usr/bin/env bash
# Issue 38 on the GPU machine: a GPU another process holds stops train.yml's plan before launch,
# naming the process; -e gpu_memory_gib=N plans for a share of it (N at most what is free), and a
# larger N is refused. A python process holds 60 GiB of the H200 meanwhile. From the repository
# root, .whl and .cache/collections carried (bench/gpu/wheels.py):
#   bash bench/gpu/busy_gpu.sh
# What comes back under $OUT: nvidia-smi's own answers while the GPU is held (the recordings
# tests/data/nvidia-smi/h200-held.*.csv), the module's result, and each plan's log.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 ANSIBLE_FORCE_COLOR=0 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/busy-out}
mkdir -p "$out"
env=/opt/torch/.venv
"$env/bin/python3" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
"$env/bin/python3" -c "import torch, time; x = torch.empty(60 << 30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize(); print('held', flush=True); time.sleep(600)" \
  > "$out/hog.log" 2>&1 &
hog=$!
until grep -q held "$out/hog.log"; do sleep 1; kill -0 $hog 2>/dev/null || { cat "$out/hog.log"; exit 1; }; done
nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used --format=csv,noheader,nounits \
  > "$out/h200-held.gpus.csv"
nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory,process_name --format=csv,noheader,nounits \
  > "$out/h200-held.apps.csv"
echo '{"ANSIBLE_MODULE_ARGS": {}}' | "$env/bin/python3" \
  collections/ansible_collections/llama/cluster/plugins/modules/llama_node_usage.py > "$out/usage.json"
# One node: the master of bench/gpu/inventory.yml (GPU 0), planned without training (--check).
sed '/^        workers:/,$d' bench/gpu/inventory.yml > /tmp/one.yml
plan() { "$env/bin/ansible-playbook" -i /tmp/one.yml train.yml --check -e model=tiny "$@"; }
plan > "$out/refused.log" 2>&1; echo "held GPU: rc=$?"
plan -e gpu_memory_gib=70 > "$out/share.log" 2>&1; echo "gpu_memory_gib=70: rc=$?"
plan -e gpu_memory_gib=100 > "$out/too_large.log" 2>&1; echo "gpu_memory_gib=100: rc=$?"
kill $hog
wait
grep -h "holds a GPU\|GPU memory planned for\|is more than is free\|Memory-saving\|^ok=\|failed=" \
  "$out"/refused.log "$out"/share.log "$out"/too_large.log | cut -c1-600
