"""Keep freed host memory for reuse instead of handing it back to the kernel after every step.

glibc serves an allocation above its mmap threshold (128 KiB, rising with use to at most 32 MiB) from a fresh
mapping and unmaps it on free, and trims the top of its heap whenever enough of it is free. A prefill step's
activations are tens of MiB each (8192 tokens x a 4096-wide MLP in fp32 is 128 MiB), so every step faults all of
their pages in again, zeroed by the kernel: about 700k page faults (2.8 GB) per 8192-token prefill step of a 124.7M
model, measured. vLLM-CPU preloads tcmalloc into its workers for the same reason. An engine process instead tells
glibc to serve large blocks from its heap and not to trim it, so a step reuses the pages the previous one freed:
the process keeps its peak working set resident (plus some slack: glibc's aligned allocations leave gaps it fills
only over a few steps), as it would under tcmalloc. Preloading tcmalloc needs the process started with LD_PRELOAD,
which this cannot arrange for every way an engine is started; see docs/decisions.md for the three measured side by
side. The KV cache is allocated once and is unaffected. `PDSERVE_MALLOC_TUNING=0` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

ENV_VAR = "PDSERVE_MALLOC_TUNING"
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Apply the tuning to this process; False when it is switched off or the C library is not glibc."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False  # no mallopt (musl, macOS): that allocator's defaults stand
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))
    log.debug("host allocator: large blocks from the heap, never trimmed (%s)", "applied" if applied else "refused")
    return applied
