"""Image layers on disk: safe unpacking, the shared layer cache, and snapshot layers.

An image layer is a tar (often gzip-compressed) in the object store. Containers need it as a
directory that overlayfs can stack, so each layer is unpacked once per digest into
`<root>/layers/<first 16 hex>/fs` and shared by every container that uses it. The path is short
on purpose: overlay's mount options (every lower dir, joined) must fit in one page.

Unpacking is one streaming pass over the blob: the compressed bytes are hashed (they must equal
the blob's digest), the tar bytes are hashed (the diff_id) and each member is written as it
comes. The tar is treated as hostile. We do not use `tarfile.extractall`: its safe filter drops
ownership, which images need. Instead every path is opened one component at a time from a
directory file descriptor with `O_NOFOLLOW`, so nothing is ever written through a symlink or
outside the layer root; absolute names, `..`, hard links that leave the layer, and device nodes
or fifos fail the whole layer, and the partial directory is removed. OCI whiteouts become
overlay's own form on the way in (`.wh.NAME` -> character device 0/0, `.wh..wh..opq` ->
`trusted.overlay.opaque=y`) and go back the other way in `write_layer`, which turns a
container's overlay upper dir into an OCI layer for a filesystem snapshot.

A layer is unpacked into a temporary directory beside the cache and renamed into place, so a
reader never sees half a layer. Two agents on one node may share the cache: the loser of the
rename throws its copy away. In one process, `LayerCache.ensure` is single-flight per digest.
Blocking work runs in `trio.to_thread.run_sync`; the synchronous functions here are the parts
that run there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import tarfile
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Protocol, cast

import attrs
import trio

from agent.store.objects import ObjectStore
from wire.errors import ApiError, ErrorCode

MEDIA_TYPE_TAR = "application/vnd.oci.image.layer.v1.tar"
MEDIA_TYPE_TAR_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_TYPE_DOCKER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
_UNCOMPRESSED = frozenset(
    {
        MEDIA_TYPE_TAR,
        "application/vnd.oci.image.layer.nondistributable.v1.tar",
    }
)
_GZIP = frozenset(
    {
        MEDIA_TYPE_TAR_GZIP,
        MEDIA_TYPE_DOCKER_GZIP,
        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
    }
)
_ZSTD = frozenset(
    {
        "application/vnd.oci.image.layer.v1.tar+zstd",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    }
)
_DIGEST = re.compile(r"^(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})$")
_ID_HEX = 16
_META = "layer.json"
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
CHUNK_BYTES = 1 << 20
BLOCK_BYTES = tarfile.BLOCKSIZE
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
_OPAQUE_XATTR = "trusted.overlay.opaque"
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_CACHE_SIZE = 64


class LayerError(ApiError):
    """A layer could not be unpacked, found or written."""


class LayerCorrupt(LayerError):
    """The blob's bytes do not match its digest; the blob was (or must be) discarded.

    Retryable: pulling the image again fetches a fresh copy.
    """

    def __init__(self, digest: str, actual: str) -> None:
        super().__init__(
            ErrorCode.UNAVAILABLE,
            f"layer {digest} in the object store is corrupt (its bytes hash to {actual}); "
            "the blob was discarded, pull the image again",
            field="image",
        )
        self.digest = digest


class UnsafeLayer(LayerError):
    """The layer tries to write outside its root, or holds something we refuse to create."""

    def __init__(self, digest: str, member: str, reason: str) -> None:
        super().__init__(
            ErrorCode.INVALID_ARGUMENT,
            f"layer {digest} is refused: member {member!r} {reason}; rebuild the image without it",
            field="image",
        )
        self.digest = digest
        self.member = member


@attrs.frozen
class UnpackedLayer:
    digest: str
    diff_id: str
    path: Path
    """The layer's filesystem: a directory overlayfs can use as a lower dir."""


@attrs.frozen
class LayerCacheStatistics:
    layers: int
    disk_bytes: int
    """Allocated bytes of every cached layer, each hard-linked inode counted once."""


class _Hasher(Protocol):
    @property
    def name(self) -> str: ...

    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


