"""The one adapter around mount(2), umount2(2) and /proc/self/mountinfo.

The rootfs's overlays (`agent.runtime.rootfs`) and the buckets' FUSE mounts
(`agent.volumes.supervisor`) both go through it: libc is loaded once, a failed call is an
`OSError` with its errno and the path, and mountinfo is parsed (with its octal escapes) in one
place. What a failure means to a container or a bucket is for those callers to say.
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

MS_BIND = 4096
MS_PRIVATE = 1 << 18
MS_SHARED = 1 << 20
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8

_ESCAPE = re.compile(r"\\([0-7]{3})")
_MAX_STACKED = 64


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


class Mounts:
    """mount(2) and umount2(2) through libc. Every method blocks (a mount can take a while on
    a busy disk or a slow FUSE server): call it in a thread."""

    def __init__(self) -> None:
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
        self._libc = libc

    def mount(
        self,
        source: str | Path | None,
        target: Path,
        *,
        fs_type: str | None = None,
        flags: int = 0,
        data: str | None = None,
    ) -> None:
        """mount(2); OSError naming `target` on failure."""
        result = self._libc.mount(
            os.fsencode(source) if source is not None else None,
            os.fsencode(target),
            fs_type.encode() if fs_type is not None else None,
            flags,
            os.fsencode(data) if data is not None else None,
        )
        if result != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), str(target))

    def bind(self, source: Path, target: Path) -> None:
        self.mount(source, target, flags=MS_BIND)

    def make_shared_mount(self, path: Path) -> None:
        """Bind `path` onto itself and give it a peer group of its own."""
        self.mount(path, path, flags=MS_BIND)
        self.mount(None, path, flags=MS_PRIVATE)
        self.mount(None, path, flags=MS_SHARED)

    def unmount(self, path: Path, *, lazy: bool = False, nofollow: bool = False) -> bool:
        """True if something was unmounted, False if nothing is mounted at `path` (or it is
        not there); OSError otherwise (EBUSY: still in use, try `lazy`)."""
        flags = (MNT_DETACH if lazy else 0) | (UMOUNT_NOFOLLOW if nofollow else 0)
        if self._libc.umount2(os.fsencode(path), flags) == 0:
            return True
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOENT):
            return False
        raise OSError(code, os.strerror(code), str(path))

    def unmount_all(self, path: Path) -> int:
        """Detach every mount stacked at `path` (a detach takes the stack above with it)."""
        count = 0
        for _ in range(_MAX_STACKED):
            if not self.unmount(path, lazy=True):
                break
            count += 1
        return count


@functools.cache
def host_mounts() -> Mounts:
    """The process's one `Mounts` (libc is loaded once)."""
    return Mounts()


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


def read_mountinfo() -> list[MountEntry]:
    """This process's mounts (blocking: a read of /proc)."""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as file:
        return parse_mountinfo(file.read())


def is_mounted(entries: Sequence[MountEntry], path: Path) -> bool:
    return any(entry.mount_point == path for entry in entries)
