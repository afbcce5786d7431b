#!/usr/bin/env bash
# Installs xxHash's C header (Debian's libxxhash-dev), which the prefix index's C core compiles against (the same
# XXH3 the Python core calls through the `xxhash` package), where it is missing. As root with apt-get it is
# installed non-interactively; otherwise the core is not built, the gateway uses the Python core, and the test
# that requires the C core fails under CI=true. Idempotent.
set -euo pipefail
header_present() { echo '#include <xxhash.h>' | "${CC:-cc}" -E -x c - >/dev/null 2>&1; }
header_present && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq libxxhash-dev >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libxxhash-dev >/dev/null; }
fi
header_present || echo "install_xxhash.sh: xxhash.h is not installed: the KV index's C core is not built" >&2
