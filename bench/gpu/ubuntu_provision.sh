#!/usr/bin/env bash
# Issue 11's Ubuntu 24.04 proof on the one-GPU machine (device tool, kind nvidia-h200): that
# machine as a one-node cluster that is its own controller (bench/gpu/ubuntu_inventory.yml, local
# connection): provision.yml in full (pre-flight included, no --tags), a second run that must
# report changed=0, playbooks/check.yml, and a short train.yml of the tiny model (scripts/make_tiny_model.py).
# Runs there as root from the repository root with .whl and .cache/collections carried
# (bench/gpu/ubuntu_wheels.sh fills .whl here):
#
#   bash bench/gpu/ubuntu_provision.sh [step...]   steps: machine controller provision rerun check train
#
# What it shows: the pre-flight on Python 3.12 picks requirements/node-py312.txt; the driver, CUDA
# and GPU are detected and kept; the image's torch stays (pytorch_install: false) and the overlay
# (node_env_overlay: true) installs LLaMA-Factory, DeepSpeed and the libraries the image lacks from
# the carried wheels, with uv; ufw is off (firewall_enabled: false); the SSH mesh runs as on any
# one-node cluster (host keys made with ssh-keygen -A when the machine has none).
# Logs: $OUT/steps.log (each step, its rc and play recap) and $OUT/ubuntu-proof.tar.gz (every log
# and the local facts); without $OUT, /tmp/ubuntu-proof. LLAMA_PROOF_ACCELERATOR=cpu rehearses it
# on a machine without a GPU (a Debian 12 container with a torch venv at /opt/torch/.venv).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 ANSIBLE_FORCE_COLOR=0 ANSIBLE_NOCOLOR=1
export ANSIBLE_STDOUT_CALLBACK=ansible.builtin.default
export LLAMA_PROOF_WHEELS=$PWD/.whl/node LLAMA_CLUSTER_CACHE=${LLAMA_CLUSTER_CACHE:-/tmp/llama-cluster-cache}
work=/tmp/ubuntu-proof
out=${OUT:-$work}
mkdir -p "$work" "$out"
ctl=/opt/llama-controller
inventory=bench/gpu/ubuntu_inventory.yml
steps=${*:-machine controller provision rerun check train}
status=0

say() { echo "=== $* ($(date -u +%FT%TZ), ${SECONDS}s)" | tee -a "$out/steps.log"; }
# run NAME CMD...: the command's output to $work/NAME.log; its rc and play recap to steps.log.
run() {
  local name=$1 rc
  shift
  say "$name: $*"
  "$@" >"$work/$name.log" 2>&1
  rc=$?
  { sed -n '/^PLAY RECAP/,$p' "$work/$name.log" | grep -v '^$'; echo "$name rc=$rc"; } | tee -a "$out/steps.log"
  ((rc == 0)) || { tail -30 "$work/$name.log" | tee -a "$out/steps.log"; status=1; }
  return "$rc"
}
playbook() { "$ctl/bin/ansible-playbook" -i "$inventory" "${skip[@]}" "$@"; }
skip=()

for step in $steps; do
  case $step in
    machine)
      say "machine"
      {
        grep PRETTY_NAME /etc/os-release; uname -r
        echo "system python: $(/usr/bin/python3 --version 2>&1)"
        /opt/torch/.venv/bin/python -c 'import sys, torch; print("image env:", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
        echo "pid 1: $(ps -o comm= -p 1)"
        for tool in sshd ufw sudo rsync ssh-keygen apt-get; do
          printf '%s: %s\n' "$tool" "$(command -v "$tool" || echo missing)"
        done
        echo "carried: $(find .whl -name '*.whl' | wc -l) wheels, $(du -sh .whl | cut -f1)"
      } 2>&1 | tee "$work/machine.txt" | tee -a "$out/steps.log"
      ;;
    controller)
      # The machine is its own controller: ansible-core in a venv of the system Python 3.12.
      run controller bash -c "/usr/bin/python3 -m venv $ctl && $ctl/bin/python -m pip install -q \
        --no-index --no-deps --no-compile --disable-pip-version-check .whl/controller/*.whl \
        && $ctl/bin/ansible-playbook --version"
      ;;
    provision | rerun)
      if ! compgen -G '/etc/ssh/ssh_host_*_key.pub' >/dev/null; then
        if command -v ssh-keygen >/dev/null; then
          say "no SSH host keys: ssh-keygen -A (the SSH mesh reads them; no sshd is started)"
          mkdir -p /etc/ssh && ssh-keygen -A
        else
          say "no ssh-keygen: the SSH mesh cannot make its key; --skip-tags ssh_mesh"
          skip=(--skip-tags ssh_mesh)
        fi
      fi
      run "$step" playbook provision.yml
      if [[ $step == rerun ]] && ! grep -Eq '^h200 +: ok=[0-9]+ +changed=0 ' "$work/rerun.log"; then
        say "rerun: changed is not 0"
        grep -E '^(changed|TASK)' "$work/rerun.log" | grep -B1 '^changed' | tee -a "$out/steps.log"
        status=1
      fi
      cp /etc/ansible/facts.d/llama_host.fact "$work/llama_host.json" 2>/dev/null
      cp /etc/ansible/facts.d/llama_stack.fact "$work/llama_stack.json" 2>/dev/null
      ;;
    check)
      # No sshd on this machine: the SSH reachability check has nothing to reach.
      run check playbook playbooks/check.yml -e '{"preflight_checks": ["consistency", "collective"]}'
      ;;
    train)
      tiny=(-e model=tiny)
      if ! command -v rsync >/dev/null; then
        # The tiny model is a directory of the controller, copied to the nodes with rsync, which
        # this image lacks (provision.yml installs it where apt can): train.yml must refuse that
        # before touching the node, naming rsync; then the run follows its advice, the model at
        # the same path on the node (this one-node cluster is its own controller) and
        # -e model_shared=true.
        before=$status
        run train-norsync playbook train.yml -e model=tiny
        status=$before
        if grep -q "with rsync, which the controller lacks" "$work/train-norsync.log" \
          && ! grep -q "Train | Prepare every node" "$work/train-norsync.log"; then
          say "train-norsync: refused before any node task, naming rsync (as it should)"
        else
          say "train-norsync: not the refusal expected"
          status=1
        fi
        shared=/opt/llama-cluster/models/tiny-shared
        rm -rf "$shared" && cp -r "$LLAMA_CLUSTER_CACHE/models/tiny" "$shared" && chmod -R a+rX "$shared"
        tiny=(-e model=tiny-shared -e "model_path=$shared" -e model_shared=true -e model_template=qwen
              -e finetuning_type=lora -e lora_target=all -e cutoff_len=128)
      fi
      run train playbook train.yml "${tiny[@]}" -e '{"train_args": {"max_steps": 20, "logging_steps": 5}}'
      latest=$(ls -1t /opt/llama-cluster/runs 2>/dev/null | grep '^train-' | head -1)
      [[ -n $latest ]] && cp "/opt/llama-cluster/runs/$latest/output/trainer_log.jsonl" "$work/trainer_log.jsonl" 2>/dev/null
      ;;
    *) say "unknown step $step"; status=1 ;;
  esac
  [[ $out != "$work" ]] && tar -C "$work" -czf "$out/ubuntu-proof.tar.gz" .
done
say "done: status $status"
exit "$status"
