"""glibc's allocator set up for moving bytes: large buffers from the heap, and kept there.

Both programs move bytes in buffers of up to a few MiB (1 MiB socket reads, HTTP/2 DATA
frames of up to 1 MiB, TLS and WebSocket pieces), thousands of them a second. By default glibc
serves a block above its mmap threshold (128 KiB at first, raised only once such a block is
freed) with a fresh mapping it unmaps on free, and gives the heap's free top back to the
kernel above 128 KiB: either way the next buffer is faulted in page by page again. On the
HTTP/2 receive path alone (1 MiB DATA frames arriving in 256 KiB reads) that measured 340 page
faults per MiB and 2,330 MB/s, against no faults and 4,680 MB/s with the thresholds below; a
tunnel upload measured 600-650 MB/s before and 780 after.

`tune_malloc` raises both thresholds once, at a program's start: blocks up to 8 MiB come from
the heap, and up to 64 MiB of free heap is kept for reuse instead of being returned. An
operator's own `MALLOC_*` or `GLIBC_TUNABLES` settings win: nothing is changed then.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 8 << 20
TRIM_THRESHOLD_BYTES = 64 << 20
_OPERATOR_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def tune_malloc(environ: Mapping[str, str] = os.environ) -> bool:
    """Set this process's thresholds; False where the operator set their own, or the C library
    has no `mallopt` (it is not glibc)."""
    if any(name in environ for name in _OPERATOR_SETTINGS):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt answers 1 on success, 0 on a refused value.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
