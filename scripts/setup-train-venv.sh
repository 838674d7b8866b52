#!/usr/bin/env bash
# Builds the controller-side training venv (tests/unit/roles/test_templates.py parses rendered configs with
# LLaMA-Factory's and DeepSpeed's own parsers; molecule/train mounts it into its nodes) from the
# same lock as the nodes: every line of requirements/node-py<ver>.txt for the venv's Python, so the
# version pins live in one place (group_vars/all, resolved by scripts/lock-node-env.py). Offline:
# installs only from the wheelhouse of that Python, with uv (the controller venv's). Idempotent: a
# venv built from this very lock that imports the stack is left alone.
#
#   LLAMA_CLUSTER_CACHE         the controller cache (default ~/.cache/llama-cluster)
#   LLAMA_CLUSTER_TRAIN_PYTHON  python of the venv (default $LLAMA_CLUSTER_CACHE/venv-train/bin/python)
#   LLAMA_CLUSTER_WHEELHOUSE    the wheelhouse (default $LLAMA_CLUSTER_CACHE/wheelhouse/cp<ver>-pypi,
#                               filled by `ansible-playbook playbooks/wheelhouse.yml -e cluster_accelerator=cpu`)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache="${LLAMA_CLUSTER_CACHE:-$HOME/.cache/llama-cluster}"
python_bin="${LLAMA_CLUSTER_TRAIN_PYTHON:-$cache/venv-train/bin/python}"
venv_dir="$(dirname "$(dirname "$python_bin")")"
base_python=python3

version=$("$base_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
tag=${version/./}
lock="$root/requirements/node-py$tag.txt"
if [[ ! -f $lock ]]; then
  echo "error: no lock $lock for Python $version: scripts/lock-node-env.py makes one for each" \
    "Python of roles/python_env (python_env_os_python); run this with one of them" >&2
  exit 1
fi
wheelhouse="${LLAMA_CLUSTER_WHEELHOUSE:-$cache/wheelhouse/cp$tag-pypi}"
# The stamp names the lock and the bytecode: a venv from before the bytecode was compiled is
# compiled once.
stamp="$(sha256sum "$lock" | cut -c1-16)-pyc"

# The serve and TensorBoard tests (molecule/train/tests/test_serve.py) need tensorboard too, at the
# pin of llamafactory_extra_versions (it is no part of the node lock).
tensorboard_pin=$(sed -n 's/^  tensorboard: "\(.*\)"$/\1/p' "$root/group_vars/all/versions.yml")
probe='import llamafactory, deepspeed, transformers, torch, tensorboard; print(llamafactory.__version__, deepspeed.__version__, transformers.__version__, torch.__version__)'
if [[ -x "$python_bin" && "$(cat "$venv_dir/.lock-stamp" 2>/dev/null)" == "$stamp" ]] \
  && "$python_bin" -c "$probe" >/dev/null 2>&1; then
  echo "ok: $python_bin has the training stack of $(basename "$lock"): $("$python_bin" -c "$probe" 2>/dev/null)"
  exit 0
fi

if ! compgen -G "$wheelhouse/llamafactory-*.whl" >/dev/null; then
  echo "error: $wheelhouse holds no llamafactory wheel; fill it with" \
    "ansible-playbook playbooks/wheelhouse.yml -e cluster_accelerator=cpu -e wheelhouse_python=$version" \
    "or set LLAMA_CLUSTER_WHEELHOUSE" >&2
  exit 1
fi
uv="$root/.venv/bin/uv"
if [[ ! -x $uv ]]; then
  echo "error: $uv is missing: run scripts/setup-controller.sh first (requirements.txt pins uv)" >&2
  exit 1
fi

echo "building $venv_dir from $(basename "$lock") and $wheelhouse"
[[ -x "$venv_dir/bin/python" ]] || "$base_python" -m venv "$venv_dir"
# uv's cache beside the venv (one filesystem: hard links, no second copy of the stack).
UV_CACHE_DIR="${UV_CACHE_DIR:-$cache/uv}" UV_NO_CONFIG=1 "$uv" pip install --quiet \
  --python "$venv_dir/bin/python" --no-index --find-links "$wheelhouse" -r "$lock"
UV_CACHE_DIR="${UV_CACHE_DIR:-$cache/uv}" UV_NO_CONFIG=1 "$uv" pip install --quiet \
  --python "$venv_dir/bin/python" --find-links "$wheelhouse" "tensorboard==$tensorboard_pin"
# Bytecode now: molecule mounts this venv read-only into its nodes, where Python cannot write
# __pycache__, and every process would compile the stack again (importing LLaMA-Factory's trainer:
# 32 s of CPU from source, 13 s from bytecode, measured 2026-12-03). compileall compiles only what
# is missing or stale; the few files of test data that are not valid Python are left as they are.
echo "compiling the venv's bytecode"
"$python_bin" -m compileall -q -j 0 "$("$python_bin" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
"$python_bin" -c "$probe"
echo "$stamp" >"$venv_dir/.lock-stamp"
