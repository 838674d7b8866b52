#!/usr/bin/env bash
# Run the LLaMA-Factory benchmark on the GPU machine. Usage: bench/device_bench.sh PHASE...
# Phases: setup (wheels, models, data, matmul peak, Liger check), single (1-GPU pairs, run
# side by side: GPU0 baseline, GPU1 profile), ablate, multi (2 logical nodes, one GPU each).
# Writes everything under $OUT (or /tmp/bench-out) and packs it into $OUT/results.tar.gz.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/bench-out}"
RES="${BENCH_RESULTS:-/tmp/bench-results}"
M=/tmp/bench-models
D=/tmp/bench-data
STEPS_05="${STEPS_05:-300}" STEPS_15="${STEPS_15:-150}" STEPS_MULTI="${STEPS_MULTI:-80}"
mkdir -p "$OUT" "$RES"

install_wheels() {
  if [[ ! -d /tmp/site/llamafactory ]]; then
    # Only what training needs; ansible-core and its deps travel for the playbook run.
    ls .whl/*.whl | grep -vE 'ansible_core|resolvelib|cryptography|cffi|pycparser' \
      | xargs python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site || return 1
  fi
  export PYTHONPATH=/tmp/site
  export PATH="/tmp/site/bin:$PATH"
}

bench() {  # bench NAME PRESET MODEL STEPS WARMUP GPUS NODES PORT [extra args]
  if (( SECONDS - T0 > ${BENCH_DEADLINE_S:-420} )); then echo "skip $1 (time)"; return; fi
  local name=$1 preset=$2 model=$3 steps=$4 warmup=$5 gpus=$6 nodes=$7 port=$8
  shift 8
  HF_DATASETS_CACHE="/tmp/hfds/$name" python3 bench/bench_lf.py run --name "$name" \
    --preset "$preset" --model "$M/$model" --data-dir "$D" --steps "$steps" --warmup "$warmup" \
    --gpus "$gpus" --nodes "$nodes" --port "$port" --results "$RES" \
    --measured-peak "$RES/matmul.json" --set max_samples=4000 "$@" >"$RES/$name.summary.log" 2>&1
  echo "$name: rc=$? $(grep -E '"(tokens_per_s|mfu)"' "$RES/$name.summary.log" | tr -d '\n ')"
}

profile_preset() { if [[ -f "$RES/liger_ok" ]]; then echo "${1:-profile}"; else echo profile_noliger; fi; }

tps() { python3 -c "import json,sys;print(json.load(open(sys.argv[1])).get('tokens_per_s',0))" "$RES/$1/summary.json" 2>/dev/null || echo 0; }

best_profile() {  # best_profile 05|15 LIGER_TPS: the faster of profile (Liger) and profile_noliger
  if python3 -c "import sys;sys.exit(0 if float(sys.argv[1])>float(sys.argv[2]) else 1)" "$(tps "$1_prof_noliger_1g")" "$2"; then
    echo profile_noliger; else echo profile; fi
}

phase_setup() {
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm --format=csv
  nvidia-smi topo -m || true
  python3 -c 'import torch,transformers,llamafactory,peft,accelerate,datasets,trl,tokenizers,triton,liger_kernel;print("torch",torch.__version__,"cuda",torch.version.cuda,"nccl",torch.cuda.nccl.version(),"transformers",transformers.__version__,"llamafactory",llamafactory.__version__,"peft",peft.__version__,"accelerate",accelerate.__version__,"datasets",datasets.__version__,"trl",trl.__version__,"tokenizers",tokenizers.__version__,"triton",triton.__version__)' | tee "$RES/versions.txt"
  python3 bench/make_model.py --size 0.5b --out "$M/qwen2.5-0.5b-random" --device cuda:0 \
    --data-dir "$D" --samples 6000 &
  CUDA_VISIBLE_DEVICES=1 python3 bench/make_model.py --size 1.5b --out "$M/qwen2.5-1.5b-random" \
    --device cuda:0 &
  wait
  python3 bench/matmul_peak.py "$RES/matmul.json" | grep -E 'tflops_median"' | tail -1
  if python3 bench/check_liger.py; then touch "$RES/liger_ok"; fi
}

phase_single() {  # 1 GPU each, baseline on GPU0 beside profile on GPU1
  local p; p=$(profile_preset)
  bench 05_base_1g baseline qwen2.5-0.5b-random "$STEPS_05" 30 0 1 29501 &
  bench 05_prof_1g "$p" qwen2.5-0.5b-random "$STEPS_05" 30 1 1 29502 &
  wait
  bench 15_base_1g baseline qwen2.5-1.5b-random "$STEPS_15" 30 0 1 29503 &
  bench 15_prof_1g "$p" qwen2.5-1.5b-random "$STEPS_15" 30 1 1 29504 &
  wait
}

phase_ablate() {
  bench 05_prof_purebf16_1g "$(profile_preset profile_pure_bf16)" qwen2.5-0.5b-random "$STEPS_05" 30 0 1 29505 &
  bench 15_prof_mb8_1g "$(profile_preset profile_mb8)" qwen2.5-1.5b-random 80 20 1 1 29506 &
  wait
}

phase_noliger() {  # the profile without Liger, 1 GPU each (0.5B on GPU0, 1.5B on GPU1)
  bench 05_prof_noliger_1g profile_noliger qwen2.5-0.5b-random "$STEPS_05" 30 0 1 29507 &
  bench 15_prof_noliger_1g profile_noliger qwen2.5-1.5b-random "$STEPS_15" 30 1 1 29508 &
  wait
}

phase_large() {  # the profile without Liger at 8 packed rows per GPU (a larger global batch)
  bench 15_prof_noliger_mb8_1g profile_noliger_mb8 qwen2.5-1.5b-random 80 20 0 1 29509 &
  bench 05_prof_noliger_mb8_1g profile_noliger_mb8 qwen2.5-0.5b-random 80 20 1 1 29510 &
  wait
}

phase_multi() {  # 2 logical nodes on one host, one GPU each, NCCL over NVLink
  local p05 p15 ms="--set max_samples=1500"
  p05=$(best_profile 05 "${LIGER_TPS_05:-0}") p15=$(best_profile 15 "${LIGER_TPS_15:-0}")
  echo "multi: 0.5B profile preset $p05, 1.5B profile preset $p15"
  bench 05_base_2n baseline qwen2.5-0.5b-random "$STEPS_MULTI" 15 0,1 2 29511 $ms
  bench 05_prof_2n "$p05" qwen2.5-0.5b-random "$STEPS_MULTI" 15 0,1 2 29512 $ms
  bench 15_base_2n baseline qwen2.5-1.5b-random "$STEPS_MULTI" 15 0,1 2 29513 $ms
  bench 15_prof_2n "$p15" qwen2.5-1.5b-random "$STEPS_MULTI" 15 0,1 2 29514 $ms
}

phase_models() {  # models and data only (the matmul peak comes from an earlier call)
  python3 bench/make_model.py --size 0.5b --out "$M/qwen2.5-0.5b-random" --device cuda:0 \
    --data-dir "$D" --samples 6000 &
  CUDA_VISIBLE_DEVICES=1 python3 bench/make_model.py --size 1.5b --out "$M/qwen2.5-1.5b-random" \
    --device cuda:0 &
  wait
  cp bench/results/matmul.json "$RES/matmul.json"
  [[ "${LIGER_OK:-0}" == 1 ]] && touch "$RES/liger_ok"
}

T0=$SECONDS
install_wheels || { echo "wheel install failed"; exit 1; }
for phase in "$@"; do
  # Skip a phase that would start after BENCH_DEADLINE_S seconds (default 420).
  if (( SECONDS - T0 > ${BENCH_DEADLINE_S:-420} )); then echo "== skip $phase (time)"; continue; fi
  echo "== phase $phase $(date -u +%T)"
  "phase_$phase"
  tar -C "$RES" -czf "$OUT/results.tar.gz" . 2>/dev/null
done
echo "== done $(date -u +%T)"
python3 bench/bench_lf.py report --results "$RES" | tee "$OUT/results.md"
tar -C "$RES" -czf "$OUT/results.tar.gz" . 2>/dev/null
ls -la "$OUT"