def _hasher_for(digest: str, field: str) -> _Hasher:
    if not _DIGEST.match(digest):
        raise LayerError(
            ErrorCode.INVALID_ARGUMENT,
            f"{field} {digest!r} is not a digest; expected 'sha256:' and 64 lowercase hex digits",
            field=field,
        )
    return hashlib.new(digest.partition(":")[0])


def _digest_of(hasher: _Hasher) -> str:
    return f"{hasher.name}:{hasher.hexdigest()}"


def _compression_of(media_type: str, digest: str) -> str:
    if media_type in _UNCOMPRESSED:
        return "none"
    if media_type in _GZIP:
        return "gzip"
    if media_type in _ZSTD:
        raise LayerError(
            ErrorCode.UNIMPLEMENTED,
            f"layer {digest} is zstd-compressed ({media_type}); this agent unpacks "
            "uncompressed and gzip layers only, push the image with gzip layers",
            field="image",
        )
    raise LayerError(
        ErrorCode.UNIMPLEMENTED,
        f"layer {digest} has media type {media_type!r}, which is not an image layer this "
        f"agent can unpack (expected {MEDIA_TYPE_TAR}, {MEDIA_TYPE_TAR_GZIP} or "
        f"{MEDIA_TYPE_DOCKER_GZIP})",
        field="image",
    )


class _LayerReader:
    """The tar bytes of a layer blob, hashing the blob's bytes and the tar's bytes as they go.

    `tarfile` reads it like a file. gzip is decoded with zlib directly (not `gzip.GzipFile`)
    so we read in large chunks, accept multi-member streams and zero padding after the last
    member, and hand out at most `CHUNK_BYTES` decompressed bytes at a time (a gzip bomb costs
    disk, never memory).
    """

    def __init__(
        self, blob: IO[bytes], compression: str, blob_hasher: _Hasher, tar_hasher: _Hasher | None
    ) -> None:
        self._blob = blob
        self._gzip = compression == "gzip"
        self.blob_hasher = blob_hasher
        self.tar_hasher = tar_hasher
        self._inflater: zlib._Decompress | None = None
        self._members = 0
        self._input = b""
        self._output = memoryview(b"")

    def _read_blob(self) -> bytes:
        data = self._blob.read(CHUNK_BYTES)
        self.blob_hasher.update(data)
        return data

    def _inflate(self) -> bytes:
        while True:
            if self._inflater is None:
                if not self._input:
                    self._input = self._read_blob()
                    if not self._input:
                        if self._members == 0:
                            raise LayerError(ErrorCode.INTERNAL, "the gzip stream is empty")
                        return b""
                if self._members:
                    # Some writers pad a gzip stream with zeros after its last member.
                    self._input = self._input.lstrip(b"\0")
                    if not self._input:
                        continue
                self._inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            out = self._inflater.decompress(self._input, CHUNK_BYTES)
            self._input = self._inflater.unconsumed_tail
            if self._inflater.eof:
                self._input = self._inflater.unused_data
                self._inflater = None
                self._members += 1
            elif not out and not self._input:
                self._input = self._read_blob()
                if not self._input:
                    raise LayerError(ErrorCode.INTERNAL, "the gzip stream ends early")
            if out:
                return out

    def read(self, size: int = -1) -> bytes:
        if not self._output:
            data = self._inflate() if self._gzip else self._read_blob()
            if not data:
                return b""
            if self.tar_hasher is not None:
                self.tar_hasher.update(data)
            self._output = memoryview(data)
        if size < 0 or size >= len(self._output):
            out, self._output = self._output, memoryview(b"")
        else:
            out, self._output = self._output[:size], self._output[size:]
        return bytes(out)

    def finish(self) -> None:
        """Read what the tar left over (its end blocks and padding), so both digests are whole."""
        while self.read(CHUNK_BYTES):
            pass
        self.finish_blob()

    def finish_blob(self) -> None:
        """Hash the rest of the blob, without decoding it (the decoder may be the thing broken)."""
        while self._read_blob():
            pass


