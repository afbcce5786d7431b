"""Build and load the C++ kernels: compiled once per machine into a persistent cache, loaded from it at startup.

The kernels are compiled just in time by `torch.utils.cpp_extension` (ninja + the system C++ compiler) rather
than at `pip install`: an install-time build would need torch inside pip's isolated build environment, where the
CPU wheel is not pinned. `make install` (or `python -m pdserve.native`) compiles them; a server only loads the
cached library (tens of ms) and never compiles while it starts or serves, unless told to with
`--attention-backend native`. The cache key covers the source, the flags, torch, Python and the CPU's features, so
`-march=native` code never runs on another CPU and an edited kernel is rebuilt, not reused.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from pdserve.utils import cpuinfo_line, native_cache_dir

HERE = Path(__file__).parent
SOURCES = (HERE / "paged_attention.cpp", HERE / "pointwise.cpp", HERE / "rotary_cache.cpp",
           HERE / "prefill_attention.cpp")
HEADERS = (HERE / "vec_math.h", HERE / "attention_avx512.h")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
BUILD_TIMEOUT_S = 600.0


def _cpu_features() -> str:
    return cpuinfo_line("flags", "Features") or platform.processor()


def library_name() -> str:
    key = hashlib.blake2b(digest_size=8)
    for part in (*(f.read_bytes() for f in SOURCES + HEADERS), " ".join(CFLAGS).encode(), torch.__version__.encode(),
                 platform.python_version().encode(), _cpu_features().encode()):
        key.update(part)
    return f"pdserve_native_{key.hexdigest()}"


def cached_library() -> Path:
    return native_cache_dir() / f"{library_name()}.so"


def compile_into_cache() -> Path:
    """Compile (if the cache lacks this build) and return the library's path. Run in a process of its own: the
    build puts ninja's directory on PATH and loads the library it built."""
    target = cached_library()
    if target.exists():
        return target
    from torch.utils import cpp_extension

    try:
        import ninja  # the wheel's binary, for machines without a system ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="build-") as staging:
        built = cpp_extension.load(name=target.stem, sources=[str(f) for f in SOURCES], extra_cflags=list(CFLAGS),
                                   build_directory=staging, is_python_module=False, verbose=False)
        # Published by a rename, so a process that finds the file never loads a half-written library.
        partial = Path(staging) / "publish.so"
        shutil.copyfile(built, partial)
        os.replace(partial, target)
    return target


def ensure_built(timeout: float = BUILD_TIMEOUT_S) -> Path:
    """The cached library, compiling it first in a child process when missing; raises with the compiler's
    output when the build fails."""
    target = cached_library()
    if not target.exists():
        run = subprocess.run([sys.executable, "-m", "pdserve.native"], capture_output=True, text=True,
                             timeout=timeout, check=False)
        if run.returncode != 0 or not target.exists():
            raise RuntimeError(f"building pdserve's native kernels failed:\n{(run.stdout + run.stderr)[-4000:]}")
    return target


def load_library(path: Path) -> None:
    """Register the library's ops under torch.ops.pdserve (loading the same file again is a no-op)."""
    if not hasattr(torch.ops.pdserve, "silu_and_mul"):
        torch.ops.load_library(str(path))
