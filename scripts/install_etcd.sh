#!/usr/bin/env bash
# Installs etcd (Debian's etcd-server and etcd-client) where it is missing: the membership tests start a real
# etcd on loopback, and `pdserve serve/gateway --discovery etcd://...` talk to one. Idempotent; as root with
# apt-get only (elsewhere the etcd tests skip, except under CI=true, where they fail).
set -euo pipefail
command -v etcd >/dev/null && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    packages=(etcd-server etcd-client)
    apt-get install -y -qq "${packages[@]}" >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq "${packages[@]}"; }
fi
command -v etcd >/dev/null || echo "install_etcd.sh: etcd is not installed: no etcd membership tests" >&2
