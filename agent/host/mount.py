"""The one adapter around mount(2), umount2(2) and /proc/self/mountinfo.

The rootfs's overlays and the buckets' FUSE mounts both go through it: libc is loaded once,
errno becomes OSError, and mountinfo is parsed (with its octal escapes) in one place.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
from collections.abc import Sequence
from pathlib import Path

import attrs

# /proc/self/mountinfo is read the same way for rootfs overlays and for bucket mounts.
from agent.wire.errors import ApiError, ErrorCode


def is_mounted(entries: Sequence[MountEntry], path: Path) -> bool:
    return any(entry.mount_point == path for entry in entries)


_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MS_SHARED = 1 << 20
_MNT_DETACH = 2


class _Kernel:
    """mount(2) and umount2(2) through libc; errors are OSError naming the path."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.mount.argtypes = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_ulong,
            ctypes.c_void_p,
        ]
        self._libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

    def _mount(self, source: Path | None, target: Path, flags: int) -> None:
        source_bytes = os.fsencode(source) if source is not None else None
        if self._libc.mount(source_bytes, os.fsencode(target), None, flags, None) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), str(target))

    def bind(self, source: Path, target: Path) -> None:
        self._mount(source, target, _MS_BIND)

    def make_shared_mount(self, path: Path) -> None:
        """Bind `path` onto itself and give it a peer group of its own."""
        self._mount(path, path, _MS_BIND)
        self._mount(None, path, _MS_PRIVATE)
        self._mount(None, path, _MS_SHARED)

    def unmount(self, path: Path, *, lazy: bool) -> bool:
        """True if something was unmounted, False if nothing is mounted at `path`."""
        if self._libc.umount2(os.fsencode(path), _MNT_DETACH if lazy else 0) == 0:
            return True
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOENT):
            return False
        raise OSError(code, os.strerror(code), str(path))

    def unmount_all(self, path: Path) -> int:
        """Detach every mount stacked at `path` (a detach takes the stack above with it)."""
        count = 0
        for _ in range(64):
            if not self.unmount(path, lazy=True):
                break
            count += 1
        return count


def _read_mountinfo() -> list[MountEntry]:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as file:
        return parse_mountinfo(file.read())


_MNT_DETACH = 2
_UMOUNT_NOFOLLOW = 8
_ESCAPE = re.compile(r"\\([0-7]{3})")


class RootfsError(ApiError):
    """A container's root filesystem could not be mounted or unmounted."""


@attrs.frozen
class MountEntry:
    """One line of /proc/self/mountinfo (the parts we use)."""

    mount_id: int
    parent_id: int
    mount_point: Path
    fs_type: str
    source: str
    options: str
    """Super block options: for an overlay, its lowerdir, upperdir and workdir."""
    shared: bool = False
    """In a shared peer group (mounts below it propagate to its peers and slaves)."""


@functools.cache
def _load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_char_p,
    ]
    libc.mount.restype = ctypes.c_int
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.umount2.restype = ctypes.c_int
    return libc


def unmount(target: Path) -> None:
    """Unmount `target`; detach it lazily when it is busy. No error when nothing is mounted."""
    libc = _load_libc()
    path = os.fsencode(target)
    if libc.umount2(path, _UMOUNT_NOFOLLOW) == 0:
        return
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOENT):
        return  # not a mount point, or not there at all
    if code == errno.EBUSY:
        # A process still has a file or its cwd in there: detach now, the kernel frees the
        # mount when the last user lets go.
        if libc.umount2(path, _MNT_DETACH | _UMOUNT_NOFOLLOW) == 0:
            return
        code = ctypes.get_errno()
    raise RootfsError(
        ErrorCode.INTERNAL,
        f"unmounting {target} failed: {os.strerror(code)} ({errno.errorcode.get(code, code)})",
    )


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountEntry]:
    """The entries of a /proc/PID/mountinfo text, in the kernel's order."""
    entries: list[MountEntry] = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            separator = fields.index("-", 6)
            entries.append(
                MountEntry(
                    mount_id=int(fields[0]),
                    parent_id=int(fields[1]),
                    mount_point=Path(_unescape(fields[4])),
                    fs_type=fields[separator + 1],
                    source=_unescape(fields[separator + 2]),
                    options=_unescape(fields[separator + 3]),
                    shared=any(tag.startswith("shared:") for tag in fields[6:separator]),
                )
            )
        except (ValueError, IndexError):
            continue  # not a mountinfo line
    return entries