def _split(name: str) -> list[str] | None:
    """The path components of a member name, or None when it is absolute or has `..`."""
    if name.startswith("/"):
        return None
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        return None
    return parts


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def allowed_xattr(key: str) -> bool:
    # trusted.* would let a layer steer overlayfs (redirects, opaque dirs of its own making);
    # the rest of security.* belongs to the host's policy, not to an image.
    return (
        key.startswith("user.")
        or key == "security.capability"
        or key.startswith("system.posix_acl_")
    )


def _xattrs_of(member: tarfile.TarInfo) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    for key, value in member.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            name = key.removeprefix("SCHILY.xattr.")
            if allowed_xattr(name):
                found[name] = value.encode("utf-8", "surrogateescape")
    return found


def _mtime_ns(member: tarfile.TarInfo) -> int:
    return int(member.mtime * 1_000_000_000)


class _Extractor:
    """Writes tar members under one root directory, refusing anything that would escape it."""

    def __init__(self, root_fd: int, digest: str) -> None:
        self._root_fd = root_fd
        self._digest = digest
        # Parent directories by path: tar members come grouped by directory, so this saves
        # walking every path from the root. Entries are dropped whenever a directory is removed.
        self._dirs: OrderedDict[tuple[str, ...], int] = OrderedDict()
        self._dir_times: list[tuple[tuple[str, ...], int]] = []
        self._member = ""

    def close(self) -> None:
        self._forget_dirs()

    def _forget_dirs(self) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()

    def _unsafe(self, reason: str) -> UnsafeLayer:
        return UnsafeLayer(self._digest, self._member, reason)

    def _invalid(self, reason: str) -> LayerError:
        return LayerError(
            ErrorCode.INVALID_ARGUMENT,
            f"layer {self._digest}: member {self._member!r} {reason}; the image is broken",
            field="image",
        )

    def _open_dir(self, parent_fd: int, name: str, path: tuple[str, ...], create: bool) -> int:
        try:
            return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            if not create:
                raise self._invalid(
                    f"refers to {'/'.join(path)}, which is not in the layer"
                ) from None
            return self._make_dir(parent_fd, name)
        except NotADirectoryError:
            st = _lstat(name, parent_fd)
            if st is not None and stat.S_ISLNK(st.st_mode):
                raise self._unsafe(f"goes through the symlink {'/'.join(path)}") from None
            if st is None or not is_whiteout(st) or not create:
                raise self._invalid(
                    f"goes through {'/'.join(path)}, which is not a directory"
                ) from None
            # A directory in place of a whiteout: it hides the lower layers' directory.
            os.unlink(name, dir_fd=parent_fd)
            fd = self._make_dir(parent_fd, name)
            os.setxattr(fd, _OPAQUE_XATTR, b"y")
            return fd

    @staticmethod
    def _make_dir(parent_fd: int, name: str) -> int:
        """A directory the tar implies but does not list: root's, 0755, as Docker makes them."""
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        os.fchmod(fd, 0o755)  # not left to the umask
        return fd

    def _parent(self, parts: list[str], *, create: bool = True) -> int:
        """A descriptor of the directory holding `parts[-1]` (owned by the cache; do not close)."""
        key = tuple(parts[:-1])
        fd = self._dirs.get(key)
        if fd is not None:
            self._dirs.move_to_end(key)
            return fd
        if not key:
            return self._root_fd
        fd = self._root_fd
        for depth, name in enumerate(key):
            try:
                child = self._open_dir(fd, name, key[: depth + 1], create)
            finally:
                if fd != self._root_fd:
                    os.close(fd)
            fd = child
        self._dirs[key] = fd
        if len(self._dirs) > _DIR_CACHE_SIZE:
            _, oldest = self._dirs.popitem(last=False)
            os.close(oldest)
        return fd

    @staticmethod
    def _proc_path(dir_fd: int, name: str) -> str:
        # For calls with no dir_fd form (setxattr on a symlink); the directory is ours already.
        return f"/proc/self/fd/{dir_fd}/{name}"

    def _remove(self, parent_fd: int, parts: list[str], st: os.stat_result) -> None:
        if stat.S_ISDIR(st.st_mode):
            # Descriptors of directories inside it would name paths that no longer exist.
            inside = tuple(parts)
            for key in [key for key in self._dirs if key[: len(inside)] == inside]:
                os.close(self._dirs.pop(key))
            shutil.rmtree(parts[-1], dir_fd=parent_fd)
        else:
            os.unlink(parts[-1], dir_fd=parent_fd)

    def _set_attributes(self, fd: int, member: tarfile.TarInfo) -> None:
        os.fchown(fd, member.uid, member.gid)
        # After chown, which clears setuid and setgid.
        os.fchmod(fd, member.mode & 0o7777)
        for key, value in _xattrs_of(member).items():
            try:
                os.setxattr(fd, key, value)
            except OSError as exc:
                if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise

    def add(self, member: tarfile.TarInfo, tar: tarfile.TarFile) -> None:
        self._member = member.name
        parts = _split(member.name)
        if parts is None:
            raise self._unsafe("has an absolute path or '..'")
        if not parts:
            if member.isdir():
                self._set_attributes(self._root_fd, member)
                self._dir_times.append(((), _mtime_ns(member)))
            return
        name = parts[-1]
        if name.startswith(WHITEOUT):
            self._whiteout(parts)
            return
        if member.ischr() or member.isblk() or member.isfifo():
            raise self._unsafe("is a device node or fifo, which images may not create")
        if not (member.isdir() or member.isreg() or member.issym() or member.islnk()):
            raise self._invalid(f"has tar type {member.type!r}, which this agent does not unpack")
        parent = self._parent(parts)
        existing = _lstat(name, parent)
        if member.isdir():
            self._directory(parent, name, parts, existing, member)
            return
        if existing is not None:
            self._remove(parent, parts, existing)
        if member.isreg():
            self._file(parent, name, member, tar)
        elif member.issym():
            os.symlink(member.linkname, name, dir_fd=parent)
            os.chown(name, member.uid, member.gid, dir_fd=parent, follow_symlinks=False)
            for key, value in _xattrs_of(member).items():
                with contextlib.suppress(OSError):
                    os.setxattr(self._proc_path(parent, name), key, value, follow_symlinks=False)
            os.utime(name, ns=(_mtime_ns(member),) * 2, dir_fd=parent, follow_symlinks=False)
        else:
            self._hard_link(parent, name, parts, member)

    def _directory(
        self,
        parent: int,
        name: str,
        parts: list[str],
        existing: os.stat_result | None,
        member: tarfile.TarInfo,
    ) -> None:
        opaque = False
        if existing is not None and not stat.S_ISDIR(existing.st_mode):
            opaque = is_whiteout(existing)
            self._remove(parent, parts, existing)
        if existing is None or not stat.S_ISDIR(existing.st_mode):
            os.mkdir(name, 0o700, dir_fd=parent)
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        try:
            if opaque:
                os.setxattr(fd, _OPAQUE_XATTR, b"y")
            self._set_attributes(fd, member)
        finally:
            os.close(fd)
        # Set last: writing the directory's entries would change its mtime again.
        self._dir_times.append((tuple(parts), _mtime_ns(member)))

    def _file(self, parent: int, name: str, member: tarfile.TarInfo, tar: tarfile.TarFile) -> None:
        fd = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
            dir_fd=parent,
        )  # fmt: skip
        with os.fdopen(fd, "wb", buffering=CHUNK_BYTES) as out:
            source = tar.extractfile(member)
            if source is not None:
                while chunk := source.read(CHUNK_BYTES):
                    out.write(chunk)
            out.flush()
            self._set_attributes(fd, member)
            os.utime(fd, ns=(_mtime_ns(member),) * 2)

    def _hard_link(self, parent: int, name: str, parts: list[str], member: tarfile.TarInfo) -> None:
        target = _split(member.linkname)
        if target is None or not target:
            raise self._unsafe(f"is a hard link to {member.linkname!r}, outside the layer")
        if target == parts:
            raise self._invalid("is a hard link to itself")
        source_parent = self._parent(target, create=False)
        try:
            os.link(
                target[-1],
                name,
                src_dir_fd=source_parent,
                dst_dir_fd=parent,
                follow_symlinks=False,
            )
        except FileNotFoundError:
            raise self._invalid(
                f"is a hard link to {member.linkname!r}, which is not earlier in the layer"
            ) from None
        except (PermissionError, IsADirectoryError):
            raise self._invalid(f"is a hard link to the directory {member.linkname!r}") from None

    def _whiteout(self, parts: list[str]) -> None:
        name = parts[-1]
        parent = self._parent(parts)
        if name == OPAQUE:
            os.setxattr(parent, _OPAQUE_XATTR, b"y")
            return
        hidden = name.removeprefix(WHITEOUT)
        if hidden in ("", ".", "..") or hidden.startswith(WHITEOUT):
            raise self._invalid("is a whiteout of no valid name")
        existing = _lstat(hidden, parent)
        if existing is None:
            os.mknod(hidden, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=parent)
        elif stat.S_ISDIR(existing.st_mode):
            # This layer has the directory too: its entries stay, the lower ones go.
            os.setxattr(self._proc_path(parent, hidden), _OPAQUE_XATTR, b"y", follow_symlinks=False)
        # Anything else this layer wrote under that name already hides the lower one.

    def finish(self) -> None:
        """Set directory times, deepest first, now that nothing more is written into them."""
        self._forget_dirs()
        for parts, mtime_ns in sorted(self._dir_times, key=lambda item: -len(item[0])):
            if not parts:
                os.utime(self._root_fd, ns=(mtime_ns, mtime_ns))
                continue
            try:
                parent = self._parent(list(parts), create=False)
                fd = os.open(parts[-1], DIR_FLAGS, dir_fd=parent)
            except (LayerError, OSError):
                continue  # replaced by a later member
            try:
                os.utime(fd, ns=(mtime_ns, mtime_ns))
            finally:
                os.close(fd)
        self._forget_dirs()


