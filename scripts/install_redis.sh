#!/usr/bin/env bash
# Installs Redis's server (Debian's redis-server), which the KV store tier's tests and benchmark start on
# ephemeral ports, where it is missing. As root with apt-get it is installed non-interactively, and the service
# Debian's package would start is left stopped (nothing here uses a system-wide Redis); otherwise the tests that
# need it skip (and fail under CI=true). Idempotent.
set -euo pipefail
command -v redis-server >/dev/null && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq redis-server >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
    if command -v systemctl >/dev/null && systemctl is-active --quiet redis-server 2>/dev/null; then
        systemctl stop redis-server || true
    fi
fi
command -v redis-server >/dev/null || echo "install_redis.sh: redis-server is not installed: the KV store tier's Redis tests skip" >&2
