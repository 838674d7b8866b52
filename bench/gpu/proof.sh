#!/usr/bin/env bash
# The GPU proof (issue 7): the project's own playbooks on the 2x H200 machine, two logical nodes
# on one host (bench/gpu/inventory.yml), then the same training YAML launched by hand, and on one
# GPU. Runs there as root from the repository root, with .whl/ and .cache/collections/ carried:
#   bash bench/gpu/proof.sh [phase...]     phases: setup provision check train hand one sockets
# Everything it measures goes to $OUT (or /tmp/proof).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 ANSIBLE_FORCE_COLOR=0
# What the phases write gathers in $out; $OUT/proof.tar.gz is refreshed after each phase (the
# device tool brings back few files), $OUT/proof.log has the whole output.
out=/tmp/proof
mkdir -p "$out"
python=/opt/torch/.venv/bin/python3
export PATH=/opt/torch/.venv/bin:$PATH
inventory=bench/gpu/inventory.yml
model=/opt/models/q05
data=/opt/data
steps=${STEPS:-100}
train_args="{\"train_args\": {\"max_steps\": $steps, \"logging_steps\": 5, \"save_steps\": 100000,
  \"learning_rate\": 1.0e-5, \"include_num_input_tokens_seen\": \"non_padding\"}}"
phases=${*:-setup provision check train hand one sockets}

say() { echo "=== $* ($(date +%T), ${SECONDS}s)"; }
playbook() { ansible-playbook -i "$inventory" "$@"; }
latest_run() { ls -1t /opt/llama-cluster/runs | grep '^train-' | head -1; }

for phase in $phases; do
  case $phase in
    setup)
      say "install the carried wheels into the image's environment (no index, no deps)"
      "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpus.csv"
      say "generate a random-initialised Qwen2.5-0.5B-shaped model and the synthetic data"
      "$python" bench/make_model.py --size 0.5b --out "$model" --data-dir "$data" --device cuda
      ;;
    provision)
      say "provision: detect driver, CUDA, NCCL; record the stack (installs nothing it finds)"
      playbook provision.yml --tags host_facts,nvidia_driver,cuda_toolkit,nccl,llamafactory,job_supervisor 2>&1 \
        | tee "$out/provision.log" | tail -25
      cp /etc/ansible/facts.d/llama_host.fact "$out/llama_host.json" 2>/dev/null
      cp /etc/ansible/facts.d/llama_stack.fact "$out/llama_stack.json" 2>/dev/null
      ;;
    check)
      say "check.yml: versions table and the NCCL all-reduce through the job launcher"
      playbook playbooks/check.yml -e '{"preflight_checks": ["consistency", "collective"]}' 2>&1 \
        | tee "$out/check.log" | grep -E "all-reduce|\\||failed=|msg" | tail -25
      ;;
    train)
      say "train.yml on two logical nodes (one GPU each)"
      playbook train.yml -e model=qwen2.5-0.5b -e model_path="$model" \
        -e dataset_file="$data/synth_alpaca.json" -e "$train_args" 2>&1 | tee "$out/train.log" | tail -30
      run=$(latest_run)
      cp "/opt/llama-cluster/runs/$run/output/trainer_log.jsonl" "$out/train_yml.jsonl"
      cp "/opt/llama-cluster/runs/$run/train.yaml" "$out/train.yaml"
      cp "/opt/llama-cluster/runs/$run/output/training_loss.png" "$out/train_yml_loss.png" 2>/dev/null
      ;;
    hand)
      say "the same train.yaml launched by hand with torchrun on the same two GPUs"
      run=$(latest_run)
      sed "s#/opt/llama-cluster/runs/$run/output#/opt/hand/output#" "/opt/llama-cluster/runs/$run/train.yaml" \
        > /opt/hand.yaml
      for rank in 0 1; do
        FORCE_TORCHRUN=1 NNODES=2 NODE_RANK=$rank NPROC_PER_NODE=1 MASTER_ADDR=127.0.0.1 \
          MASTER_PORT=29611 CUDA_VISIBLE_DEVICES=$rank NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo \
          llamafactory-cli train /opt/hand.yaml > "$out/hand-rank$rank.log" 2>&1 &
      done
      wait
      cp /opt/hand/output/trainer_log.jsonl "$out/hand.jsonl"
      ;;
    one)
      say "the same YAML on one GPU"
      sed 's#/opt/hand/output#/opt/one/output#' /opt/hand.yaml > /opt/one.yaml
      CUDA_VISIBLE_DEVICES=0 llamafactory-cli train /opt/one.yaml > "$out/one.log" 2>&1
      cp /opt/one/output/trainer_log.jsonl "$out/one_gpu.jsonl"
      ;;
    sockets)
      say "train.yml with a different NCCL_HOSTID per node: NCCL crosses sockets"
      "$python" - "$inventory" > /tmp/inventory-sockets.yml <<'PY'
import sys, yaml
inv = yaml.safe_load(open(sys.argv[1]))
for group in ("master", "workers"):
    for name, host in inv["all"]["children"]["cluster"]["children"][group]["hosts"].items():
        host["cluster_environment"] = {**host["cluster_environment"], "NCCL_HOSTID": f"host-{name}"}
print(yaml.safe_dump(inv))
PY
      inventory=/tmp/inventory-sockets.yml playbook train.yml -e model=qwen2.5-0.5b -e model_path="$model" \
        -e dataset_file="$data/synth_alpaca.json" -e "$train_args" 2>&1 | tee "$out/sockets.log" | tail -12
      cp "/opt/llama-cluster/runs/$(latest_run)/output/trainer_log.jsonl" "$out/sockets.jsonl"
      ;;
  esac
  [[ -n ${OUT:-} ]] && tar -C "$out" -czf "$OUT/proof.tar.gz" .
done
say "summary"
"$python" bench/gpu/tokens.py --params 494e6 --warmup 20 train_yml:2="$out/train_yml.jsonl" \
  hand:2="$out/hand.jsonl" one_gpu:1="$out/one_gpu.jsonl" sockets:2="$out/sockets.jsonl" \
  | tee "$out/summary.jsonl"
[[ -n ${OUT:-} ]] && tar -C "$out" -czf "$OUT/proof.tar.gz" .
