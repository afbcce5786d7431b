"""The prefix index's C core: compiled once per machine into the native build cache, loaded by the gateway.

Torch-free (the gateway never imports torch): the system C compiler builds one CPython extension from `core.c`
(applying events), `query.c` (routing's queries) and `module.c` (the Python type), with xxHash's header (Debian's
libxxhash-dev) for the same XXH3 the Python core calls through the `xxhash` package. `make install` builds it
(`python -m pdserve.kv_events.native`); the gateway only loads what is cached and falls back to the Python core
when nothing is (no compiler, no header), saying so in its log. The cache key covers the sources, the flags and the
Python build, so an edited core is rebuilt, not reused.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

from pdserve.utils import native_cache_dir

HERE = Path(__file__).parent
SOURCES = (HERE / "core.c", HERE / "query.c", HERE / "module.c")
HEADERS = (HERE / "core.h", HERE / "map.h")
MODULE = "pdserve_kv_index"
CFLAGS = ("-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall")
BUILD_TIMEOUT_S = 120.0


def cached_path() -> Path:
    key = hashlib.blake2b(digest_size=8)
    for part in (*(f.read_bytes() for f in SOURCES + HEADERS), " ".join(CFLAGS).encode(),
                 sysconfig.get_config_var("EXT_SUFFIX").encode(), sysconfig.get_paths()["include"].encode()):
        key.update(part)
    return native_cache_dir() / f"{MODULE}_{key.hexdigest()}{sysconfig.get_config_var('EXT_SUFFIX')}"


def build() -> Path:
    """Compile the core into the cache (if it lacks this build) and return its path; raises with the compiler's
    output when it fails."""
    target = cached_path()
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="build-") as staging:
        partial = Path(staging) / target.name
        run = subprocess.run([compiler, *CFLAGS, f"-I{sysconfig.get_paths()['include']}", *map(str, SOURCES),
                              "-o", str(partial)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if run.returncode != 0:
            raise RuntimeError(f"compiling the KV index core failed:\n{(run.stdout + run.stderr)[-4000:]}")
        os.replace(partial, target)  # published by a rename: a process that finds the file never loads half of it
    return target


def load() -> ModuleType | None:
    """The compiled core's module, or None when this machine has not built it. Loaded once per process: finding
    the build means hashing the sources, which every index would otherwise do again."""
    loaded = sys.modules.get(MODULE)
    if loaded is not None:
        return loaded
    path = cached_path()
    if not path.exists():
        return None
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[MODULE] = module
    return module