def unpack_layer_file(
    blob: Path,
    media_type: str,
    dest: Path,
    *,
    digest: str,
    diff_id: str | None = None,
) -> str:
    """Unpack the layer blob at `blob` into the new directory `dest`; return its diff_id.

    `digest` is the blob's digest and is verified (LayerCorrupt on mismatch; the caller
    discards the blob). `diff_id`, when given, is verified too. On any failure `dest` is
    removed. Blocking: run it in a thread.
    """
    compression = _compression_of(media_type, digest)
    blob_hasher = _hasher_for(digest, "digest")
    tar_hasher = _hasher_for(diff_id, "diff_id") if diff_id is not None else hashlib.sha256()
    same_bytes = compression == "none" and tar_hasher.name == blob_hasher.name
    try:
        source = blob.open("rb")
    except FileNotFoundError:
        raise LayerError(
            ErrorCode.NOT_FOUND,
            f"layer {digest} is not in the object store; pull the image again",
            field="image",
        ) from None
    with source:
        reader = _LayerReader(source, compression, blob_hasher, None if same_bytes else tar_hasher)
        os.mkdir(dest, 0o700)
        try:
            os.chmod(dest, 0o755)  # the container's "/": not left to the umask
            _extract(reader, dest, digest)
            actual = _digest_of(blob_hasher)
            if actual != digest:
                raise LayerCorrupt(digest, actual)
            actual_diff_id = actual if same_bytes else _digest_of(tar_hasher)
            if diff_id is not None and actual_diff_id != diff_id:
                raise LayerError(
                    ErrorCode.FAILED_PRECONDITION,
                    f"layer {digest} unpacks to diff_id {actual_diff_id}, but the image "
                    f"config says {diff_id}; the image is inconsistent, rebuild or re-push it",
                    field="image",
                )
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
    return actual_diff_id


