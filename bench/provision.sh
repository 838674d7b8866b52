#!/usr/bin/env bash
# Measure provision.yml on fresh lab containers: a cold run, then the no-op re-run.
#
#   bench/provision.sh [NODES] [wheelhouse|index]
#
# NODES (default 2) containers named mol-provision-bench<N> from the lab node image, on their own
# network, reached with the docker connection; group_vars from molecule/shared (CPU lab settings).
# wheelhouse: nodes install from the controller's wheelhouse (LLAMA_CLUSTER_CACHE, filled once);
# index: every node downloads from PyPI itself (wheelhouse_enabled=false).
# Prints one line per phase; the containers and the network are removed at the end (KEEP=1 keeps
# them, e.g. to look at a node: docker exec -it mol-provision-bench1 bash).
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=${1:-2}
MODE=${2:-wheelhouse}
IMAGE=${LAB_IMAGE:-llama-cluster-node:bookworm-2}
NET=mol-provision-bench
export LLAMA_CLUSTER_CACHE=${LLAMA_CLUSTER_CACHE:-/var/cache/llama-cluster}
WORK=$(mktemp -d)
names=()
for i in $(seq 1 "$NODES"); do names+=("mol-provision-bench$i"); done

cleanup() {
  rm -rf "$WORK"
  [ "${KEEP:-0}" = 1 ] && return
  for n in "${names[@]}"; do docker rm -f "$n" >/dev/null 2>&1 || true; done
  docker network rm "$NET" >/dev/null 2>&1 || true
}
trap cleanup EXIT

docker network create "$NET" >/dev/null
for n in "${names[@]}"; do
  docker run -d --name "$n" --hostname "$n" --network "$NET" \
    --cap-add SYS_ADMIN --cap-add NET_ADMIN --cgroupns host \
    --tmpfs /run --tmpfs /run/lock --tmpfs /tmp \
    -v /sys/fs/cgroup:/sys/fs/cgroup:rw \
    -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/host-ca.crt:ro \
    "$IMAGE" /sbin/init >/dev/null
done

ln -s "$PWD/molecule/shared/group_vars" "$WORK/group_vars"
{
  echo "all:"
  echo "  vars: {ansible_connection: community.docker.docker, ansible_python_interpreter: /usr/bin/python3}"
  echo "  children:"
  echo "    cluster:"
  echo "      hosts:"
  for n in "${names[@]}"; do echo "        $n: {}"; done
  echo "    master:"
  echo "      hosts: {${names[0]}: {}}"
} >"$WORK/inventory.yml"

extra=()
[ "$MODE" = index ] && extra=(-e wheelhouse_enabled=false)
export ANSIBLE_CACHE_PLUGIN_CONNECTION="$WORK/facts" ANSIBLE_STDOUT_CALLBACK=ansible.builtin.default

phase() {
  local label=$1 start end
  shift
  start=$(date +%s)
  .venv/bin/ansible-playbook -i "$WORK/inventory.yml" provision.yml "${extra[@]}" "$@" >"$WORK/$label.log" 2>&1 \
    || { tail -40 "$WORK/$label.log"; exit 1; }
  end=$(date +%s)
  echo "$label nodes=$NODES mode=$MODE seconds=$((end - start)) $(grep -E '^mol-provision-bench1 ' "$WORK/$label.log" | tr -s ' ')"
}

phase cold
phase rerun
