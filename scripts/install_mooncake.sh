#!/usr/bin/env bash
# Installs the mooncake data plane's engine (the `mooncake` extra) into a venv: Mooncake's CPU build of its
# transfer engine, and the system libraries its compiled module links that a slim image may lack.
# Usage: scripts/install_mooncake.sh PYTHON. Idempotent.
#
# * --no-deps: the wheel's metadata asks for aiohttp, requests and msgpack, which only Mooncake's store and
#   metadata-server clients use; the transfer engine with a direct handshake imports without them.
# * engine.so links libibverbs (even for TCP), libnuma and libcurl. As root with apt-get they are installed
#   non-interactively when the import fails; otherwise the plane is simply not offered (and its tests skip,
#   except under CI=true, where they fail).
set -euo pipefail
PY=${1:?usage: scripts/install_mooncake.sh PYTHON}
"$PY" -m pip install --quiet --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1
imports() { "$PY" -c 'import mooncake.engine' 2>/dev/null; }
imports && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    packages=(libibverbs1 libnuma1 libcurl4)
    apt-get install -y -qq "${packages[@]}" >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq "${packages[@]}"; }
fi
imports || echo "install_mooncake.sh: mooncake.engine does not import (libibverbs1 missing?): no mooncake data plane" >&2
