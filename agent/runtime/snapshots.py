"""A container's filesystem changes as one OCI layer: its overlay upper dir written as a tar
stream in layer form (overlay whiteouts and opaque dirs turned into OCI `.wh.` entries),
hashed as it goes, for `POST /v1/containers/{id}/snapshot`.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile
from collections.abc import AsyncGenerator, Generator, Iterator
from pathlib import Path

import trio

from agent.runtime.layers import (
    BLOCK_BYTES,
    CHUNK_BYTES,
    DIR_FLAGS,
    OPAQUE,
    WHITEOUT,
    LayerError,
    allowed_xattr,
    is_whiteout,
)
from agent.store.objects import ObjectStore
from wire.errors import ErrorCode


class _Unrepresentable(Exception):
    pass


def _header(
    name: str, st: os.stat_result, kind: bytes, *, size: int = 0, link: str = ""
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = stat.S_IMODE(st.st_mode)
    info.uid = st.st_uid
    info.gid = st.st_gid
    # Whole seconds, as Docker writes layers: a fraction costs a pax header per entry.
    info.mtime = st.st_mtime_ns // 1_000_000_000
    info.size = size
    info.linkname = link
    info.uname = info.gname = ""
    return info


def _encode(info: tarfile.TarInfo, xattrs: dict[str, bytes] | None = None) -> bytes:
    if xattrs:
        info.pax_headers = {
            f"SCHILY.xattr.{key}": value.decode("utf-8", "surrogateescape")
            for key, value in xattrs.items()
        }
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _read_xattrs(fd: int) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    try:
        names = os.listxattr(fd)
    except OSError:
        return found
    for key in names:
        if allowed_xattr(key):
            with contextlib.suppress(OSError):
                found[key] = os.getxattr(fd, key)
    return found


def _overlay_xattr(fd: int, key: str) -> bytes | None:
    try:
        return os.getxattr(fd, f"trusted.overlay.{key}")
    except OSError:
        return None


def _upper_tar(upper: Path) -> Generator[bytes, None, None]:
    """The OCI layer tar of an overlay upper dir, as a stream of byte strings."""
    root_fd = os.open(upper, DIR_FLAGS)
    try:
        yield from _tar_directory(root_fd, "", {})
        yield b"\0" * (2 * BLOCK_BYTES)
    finally:
        os.close(root_fd)


def _tar_directory(dir_fd: int, prefix: str, links: dict[tuple[int, int], str]) -> Iterator[bytes]:
    with os.scandir(dir_fd) as scan:
        names = sorted(entry.name for entry in scan)
    for name in names:
        path = prefix + name
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if is_whiteout(st):
            yield _encode(_header(prefix + WHITEOUT + name, st, tarfile.REGTYPE))
        elif stat.S_ISDIR(st.st_mode):
            fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
            try:
                if _overlay_xattr(fd, "redirect") is not None:
                    raise _Unrepresentable(f"directory {path} was renamed inside overlayfs")
                yield _encode(_header(path, st, tarfile.DIRTYPE), _read_xattrs(fd))
                if _overlay_xattr(fd, "opaque") == b"y":
                    yield _encode(_header(f"{path}/{OPAQUE}", st, tarfile.REGTYPE))
                yield from _tar_directory(fd, path + "/", links)
            finally:
                os.close(fd)
        elif stat.S_ISLNK(st.st_mode):
            target = os.readlink(name, dir_fd=dir_fd)
            yield _encode(_header(path, st, tarfile.SYMTYPE, link=target))
        elif stat.S_ISREG(st.st_mode):
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and key in links:
                yield _encode(_header(path, st, tarfile.LNKTYPE, link=links[key]))
                continue
            if st.st_nlink > 1:
                links[key] = path
            yield from _tar_file(dir_fd, name, path, st)


def _tar_file(dir_fd: int, name: str, path: str, st: os.stat_result) -> Iterator[bytes]:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if _overlay_xattr(fd, "metacopy") is not None:
            raise _Unrepresentable(f"file {path} has its data in a lower layer (metacopy)")
        size = st.st_size
        yield _encode(_header(path, st, tarfile.REGTYPE, size=size), _read_xattrs(fd))
        left = size
        while left > 0:
            chunk = os.read(fd, min(left, CHUNK_BYTES))
            if not chunk:
                # The file shrank while we read it; the header already promised `size` bytes.
                chunk = b"\0" * min(left, CHUNK_BYTES)
            left -= len(chunk)
            yield chunk
        padding = -size % BLOCK_BYTES
        if padding:
            yield b"\0" * padding
    finally:
        os.close(fd)


def _next_batch(stream: Iterator[bytes]) -> bytes:
    parts: list[bytes] = []
    held = 0
    for part in stream:
        parts.append(part)
        held += len(part)
        if held >= CHUNK_BYTES:
            break
    return b"".join(parts)


async def _in_thread_chunks(upper: Path) -> AsyncGenerator[bytes, None]:
    stream = _upper_tar(upper)
    try:
        while True:
            try:
                batch = await trio.to_thread.run_sync(_next_batch, stream)
            except _Unrepresentable as exc:
                raise LayerError(
                    ErrorCode.FAILED_PRECONDITION,
                    f"the filesystem changes in {upper} cannot be written as an image layer: "
                    f"{exc}; this agent mounts overlays with redirect_dir and metacopy off",
                ) from None
            except OSError as exc:
                raise LayerError(
                    ErrorCode.INTERNAL, f"reading the filesystem changes in {upper} failed: {exc}"
                ) from None
            if not batch:
                return
            yield batch
    finally:
        stream.close()


async def write_layer(upper: Path, store: ObjectStore) -> tuple[str, int, str]:
    """Write an overlay upper dir into `store` as an uncompressed OCI layer.

    Returns (digest, size, diff_id); the layer is uncompressed, so digest == diff_id.
    Overlay whiteouts become `.wh.NAME` and opaque dirs `.wh..wh..opq`. The container
    should be paused or stopped: a file changing while it is read is stored torn.
    """
    chunks = _in_thread_chunks(upper)
    async with contextlib.aclosing(chunks):
        stored = await store.ingest(chunks)
    return stored.digest, stored.size, stored.digest
