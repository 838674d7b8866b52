#!/usr/bin/env bash
# Builds the controller-side test environment that tests/test_templates.py uses to parse rendered
# configs with LLaMA-Factory's and DeepSpeed's own parsers. Idempotent: a venv that already
# imports the pinned stack is left alone. Offline: installs only from a local wheelhouse.
#
#   LLAMA_CLUSTER_CACHE         the controller cache (default ~/.cache/llama-cluster)
#   LLAMA_CLUSTER_TRAIN_PYTHON  python of the venv (default $LLAMA_CLUSTER_CACHE/venv-train/bin/python)
#   LLAMA_CLUSTER_WHEELHOUSE    the wheelhouse (default: the first of the known cache locations that
#                               holds a llamafactory wheel)
set -euo pipefail

cache="${LLAMA_CLUSTER_CACHE:-$HOME/.cache/llama-cluster}"
python_bin="${LLAMA_CLUSTER_TRAIN_PYTHON:-$cache/venv-train/bin/python}"
venv_dir="$(dirname "$(dirname "$python_bin")")"
# serve/TensorBoard tests (molecule/train/tests/test_serve.py): tensorboard, the pin of llamafactory_extra_versions, joins the venv on every successful way out.
trap '[[ $? -ne 0 ]] || "$python_bin" -c "import tensorboard" 2>/dev/null || "$(dirname "$0")/../.venv/bin/python" -m pip --python "$python_bin" install -q --disable-pip-version-check tensorboard==2.21.0 || exit 1' EXIT

find_wheelhouse() {
  local candidate
  for candidate in ${LLAMA_CLUSTER_WHEELHOUSE:-} \
    "$cache/wheelhouse/cp311-pypi" "$cache/wheelhouse"; do
    if compgen -G "$candidate/llamafactory-*.whl" >/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  found="$(find "$cache" -name 'llamafactory-0.9.5-*.whl' -print -quit 2>/dev/null || true)"
  if [[ -n "$found" ]]; then
    dirname "$found"
    return 0
  fi
  return 1
}

probe='import llamafactory, deepspeed, transformers, torch; print(llamafactory.__version__, deepspeed.__version__, transformers.__version__, torch.__version__)'
if [[ -x "$python_bin" ]] && "$python_bin" -c "$probe" >/dev/null 2>&1; then
  echo "ok: $python_bin already has the training stack: $("$python_bin" -c "$probe" 2>/dev/null)"
  exit 0
fi

if ! wheelhouse="$(find_wheelhouse)"; then
  echo "error: no wheelhouse with llamafactory-0.9.5 found; set LLAMA_CLUSTER_WHEELHOUSE" >&2
  exit 1
fi
echo "building $venv_dir from $wheelhouse"

python3 -m venv "$venv_dir"
pip=("$venv_dir/bin/pip" install --no-index --find-links "$wheelhouse" --disable-pip-version-check -q)
"${pip[@]}" pip setuptools wheel 2>/dev/null || "${pip[@]}" setuptools
"${pip[@]}" torch==2.11.0 torchaudio==2.11.0 torchvision==0.26.0 \
  llamafactory==0.9.5 transformers==5.6.0 tokenizers==0.22.2 peft==0.18.1 accelerate==1.11.0 \
  datasets==4.0.0 trl==0.24.0 hjson pydantic py-cpuinfo ninja psutil msgpack einops
# DeepSpeed ships only an sdist; no ops are compiled (they are JIT-built on GPU nodes if needed).
DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation deepspeed==0.19.8
"$python_bin" -c "$probe"
