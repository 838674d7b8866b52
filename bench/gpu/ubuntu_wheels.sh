#!/usr/bin/env bash
# Fills the git-ignored .whl/ that bench/gpu/ubuntu_provision.sh carries to the GPU machine
# (the device tool carries at most 64 MiB a call, the repository and collections/ included):
#
#   bench/gpu/ubuntu_wheels.sh [PYTHON]      PYTHON: 3.12 (the GPU machine, default) or 3.11 (a
#                                            rehearsal on a Debian 12 container here)
#
# .whl/controller/  ansible-core and what it imports, at the controller's pins (constraints.txt),
#                   for a controller venv there (the machine is its own controller).
# .whl/node/        the node wheelhouse of an overlay install (node_env_overlay: true): the image
#                   keeps its torch and most libraries; these are the top-level pins and the
#                   libraries LLaMA-Factory needs that the image lacks or has at other versions,
#                   each at its version in requirements/node-py<ver>.txt (gradio, av, modelscope,
#                   the web UI's libraries are not needed to train and do not fit). uv included.
# Downloads from PyPI (pip, no dependencies, wheels for CPython <ver> manylinux x86_64); DeepSpeed
# (an sdist only) is taken from the controller's wheelhouse, where the wheelhouse role built it.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${1:-3.12}
tag=${python/./}
lock=requirements/node-py$tag.txt
cache=${LLAMA_CLUSTER_CACHE:-$HOME/.cache/llama-cluster}
out=.whl
# The libraries an overlay adds to the image (ENVIRONMENT.md lists the set that trained there).
NODE=(llamafactory transformers tokenizers peft accelerate datasets trl deepspeed uv
  fsspec dill multiprocess tyro docstring-parser shtab fire termcolor omegaconf torchdata
  hjson pydantic pydantic-core annotated-types typing-inspection)
CONTROLLER=(ansible-core resolvelib cryptography cffi pycparser jinja2 markupsafe pyyaml packaging)

pin() { # pin FILE NAME: name==version from a lock or constraints file (names compared PEP 503-style;
  # a lock line's hashes, after the version, are left out)
  awk -v want="$2" 'BEGIN { IGNORECASE = 1; gsub(/[-_.]+/, "-", want) }
    /^[^# ].*==/ { split($0, p, "=="); split(p[2], v, " "); n = p[1]; gsub(/[-_.]+/, "-", n)
      if (tolower(n) == tolower(want)) { print p[1] "==" v[1]; found = 1 } }
    END { exit !found }' "$1" || { echo "ubuntu_wheels: $2 is not pinned in $1" >&2; exit 1; }
}

download() { # download DIR PIN...: wheels only, no dependencies, for the target Python
  local dir=$1
  shift
  # Only PyPI and the pins given: no site pip.conf, find-links or constraints of this machine.
  env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
    .venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: \
    --implementation cp --python-version "$python" --abi "cp$tag" --abi abi3 --abi none \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64 \
    --index-url "${PIP_INDEX_URL:-https://pypi.org/simple}" --dest "$dir" "$@"
}

rm -rf "$out/controller" "$out/node"
mkdir -p "$out/controller" "$out/node"
node_pins=()
for name in "${NODE[@]}"; do
  [[ $name == deepspeed ]] && continue
  node_pins+=("$(pin "$lock" "$name")")
done
download "$out/node" "${node_pins[@]}"
deepspeed=$(pin "$lock" deepspeed)
wheel=$(find "$cache/wheelhouse" -name "deepspeed-${deepspeed#*==}-py3-none-any.whl" -print -quit)
if [[ -z $wheel ]]; then
  echo "ubuntu_wheels: no deepspeed-${deepspeed#*==} wheel under $cache/wheelhouse: fill the" \
    "wheelhouse first (ansible-playbook playbooks/wheelhouse.yml -e cluster_accelerator=cpu)" >&2
  exit 1
fi
cp "$wheel" "$out/node/"
controller_pins=()
for name in "${CONTROLLER[@]}"; do controller_pins+=("$(pin constraints.txt "$name")"); done
download "$out/controller" "${controller_pins[@]}"

count() { find "$1" -name '*.whl' | wc -l; }
echo "ubuntu_wheels: $out/node $(count "$out/node") wheels, $out/controller $(count "$out/controller")" \
  "wheels for CPython $python; $(du -sh "$out" | cut -f1) to carry (+ collections/ $(du -sh collections | cut -f1))"
