"""The one adapter around Linux inotify(7): which watched directories saw a change, read from
one non-blocking descriptor that trio waits on, so a follower of a file learns that it grew
without reading it again and again.

libc is loaded once; a failed call is an `OSError` with its errno and the path. What a change
means (a container's log grew) is for the caller to say.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import attrs

IN_MODIFY = 0x002
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
"""The kernel dropped the watch (its directory was removed, or `remove` was called)."""
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
_READ_BYTES = 64 * 1024


@attrs.frozen
class Change:
    """One event: the watch it came from, what happened, and the entry's name ("" for the
    directory itself). `overflowed` events (wd -1) mean some events were lost."""

    wd: int
    mask: int
    name: str

    @property
    def overflowed(self) -> bool:
        return bool(self.mask & IN_Q_OVERFLOW)


def parse_events(data: bytes) -> Iterator[Change]:
    """The events in one read(2) of an inotify descriptor."""
    offset = 0
    while offset + _EVENT.size <= len(data):
        wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
        offset += _EVENT.size
        raw = data[offset : offset + length]
        offset += length
        yield Change(wd, mask, raw.split(b"\0", 1)[0].decode("utf-8", "replace"))


class Inotify:
    """One inotify instance (one descriptor, close-on-exec and non-blocking). A node allows
    few instances per user (128 by default, shared with the kubelet and the runtime), so a
    program keeps one and adds a watch per directory to it."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_init1.restype = ctypes.c_int
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_add_watch.restype = ctypes.c_int
        libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.inotify_rm_watch.restype = ctypes.c_int
        self._libc = libc
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"inotify_init1: {os.strerror(code)}")
        self._fd: int = int(fd)

    def fileno(self) -> int:
        return self._fd

    def add(self, directory: Path, mask: int) -> int:
        """Watch `directory` for `mask`; its watch descriptor (the same for the same inode)."""
        wd: int = int(self._libc.inotify_add_watch(self._fd, os.fsencode(directory), mask))
        if wd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"inotify_add_watch {directory}: {os.strerror(code)}")
        return wd

    def remove(self, wd: int) -> None:
        """Stop a watch; one the kernel already dropped (EINVAL) is not an error."""
        if self._libc.inotify_rm_watch(self._fd, wd) < 0:
            code = ctypes.get_errno()
            if code != errno.EINVAL:
                raise OSError(code, f"inotify_rm_watch {wd}: {os.strerror(code)}")

    def read(self) -> list[Change]:
        """The events waiting now; [] when there are none (never blocks)."""
        changes: list[Change] = []
        while True:
            try:
                data = os.read(self._fd, _READ_BYTES)
            except BlockingIOError:
                return changes
            changes += parse_events(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