def _extract(reader: _LayerReader, dest: Path, digest: str) -> None:
    root_fd = os.open(dest, DIR_FLAGS)
    extractor = _Extractor(root_fd, digest)
    try:
        try:
            with tarfile.open(
                fileobj=cast("IO[bytes]", reader),
                mode="r|",
                encoding="utf-8",
                errors="surrogateescape",
            ) as tar:
                for member in tar:
                    extractor.add(member, tar)
            extractor.finish()
            reader.finish()
        except (LayerError, tarfile.TarError, zlib.error, EOFError, OSError) as exc:
            # A damaged blob shows up as a broken tar or gzip first; say corrupt when it is.
            try:
                reader.finish_blob()
            except OSError:
                pass
            else:
                actual = _digest_of(reader.blob_hasher)
                if actual != digest:
                    raise LayerCorrupt(digest, actual) from exc
            raise _translate(exc, digest) from exc
    finally:
        extractor.close()
        os.close(root_fd)


def _translate(exc: BaseException, digest: str) -> BaseException:
    if isinstance(exc, LayerError):
        return exc
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return LayerError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"no space left on the node's disk while unpacking layer {digest}; "
                "free space or use a smaller image",
            )
        return LayerError(ErrorCode.INTERNAL, f"unpacking layer {digest} failed: {exc}")
    return LayerError(
        ErrorCode.INVALID_ARGUMENT,
        f"layer {digest} is not a valid tar archive ({exc}); rebuild the image",
        field="image",
    )


