"""Container root filesystems: overlay mounts of cached layers, and finding them after a crash.

A container's rootfs is an overlay: the image's unpacked layers (shared, read-only) as lower
dirs, topmost first, and an upper and work dir of its own on the same filesystem. Container
start is benchmarked against bare runc, so `mount(2)` and `umount2(2)` are called through
ctypes rather than by starting `mount`/`umount` processes (a fork and exec each).

Options are chosen so that a snapshot of the upper dir is a faithful image layer and so that
mounts never collide: `index=off` (with the index on, a second mount of an upper dir still in
use, as after a crash, fails with EBUSY; lower layers are shared by design), `redirect_dir=off`
(a renamed directory is copied up whole instead of recorded as a redirect that an OCI layer
cannot express) and `metacopy=off` (every copied-up file has its data in the upper dir).

Which mounts are ours is read back from /proc/self/mountinfo, which the kernel keeps even when
the agent's own records are lost. The syscalls and the mountinfo parser are `agent.host.mount`'s;
this module says what a failure means for a container's root filesystem.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Sequence
from pathlib import Path

from agent.host.mount import MountEntry, host_mounts, read_mountinfo
from wire.errors import ApiError, ErrorCode

# overlayfs refuses more lower layers than this (OVL_MAX_STACK).
MAX_LAYERS = 500
# mount(2) copies its options string from user space as one page.
OPTIONS_LIMIT_BYTES = os.sysconf("SC_PAGE_SIZE")
OVERLAY_OPTIONS = "index=off,redirect_dir=off,metacopy=off"
MOUNT_SOURCE = "levers9"
# Characters that overlayfs's option parser treats as separators or escapes.
_UNSAFE_IN_PATH = re.compile(r"[,:\\\s]")


class RootfsError(ApiError):
    """A container's root filesystem could not be mounted or unmounted."""


def _failure(exc: OSError) -> str:
    return f"{os.strerror(exc.errno or 0)} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"


def overlay_options(lowers: Sequence[Path], upper: Path, work: Path, *, image: str | None) -> str:
    """The overlay mount options string, or RootfsError when the kernel would refuse it."""
    what = f"image {image}" if image else "the image"
    if not lowers:
        raise RootfsError(
            ErrorCode.INVALID_ARGUMENT, f"{what} has no layers to mount", field="image"
        )
    for path in (*lowers, upper, work):
        if _UNSAFE_IN_PATH.search(str(path)):
            raise RootfsError(
                ErrorCode.INTERNAL,
                f"path {str(path)!r} has a comma, colon, backslash or space, which overlay "
                "mount options cannot carry; use a state directory without them",
            )
    options = (
        f"lowerdir={':'.join(str(p) for p in lowers)},upperdir={upper},workdir={work},"
        f"{OVERLAY_OPTIONS}"
    )
    size = len(os.fsencode(options)) + 1
    if len(lowers) > MAX_LAYERS or size > OPTIONS_LIMIT_BYTES:
        raise RootfsError(
            ErrorCode.INVALID_ARGUMENT,
            f"{what} has {len(lowers)} layers, too many for one overlay mount (the kernel takes "
            f"at most {MAX_LAYERS} layers and {OPTIONS_LIMIT_BYTES} bytes of options; these "
            f"need {size}); rebuild the image with fewer layers",
            field="image",
        )
    return options


def mount_overlay(
    lowers: Sequence[Path],
    upper: Path,
    work: Path,
    target: Path,
    *,
    image: str | None = None,
) -> None:
    """Mount an overlay of `lowers` (topmost first) with `upper` and `work` at `target`.

    `image` names the image in errors. Blocking (a syscall that can take a while on a busy
    disk): run it in a thread.
    """
    options = overlay_options(lowers, upper, work, image=image)
    try:
        host_mounts().mount(MOUNT_SOURCE, target, fs_type="overlay", data=options)
    except OSError as exc:
        raise RootfsError(
            ErrorCode.INTERNAL,
            f"mounting the overlay rootfs at {target} failed: {_failure(exc)}; its upper dir "
            f"is {upper}",
        ) from None


def unmount(target: Path) -> None:
    """Unmount `target`; detach it lazily when it is busy. No error when nothing is mounted."""
    mounts = host_mounts()
    try:
        try:
            mounts.unmount(target, nofollow=True)
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            # A process still has a file or its cwd in there: detach now, the kernel frees
            # the mount when the last user lets go.
            mounts.unmount(target, lazy=True, nofollow=True)
    except OSError as exc:
        raise RootfsError(
            ErrorCode.INTERNAL, f"unmounting {target} failed: {_failure(exc)}"
        ) from None


def overlays_under(entries: Sequence[MountEntry], root: Path) -> list[Path]:
    """Mount points of the overlays at or below `root`, newest first.

    Newest first so that unmounting in this order takes stacked and nested mounts off the
    top. A mount point stacked twice appears twice.
    """
    return [
        entry.mount_point
        for entry in reversed(entries)
        if entry.fs_type == "overlay"
        and (entry.mount_point == root or root in entry.mount_point.parents)
    ]


def overlay_mounts_under(root: Path) -> list[Path]:
    """Overlay mounts at or below `root` in this mount namespace, newest first."""
    # The kernel reports mount points with symlinks resolved.
    return overlays_under(read_mountinfo(), Path(os.path.realpath(root)))
