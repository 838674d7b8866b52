#!/usr/bin/env bash
# Issue 38's measurements of the memory-saving techniques on the GPU machine, one device call:
# the optimizer step alone (bench/gpu/optim_bench.py), then the cards grid of
# bench/gpu/memory_grid.py (numerics runs of 300 steps, memory points under 24-80 GiB caps, timed
# points alone). Run there from the repository root with .whl carried:
#   DEADLINE=500 bash bench/gpu/cards.sh
# What comes back under $OUT: optim.json, results.jsonl (every point: peaks, step times, losses),
# grid.log, run.log, logs.tar.gz. BENCHMARKS.md section 10 has the tables made from them.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/cards-out}
mkdir -p "$out"
if [[ ! -d /tmp/site/llamafactory ]]; then
  # Only what training needs: the playbooks do not run in this call.
  ls .whl/*.whl | grep -vE 'ansible_core|resolvelib|cryptography|cffi|pycparser' \
    | xargs python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee "$out/gpu.csv"
python3 -c 'import torch, transformers, llamafactory, bitsandbytes, torchao, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "llamafactory", llamafactory.__version__, "bitsandbytes", bitsandbytes.__version__, "torchao", torchao.__version__, "peft", peft.__version__)' | tee "$out/versions.txt"
echo "=== optimizer step alone ($(date +%T))"
python3 bench/gpu/optim_bench.py --shape 1.5b --warmup 2 --steps 5 --out "$out/optim.json"
echo "=== cards grid ($(date +%T))"
python3 bench/gpu/memory_grid.py run --grid cards --work /tmp/grid --out "$out" \
  --deadline "${DEADLINE:-480}" 2>&1 | tee "$out/run.log"
echo "=== CPU Adam alone ($(date +%T))"
timeout 60 python3 bench/gpu/optim_bench.py --shape 1.5b --steps 3 --what cpu-adam \
  --out "$out/optim_cpu.json"
echo "=== done ($(date +%T))"