def _flock(fd: int, *, blocking: bool) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


class LayerCache:
    """Unpacked layers under `<root>/layers`, one directory per digest, shared by containers.

    Safe to share between processes: entries appear by an atomic rename and disappear by a
    rename into trash first. A temporary directory is flock-ed by the process filling it, so
    `remove_unused` can tell an abandoned one from one still being written (even across pid
    namespaces).
    """

    def __init__(self, root: Path) -> None:
        self.directory = root / "layers"
        self._inflight: dict[str, trio.Event] = {}

    def path_of(self, digest: str) -> Path:
        """The layer's filesystem directory (whether or not it is unpacked yet)."""
        return self._entry(digest) / "fs"

    def _entry(self, digest: str) -> Path:
        _hasher_for(digest, "digest")
        return self.directory / digest.partition(":")[2][:_ID_HEX]

    async def ensure(
        self,
        store: ObjectStore,
        digest: str,
        media_type: str,
        *,
        diff_id: str | None = None,
    ) -> UnpackedLayer:
        """The unpacked layer, unpacking the blob from `store` first when it is not cached."""
        _compression_of(media_type, digest)
        if diff_id is not None:
            _hasher_for(diff_id, "diff_id")
        while True:
            # Reading a few hundred bytes of local metadata: not worth a thread hop on the
            # path every container start takes.
            found = self._lookup(digest)
            if found is not None:
                _check_diff_id(found, diff_id)
                return found
            running = self._inflight.get(digest)
            if running is not None:
                await running.wait()
                continue  # unpacked by that task, or it failed and this one tries itself
            done = self._inflight[digest] = trio.Event()
            try:
                try:
                    return await trio.to_thread.run_sync(
                        self._unpack, store.path_of(digest), media_type, digest, diff_id
                    )
                except LayerCorrupt:
                    store.discard(digest)
                    raise
            finally:
                del self._inflight[digest]
                done.set()

    def _lookup(self, digest: str) -> UnpackedLayer | None:
        """The cached layer, or None when it is absent or its entry is damaged."""
        entry = self._entry(digest)
        try:
            found = _read_entry(entry)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if found.digest != digest:
            raise LayerError(
                ErrorCode.FAILED_PRECONDITION,
                f"layer cache entry {entry} holds {found.digest}, not {digest}; two layers "
                f"share the first {_ID_HEX} hex digits of their digest, remove one of the images",
                field="image",
            )
        return found

    def _unpack(
        self, blob: Path, media_type: str, digest: str, diff_id: str | None
    ) -> UnpackedLayer:
        self.directory.mkdir(parents=True, exist_ok=True)
        temp = self.directory / f"{_TMP_PREFIX}{secrets.token_hex(6)}"
        temp.mkdir()
        lock_fd = os.open(temp, DIR_FLAGS)
        try:
            _flock(lock_fd, blocking=True)
            actual = unpack_layer_file(
                blob, media_type, temp / "fs", digest=digest, diff_id=diff_id
            )
            (temp / _META).write_text(json.dumps({"digest": digest, "diffId": actual}))
            entry = self._entry(digest)
            for _ in range(2):
                try:
                    os.rename(temp, entry)
                    return UnpackedLayer(digest=digest, diff_id=actual, path=entry / "fs")
                except OSError as exc:
                    if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
                found = self._lookup(digest)
                if found is not None:
                    # Another process unpacked it first: use theirs, drop ours.
                    _check_diff_id(found, diff_id)
                    return found
                # There but unreadable. Entries appear whole, so it was damaged from outside.
                self._discard_entry(entry)
            raise LayerError(
                ErrorCode.UNAVAILABLE,
                f"layer cache entry {entry} keeps changing while layer {digest} is unpacked "
                "into it; try again",
            )
        except OSError as exc:
            raise _translate(exc, digest) from exc
        finally:
            os.close(lock_fd)
            if temp.exists():
                shutil.rmtree(temp, ignore_errors=True)

    def _discard_entry(self, entry: Path) -> None:
        trash = self.directory / f"{_TRASH_PREFIX}{secrets.token_hex(6)}"
        try:
            os.rename(entry, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def layers(self) -> list[UnpackedLayer]:
        """Every cached layer. Blocking: run it in a thread."""
        found: list[UnpackedLayer] = []
        for entry in self._entries():
            try:
                found.append(_read_entry(entry))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return found

    def _entries(self) -> Iterator[Path]:
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return
        for name in names:
            if not name.startswith("."):
                yield self.directory / name

    def remove_unused(self, keep: set[str]) -> list[str]:
        """Delete every cached layer whose digest is not in `keep`; return the digests removed.

        Also clears what crashed unpacks left behind. The caller decides what is in use:
        keep every layer of every container that exists or is starting. Blocking: run it in
        a thread.
        """
        removed: list[str] = []
        for entry in self._entries():
            try:
                digest = _read_entry(entry).digest
            except (OSError, ValueError, KeyError, TypeError):
                digest = entry.name
            if digest in keep:
                continue
            self._discard_entry(entry)
            removed.append(digest)
        self._remove_leftovers()
        return removed

    def _remove_leftovers(self) -> None:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            path = self.directory / name
            if name.startswith(_TRASH_PREFIX):
                shutil.rmtree(path, ignore_errors=True)
            elif name.startswith(_TMP_PREFIX):
                try:
                    fd = os.open(path, DIR_FLAGS)
                except OSError:
                    continue
                try:
                    # Held by whoever is still unpacking into it; free means abandoned.
                    if _flock(fd, blocking=False):
                        shutil.rmtree(path, ignore_errors=True)
                finally:
                    os.close(fd)

    def statistics(self) -> LayerCacheStatistics:
        """How many layers are cached and the disk they take. Blocking: run it in a thread."""
        seen: set[tuple[int, int]] = set()
        total = 0
        count = 0
        for entry in self._entries():
            count += 1
            for top, dirs, files in os.walk(entry):
                for name in (*dirs, *files):
                    try:
                        st = os.stat(os.path.join(top, name), follow_symlinks=False)
                    except OSError:
                        continue
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_blocks * 512
        return LayerCacheStatistics(layers=count, disk_bytes=total)


def _read_entry(entry: Path) -> UnpackedLayer:
    meta = json.loads((entry / _META).read_text())
    return UnpackedLayer(digest=str(meta["digest"]), diff_id=str(meta["diffId"]), path=entry / "fs")


def _check_diff_id(layer: UnpackedLayer, diff_id: str | None) -> None:
    if diff_id is not None and layer.diff_id != diff_id:
        raise LayerError(
            ErrorCode.FAILED_PRECONDITION,
            f"layer {layer.digest} unpacks to diff_id {layer.diff_id}, but the image config "
            f"says {diff_id}; the image is inconsistent, rebuild or re-push it",
            field="image",
        )
