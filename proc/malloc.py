"""glibc's malloc set for a process that moves bulk bytes; both programs call `tune_malloc`.

Each MiB a tunnel or CONNECT stream carries passes through a few short-lived buffers of up to
a frame's size: h2's receive buffer grows and its frames are copied out of it, TLS records are
joined, a reader's pieces are cut. glibc hands a freed block above its mmap threshold back to
the kernel, and trims the top of its heap once more than its trim threshold is free; both
thresholds move with the sizes it sees. With some orders of allocation and free each new
buffer then comes from fresh pages, faulted in one by one as it is written. Measured here on
1 MiB DATA frames received in 64 KiB pieces: 249 page faults and 532 us of CPU per frame with
the moving thresholds, 0 faults and 204 us with fixed ones (which run saw faults, 20 or 259
per MiB, changed with where the first buffers landed). Fixed thresholds keep freed memory for
the next buffer. The price: up to `TRIM_THRESHOLD_BYTES` of free heap stays mapped after a
burst, and only blocks of `MMAP_THRESHOLD_BYTES` and more are mapped apart (and given back at
once).

A threshold the operator sets (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_` or in
`GLIBC_TUNABLES`) is left as set.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
"""Above the largest HTTP/2 frame (16 MiB) and what a read or write moves at once."""
TRIM_THRESHOLD_BYTES = 64 * 1024 * 1024

_SETTINGS = (
    # (mallopt's parameter number, from glibc's malloc.h; its environment variable; its tunable)
    (-3, MMAP_THRESHOLD_BYTES, "MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"),
    (-1, TRIM_THRESHOLD_BYTES, "MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold"),
)


def is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):
        return False


def operator_set(environ: Mapping[str, str], variable: str, tunable: str) -> bool:
    """Whether the environment already sets this threshold."""
    return variable in environ or tunable in environ.get("GLIBC_TUNABLES", "")


def tune_malloc() -> list[str]:
    """Fix the two thresholds (those the environment does not set); the variables set, none
    where the C library is not glibc (musl, macOS)."""
    if not is_glibc():
        return []
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    done = []
    for parameter, value, variable, tunable in _SETTINGS:
        # mallopt returns 1 on success, 0 for a value it refuses.
        if not operator_set(os.environ, variable, tunable) and mallopt(parameter, value) == 1:
            done.append(variable)
    return done
