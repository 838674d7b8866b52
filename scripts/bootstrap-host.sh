#!/usr/bin/env bash
# Prepares this machine to run the lab and the tests: a running Docker daemon, debootstrap (the
# lab's node image), rsync, and Python's venv module for the controller's .venv. On Debian/Ubuntu
# as root it installs what is missing with apt and starts dockerd; anywhere else it stops at once
# with one line naming what is missing and the command that fixes it. Quick when all is in place.
#   scripts/bootstrap-host.sh                  what `make demo` and `make test` need
#   scripts/bootstrap-host.sh --with chromium  also the command chromium, from the package chromium
# Environment: PYTHON (the controller's Python, default python3), BOOTSTRAP_DOCKER_WAIT (seconds
# to wait for a daemon it starts, default 60).
set -euo pipefail

self=scripts/bootstrap-host.sh
wait_s=${BOOTSTRAP_DOCKER_WAIT:-60}
python=${PYTHON:-python3}

fail() {
  echo "error: $*" >&2
  exit 1
}

# Each entry: a command the machine must have, and the Debian package that provides it.
wanted=(dockerd:docker.io docker:docker.io debootstrap:debootstrap rsync:rsync)
while (($#)); do
  case $1 in
    --with)
      (($# >= 2)) || fail "--with needs a package name, e.g. $self --with chromium"
      wanted+=("$2:$2")
      shift 2
      ;;
    *) fail "unknown argument '$1': usage: $self [--with PACKAGE]..." ;;
  esac
done

need=()
add() { [[ " ${need[*]} " == *" $1 "* ]] || need+=("$1"); }
for entry in "${wanted[@]}"; do
  command -v "${entry%%:*}" >/dev/null || add "${entry#*:}"
done
if ! command -v "$python" >/dev/null; then
  add python3
  add python3-venv
elif ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
  add python3-venv
fi

root=false
[[ $(id -u) == 0 ]] && root=true

if ((${#need[@]})); then
  if ! command -v apt-get >/dev/null; then
    fail "missing ${need[*]} and this machine has no apt-get:" \
      "install them with its package manager, then run $self again"
  fi
  $root || fail "missing ${need[*]} and this is not root: run sudo $self"
  echo "bootstrap: installing ${need[*]}"
  apt-get update -qq || fail "apt-get update failed (output above): fix the sources, run $self again"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null ||
    fail "apt-get install ${need[*]} failed (output above): fix it, run $self again"
fi

# The daemon: reachable as we are, or started here (root, local socket only).
daemon_up() { timeout 20 docker info >/dev/null 2>&1; }
daemon_up && exit 0

# Only this machine's own daemon is started here.
sock=/var/run/docker.sock
case ${DOCKER_HOST:-unix://$sock} in
  "unix://$sock" | unix:///run/docker.sock) ;;
  *) fail "the Docker daemon at DOCKER_HOST=$DOCKER_HOST does not answer:" \
    "start it there, or unset DOCKER_HOST to use this machine's" ;;
esac
if ! $root; then
  me=$(id -un)
  [[ -S $sock ]] && fail "the Docker daemon is running but $me may not use it:" \
    "run sudo usermod -aG docker $me and log in again (or run as root)"
  fail "the Docker daemon is not running and this is not root: run sudo $self"
fi

echo "bootstrap: starting dockerd"
if [[ -d /run/systemd/system ]] && systemctl cat docker.service >/dev/null 2>&1; then
  systemctl start docker.service || true
else
  # Its own session, so that a Ctrl-C in the make that started it leaves it running.
  setsid dockerd >/var/log/dockerd.log 2>&1 </dev/null &
  pid=$!
fi
for _ in $(seq "$wait_s"); do
  daemon_up && exit 0
  [[ -z ${pid:-} ]] || kill -0 "$pid" 2>/dev/null ||
    fail "dockerd exited at once: see /var/log/dockerd.log, fix the cause and run $self again"
  sleep 1
done
fail "dockerd did not answer within $wait_s s:" \
  "see /var/log/dockerd.log (or journalctl -u docker), fix the cause and run $self again"
