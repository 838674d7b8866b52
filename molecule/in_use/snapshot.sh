#!/bin/bash
# What a provision.yml run could change on a node, one section per kind (molecule in_use compares
# it before and after the plan, and after the real run): packages, ufw, sysctls, accounts, the
# project's files and /etc/hosts. Read-only.
set -u
section() { printf '== %s\n' "$1"; }
section packages; dpkg-query -W -f '${Package} ${Version}\n'
section ufw; ufw show added 2>&1 | tail -n +2; ufw status verbose 2>&1 | grep -E '^(Status|Default|Logging)'
section sysctls; sysctl net.ipv4.ip_local_port_range; cat /etc/sysctl.conf /etc/sysctl.d/*.conf 2>/dev/null | grep -v '^#' | grep .
section users; getent passwd; getent group
section files
find /opt/llama-cluster /etc/ansible/facts.d /var/lib/llama-cluster /usr/local/sbin /etc/sysctl.d \
  /etc/profile.d /etc/ld.so.conf.d /etc/modprobe.d /etc/apt/sources.list.d \
  -printf '%p %y %m %u %g\n' 2>/dev/null | sort
find /opt/llama-cluster /etc/ansible/facts.d /usr/local/sbin /etc/hosts -type f -exec md5sum {} + 2>/dev/null \
  | awk '{print $2, "md5", $1}' | sort
section services; systemctl list-units --type=service --state=running --no-legend --plain | awk '{print $1}'
