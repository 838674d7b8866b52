#!/usr/bin/env bash
# Sets up the controller: .venv with the pinned Python dependencies and .cache/collections with
# the pinned third-party Ansible collections (the project's own is collections/, in git), unpacked from the `ansible` package on PyPI (Galaxy is not needed).
# Idempotent and fast on a second run: each step is skipped when its inputs have not changed.
#   scripts/setup-controller.sh            set up (or refresh) the controller
#   scripts/setup-controller.sh --relock   re-resolve requirements.txt into constraints.txt
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# The bundle whose collections we take, and the collections we take from it.
ANSIBLE_BUNDLE_VERSION=12.3.0
COLLECTIONS=(community/general community/docker ansible/posix community/library_inventory_filtering_v1)

cache=${LLAMA_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-cluster}
mkdir -p "$cache/pip"
python=${PYTHON:-python3}

if ! "$python" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 14)))'; then
  echo "setup: Python 3.11 to 3.13 is needed for ansible-core 2.19; found $("$python" --version 2>&1)." >&2
  echo "setup: set PYTHON=/path/to/python3.11 and run again." >&2
  exit 2
fi

if [[ ${1:-} == --relock ]]; then
  tmp=$(mktemp -d)
  "$python" -m venv "$tmp/venv"
  "$tmp/venv/bin/pip" install -q -r requirements.txt
  { sed -n '1,2p' constraints.txt; "$tmp/venv/bin/pip" freeze --exclude-editable; } > constraints.txt.new
  mv constraints.txt.new constraints.txt
  rm -rf "$tmp"
  echo "setup: constraints.txt re-resolved"
fi

stamp() { cat "$@" | sha256sum | cut -c1-16; }

want=$(stamp requirements.txt constraints.txt)
if [[ ! -x .venv/bin/python || $(cat .venv/.stamp 2>/dev/null) != "$want" ]]; then
  echo "setup: installing the controller environment into .venv"
  "$python" -m venv .venv
  .venv/bin/pip install -q --cache-dir "$cache/pip" --upgrade pip
  .venv/bin/pip install -q --cache-dir "$cache/pip" -r requirements.txt -c constraints.txt
  echo "$want" > .venv/.stamp
fi

# Third-party collections, beside the project's own (collections/, in git): ansible.cfg's
# collections_path names both.
vendor=.cache/collections
want="ansible-$ANSIBLE_BUNDLE_VERSION ${COLLECTIONS[*]}"
if [[ $(cat "$vendor/.stamp" 2>/dev/null) != "$want" ]]; then
  echo "setup: unpacking collections from ansible==$ANSIBLE_BUNDLE_VERSION"
  wheel=$(ls "$cache"/ansible-"$ANSIBLE_BUNDLE_VERSION"-py3-none-any.whl 2>/dev/null || true)
  if [[ -z $wheel ]]; then
    .venv/bin/pip download -q --no-deps -d "$cache" "ansible==$ANSIBLE_BUNDLE_VERSION"
    wheel=$cache/ansible-$ANSIBLE_BUNDLE_VERSION-py3-none-any.whl
  fi
  rm -rf "$vendor"
  mkdir -p "$vendor"
  .venv/bin/python - "$wheel" "$vendor" "${COLLECTIONS[@]}" <<'PY'
import sys
import zipfile

wheel, dest, *wanted = sys.argv[1:]
prefixes = tuple(f"ansible_collections/{name}/" for name in wanted)
with zipfile.ZipFile(wheel) as archive:
    members = [m for m in archive.namelist() if m.startswith(prefixes)]
    archive.extractall(dest, members)
PY
  echo "$want" > "$vendor/.stamp"
fi

echo "setup: controller ready ($(.venv/bin/ansible --version | sed -n 1p))"
echo "setup: activate it with: source .venv/bin/activate"
