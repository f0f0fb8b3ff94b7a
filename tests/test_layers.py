"""Layer unpacking, the shared layer cache and snapshot layers, on real files (as root).

Layers are built in memory with tarfile, hostile ones included; each hostile test checks a
sentinel outside the layer root and that no partial layer is left behind.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import sys
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import attrs
import pytest
import trio

from agent.runtime.layers import (
    MEDIA_TYPE_DOCKER_GZIP,
    MEDIA_TYPE_TAR,
    MEDIA_TYPE_TAR_GZIP,
    LayerCache,
    LayerCorrupt,
    LayerError,
    UnpackedLayer,
    UnsafeLayer,
    unpack_layer_file,
)
from agent.runtime.snapshots import write_layer
from agent.store.objects import ObjectStore
from wire.errors import ErrorCode

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(
        os.geteuid() != 0,
        reason="needs root: unpacking keeps ownership, makes whiteout devices, sets trusted xattrs",
    ),
]

REPO = Path(__file__).resolve().parent.parent


# -- layers built in memory, stored in a real object store ------------------------------------


async def put(store: ObjectStore, data: bytes) -> str:
    async def chunks() -> AsyncIterator[bytes]:
        yield data

    return (await store.ingest(chunks(), digest=sha256(data))).digest


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


Member = tuple[tarfile.TarInfo, bytes]


def entry(
    name: str,
    data: bytes = b"",
    *,
    kind: bytes = tarfile.REGTYPE,
    mode: int = 0o644,
    uid: int = 0,
    gid: int = 0,
    link: str = "",
    mtime: int = 1_600_000_000,
    xattrs: dict[str, str] | None = None,
    device: tuple[int, int] = (0, 0),
) -> Member:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.uid, info.gid = uid, gid
    info.linkname = link
    info.mtime = mtime
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.devmajor, info.devminor = device
    if xattrs:
        info.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in xattrs.items()}
    return info, data


def directory(name: str, *, mode: int = 0o755, mtime: int = 1_600_000_000) -> Member:
    return entry(name, kind=tarfile.DIRTYPE, mode=mode, mtime=mtime)


def symlink(name: str, target: str) -> Member:
    return entry(name, kind=tarfile.SYMTYPE, link=target, mode=0o777)


def hardlink(name: str, target: str) -> Member:
    return entry(name, kind=tarfile.LNKTYPE, link=target)


def build_tar(members: list[Member]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buffer.getvalue()


@attrs.frozen
class Blob:
    digest: str
    diff_id: str
    media_type: str


async def put_layer(store: ObjectStore, members: list[Member]) -> Blob:
    raw = build_tar(members)
    return Blob(await put(store, gzip.compress(raw, mtime=0)), sha256(raw), MEDIA_TYPE_TAR_GZIP)


async def ensure(cache: LayerCache, store: ObjectStore, blob: Blob) -> UnpackedLayer:
    return await cache.ensure(store, blob.digest, blob.media_type, diff_id=blob.diff_id)


def cache_entries(cache: LayerCache) -> list[str]:
    """Everything in the cache dir, temporary and trash dirs included."""
    return sorted(os.listdir(cache.directory)) if cache.directory.exists() else []


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ObjectStore]:
    opened = ObjectStore(tmp_path / "state", budget_bytes=1 << 40, free_floor_bytes=0)
    yield opened
    opened.close()


@pytest.fixture
def cache(tmp_path: Path) -> LayerCache:
    return LayerCache(tmp_path / "state")


# -- unpacking -----------------------------------------------------------------------------------


async def test_unpack_converts_whiteouts_and_keeps_what_images_need(
    store: ObjectStore, cache: LayerCache
) -> None:
    blob = await put_layer(
        store,
        [
            directory("./"),
            directory("etc", mtime=1_500_000_000),
            entry("etc/.wh.gone"),
            directory("cache"),
            entry("cache/.wh..wh..opq"),
            entry("cache/fresh", b"new"),
            entry("usr/bin/tool", b"#!/bin/sh\n", mode=0o4755),
            entry("usr/bin/group-tool", b"x", mode=0o2711),
            directory("tmp", mode=0o1777),
            entry("data/secret", b"s3cret", mode=0o640, uid=65534, gid=65534),
            hardlink("data/alias", "data/secret"),
            symlink("etc/mtab", "/proc/self/mounts"),
            entry("etc/labelled", b"x", xattrs={"user.note": "kept"}),
            entry("etc/steer", b"x", xattrs={"trusted.overlay.redirect": "/elsewhere"}),
        ],
    )
    layer = await ensure(cache, store, blob)
    fs = layer.path

    assert layer.diff_id == blob.diff_id
    assert fs == cache.path_of(blob.digest)
    # Short enough that ~60 layers fit one page of overlay options.
    assert fs == cache.directory / blob.digest.removeprefix("sha256:")[:16] / "fs"

    gone = os.lstat(fs / "etc/gone")
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0
    assert os.getxattr(fs / "cache", "trusted.overlay.opaque") == b"y"
    assert sorted(os.listdir(fs / "cache")) == ["fresh"]
    assert not (fs / "etc/.wh.gone").exists()

    assert stat.S_IMODE(os.stat(fs / "usr/bin/tool").st_mode) == 0o4755
    assert stat.S_IMODE(os.stat(fs / "usr/bin/group-tool").st_mode) == 0o2711
    assert stat.S_IMODE(os.stat(fs / "tmp").st_mode) == 0o1777
    secret = os.stat(fs / "data/secret")
    assert (stat.S_IMODE(secret.st_mode), secret.st_uid, secret.st_gid) == (0o640, 65534, 65534)
    assert secret.st_ino == os.stat(fs / "data/alias").st_ino
    assert secret.st_mtime == 1_600_000_000
    assert os.readlink(fs / "etc/mtab") == "/proc/self/mounts"
    assert os.getxattr(fs / "etc/labelled", "user.note") == b"kept"
    # A layer may not steer overlayfs with trusted.overlay.* attributes of its own.
    assert "trusted.overlay.redirect" not in os.listxattr(fs / "etc/steer")
    assert os.stat(fs / "etc").st_mtime == 1_500_000_000


async def test_gzip_of_several_members_and_the_docker_media_type(
    store: ObjectStore, cache: LayerCache
) -> None:
    raw = build_tar([entry("a", b"a" * 100_000), entry("b", b"b")])
    # Two gzip members and zero padding after them, as some tools write.
    compressed = gzip.compress(raw[:7000]) + gzip.compress(raw[7000:]) + b"\0" * 64
    digest = await put(store, compressed)
    layer = await cache.ensure(store, digest, MEDIA_TYPE_DOCKER_GZIP, diff_id=sha256(raw))
    assert layer.diff_id == sha256(raw)
    assert (layer.path / "a").read_bytes() == b"a" * 100_000
    assert (layer.path / "b").read_bytes() == b"b"


async def test_a_layer_with_names_replaced_within_it(store: ObjectStore, cache: LayerCache) -> None:
    blob = await put_layer(
        store,
        [
            entry("thing", b"first"),
            entry("thing", b"second"),
            directory("was-dir"),
            entry("was-dir/inner", b"x"),
            entry("was-dir", b"now a file"),
            entry("link", b"file first"),
            symlink("link", "thing"),
        ],
    )
    fs = (await ensure(cache, store, blob)).path
    assert (fs / "thing").read_bytes() == b"second"
    assert (fs / "was-dir").read_bytes() == b"now a file"
    assert os.readlink(fs / "link") == "thing"


async def test_implied_directories_do_not_depend_on_the_umask(
    store: ObjectStore, tmp_path: Path
) -> None:
    raw = build_tar([entry("usr/share/doc/readme", b"r")])
    digest = await put(store, raw)
    previous = os.umask(0o077)
    try:
        unpack_layer_file(store.path_of(digest), MEDIA_TYPE_TAR, tmp_path / "fs", digest=digest)
    finally:
        os.umask(previous)
    for path in ("", "usr", "usr/share", "usr/share/doc"):
        assert stat.S_IMODE(os.stat(tmp_path / "fs" / path).st_mode) == 0o755, path


async def test_hard_link_to_a_directory_is_a_broken_image(
    store: ObjectStore, cache: LayerCache
) -> None:
    blob = await put_layer(store, [directory("d"), hardlink("alias", "d")])
    with pytest.raises(LayerError) as caught:
        await ensure(cache, store, blob)
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert "'alias'" in caught.value.message
    assert cache_entries(cache) == []


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside every layer root, with one file a hostile layer would love to hit."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "target").write_bytes(b"untouched")
    return path


HOSTILE: dict[str, list[Member]] = {
    "dot-dot": [entry("../outside/escaped", b"pwned")],
    "dot-dot-inside": [directory("a"), entry("a/../../outside/escaped", b"pwned")],
    "absolute": [entry("{outside}/escaped", b"pwned")],
    "through-symlink": [symlink("link", "{outside}"), entry("link/escaped", b"pwned")],
    "through-relative-symlink": [
        symlink("up", "../../../outside"),
        entry("up/escaped", b"pwned"),
    ],
    "dir-through-symlink": [symlink("link", "{outside}"), directory("link/escaped")],
    "whiteout-through-symlink": [symlink("link", "{outside}"), entry("link/.wh.target")],
    "opaque-through-symlink": [symlink("link", "{outside}"), entry("link/.wh..wh..opq")],
    "hardlink-absolute": [hardlink("stolen", "{outside}/target")],
    "hardlink-etc-passwd": [hardlink("passwd", "/etc/passwd")],
    "hardlink-dot-dot": [hardlink("stolen", "../outside/target")],
    "hardlink-through-symlink": [symlink("link", "{outside}"), hardlink("stolen", "link/target")],
    "device": [entry("dev/mem", kind=tarfile.CHRTYPE, device=(1, 1))],
    "block-device": [entry("dev/sda", kind=tarfile.BLKTYPE, device=(8, 0))],
    "fifo": [entry("run/pipe", kind=tarfile.FIFOTYPE)],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_layers_are_refused_whole(
    case: str, store: ObjectStore, cache: LayerCache, outside: Path
) -> None:
    members = []
    for info, data in HOSTILE[case]:
        info.name = info.name.format(outside=outside)
        info.linkname = info.linkname.format(outside=outside)
        members.append((info, data))
    # Good members before the bad one: they must not survive either.
    blob = await put_layer(store, [entry("bin/ok", b"fine"), *members])
    passwd_links = os.stat("/etc/passwd").st_nlink

    with pytest.raises(UnsafeLayer) as caught:
        await ensure(cache, store, blob)

    bad = members[-1][0].name
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert repr(bad) in caught.value.message and blob.digest in caught.value.message
    assert sorted(os.listdir(outside)) == ["target"]
    assert (outside / "target").read_bytes() == b"untouched"
    assert os.stat(outside / "target").st_nlink == 1
    assert os.stat("/etc/passwd").st_nlink == passwd_links
    assert cache_entries(cache) == []
    # The blob itself is sound (it matches its digest): it stays in the store.
    assert store.contains(blob.digest)


async def test_corrupt_blob_is_discarded(store: ObjectStore, cache: LayerCache) -> None:
    good = gzip.compress(build_tar([entry("a", b"a" * 50_000)]))
    digest = sha256(good)
    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0xFF
    store.path_of(digest).write_bytes(bytes(damaged))

    with pytest.raises(LayerCorrupt) as caught:
        await cache.ensure(store, digest, MEDIA_TYPE_TAR_GZIP)

    assert caught.value.code is ErrorCode.UNAVAILABLE  # pulling again fixes it
    assert digest in caught.value.message
    assert not store.contains(digest)
    assert cache_entries(cache) == []


async def test_blob_that_unpacks_fine_but_has_another_digest(
    store: ObjectStore, cache: LayerCache
) -> None:
    # A valid layer stored under the wrong name: only the digest check can tell.
    digest = sha256(b"something else")
    store.path_of(digest).write_bytes(gzip.compress(build_tar([entry("a", b"a")])))

    with pytest.raises(LayerCorrupt):
        await cache.ensure(store, digest, MEDIA_TYPE_TAR_GZIP)

    assert not store.contains(digest)
    assert cache_entries(cache) == []


async def test_missing_blob(store: ObjectStore, cache: LayerCache) -> None:
    with pytest.raises(LayerError) as caught:
        await cache.ensure(store, sha256(b"never stored"), MEDIA_TYPE_TAR)
    assert caught.value.code is ErrorCode.NOT_FOUND
    assert cache_entries(cache) == []


async def test_diff_id_mismatch(store: ObjectStore, cache: LayerCache) -> None:
    blob = await put_layer(store, [entry("a", b"a")])
    with pytest.raises(LayerError) as caught:
        await cache.ensure(store, blob.digest, blob.media_type, diff_id=sha256(b"other"))
    assert caught.value.code is ErrorCode.FAILED_PRECONDITION
    assert "diff_id" in caught.value.message
    assert cache_entries(cache) == []
    assert store.contains(blob.digest)


async def test_not_a_tar(store: ObjectStore, cache: LayerCache) -> None:
    digest = await put(store, gzip.compress(b"this is no tar archive" * 100))
    with pytest.raises(LayerError) as caught:
        await cache.ensure(store, digest, MEDIA_TYPE_TAR_GZIP)
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert "not a valid tar" in caught.value.message
    assert cache_entries(cache) == []


@pytest.mark.parametrize(
    ("media_type", "code"),
    [
        ("application/vnd.oci.image.layer.v1.tar+zstd", ErrorCode.UNIMPLEMENTED),
        ("application/vnd.oci.image.config.v1+json", ErrorCode.UNIMPLEMENTED),
    ],
)
async def test_media_types_we_do_not_unpack(
    store: ObjectStore, cache: LayerCache, media_type: str, code: ErrorCode
) -> None:
    digest = await put(store, b"whatever")
    with pytest.raises(LayerError) as caught:
        await cache.ensure(store, digest, media_type)
    assert caught.value.code is code
    assert media_type in caught.value.message
    assert cache_entries(cache) == []


async def test_bad_digest_is_refused(store: ObjectStore, cache: LayerCache) -> None:
    with pytest.raises(LayerError) as caught:
        await cache.ensure(store, "sha256:../../etc", MEDIA_TYPE_TAR)
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert caught.value.field == "digest"


# -- sharing ---------------------------------------------------------------------------------------


def many_files() -> list[Member]:
    return [entry(f"d{i % 10}/f{i}", os.urandom(64)) for i in range(300)]


async def test_concurrent_ensure_in_one_process(store: ObjectStore, tmp_path: Path) -> None:
    blob = await put_layer(store, many_files())
    shared = LayerCache(tmp_path / "state")
    # A second cache on the same root stands in for another agent process: no in-process
    # single-flight between them, only the rename.
    other = LayerCache(tmp_path / "state")
    results: list[UnpackedLayer] = []

    async def one(cache: LayerCache) -> None:
        results.append(await ensure(cache, store, blob))

    async with trio.open_nursery() as nursery:
        for cache in (shared, shared, other, other):
            nursery.start_soon(one, cache)

    assert len(results) == 4 and len(set(results)) == 1
    assert cache_entries(shared) == [blob.digest.removeprefix("sha256:")[:16]]
    assert len(list(results[0].path.rglob("f*"))) == 300


async def test_concurrent_ensure_in_two_processes(store: ObjectStore, tmp_path: Path) -> None:
    blob = await put_layer(store, many_files())
    root = store.root
    script = (
        "import sys, trio\n"
        "from pathlib import Path\n"
        "from agent.runtime.layers import LayerCache\n"
        "from agent.store.objects import ObjectStore\n"
        "root, digest, media_type, diff_id = sys.argv[1:]\n"
        "store = ObjectStore(Path(root), budget_bytes=1 << 40, free_floor_bytes=0)\n"
        "layer = trio.run(lambda: LayerCache(Path(root)).ensure(\n"
        "    store, digest, media_type, diff_id=diff_id))\n"
        "print(layer.path)\n"
    )
    argv = [sys.executable, "-c", script, str(root)]
    argv += [blob.digest, blob.media_type, blob.diff_id]
    printed: list[bytes] = []

    async def agent() -> None:
        # check=True: a failed unpack fails the test with the process's exit status.
        done = await trio.run_process(argv, capture_stdout=True, cwd=REPO)
        printed.append(done.stdout.strip())

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent)
            nursery.start_soon(agent)

    assert printed == [os.fsencode(LayerCache(root).path_of(blob.digest))] * 2
    cache = LayerCache(root)
    assert cache_entries(cache) == [blob.digest.removeprefix("sha256:")[:16]]
    assert [layer.digest for layer in cache.layers()] == [blob.digest]
    assert len(list(cache.path_of(blob.digest).rglob("f*"))) == 300


async def test_remove_unused_and_statistics(store: ObjectStore, cache: LayerCache) -> None:
    kept = await put_layer(store, [entry("kept", b"k" * 10_000)])
    dropped = await put_layer(store, [entry("dropped", b"d" * 10_000)])
    for blob in (kept, dropped):
        await ensure(cache, store, blob)
    # Left behind by an agent that crashed mid-unpack (no one holds its lock).
    (cache.directory / ".tmp-crashed" / "fs").mkdir(parents=True)
    before = cache.statistics()

    removed = cache.remove_unused({kept.digest})

    assert removed == [dropped.digest]
    assert [layer.digest for layer in cache.layers()] == [kept.digest]
    assert cache_entries(cache) == [kept.digest.removeprefix("sha256:")[:16]]
    after = cache.statistics()
    assert (before.layers, after.layers) == (2, 1)
    assert after.disk_bytes >= 10_000 and before.disk_bytes >= after.disk_bytes + 10_000
    # The removed layer comes back when asked for again.
    assert (await ensure(cache, store, dropped)).path.joinpath("dropped").exists()


async def test_damaged_cache_entry_is_replaced(store: ObjectStore, cache: LayerCache) -> None:
    blob = await put_layer(store, [entry("a", b"a")])
    layer = await ensure(cache, store, blob)
    (layer.path.parent / "layer.json").write_text("{not json")
    again = await ensure(cache, store, blob)
    assert again == layer and (again.path / "a").read_bytes() == b"a"


# -- snapshot layers -----------------------------------------------------------------------------


def read_layer(data: bytes) -> Iterator[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        yield from tar.getmembers()


async def test_write_layer_turns_overlay_forms_into_oci_ones(
    store: ObjectStore, cache: LayerCache, tmp_path: Path
) -> None:
    upper = tmp_path / "upper"
    (upper / "etc").mkdir(parents=True)
    (upper / "etc/hosts").write_bytes(b"127.0.0.1 box\n")
    os.mknod(upper / "etc/removed", stat.S_IFCHR, os.makedev(0, 0))
    (upper / "cache").mkdir()
    os.setxattr(upper / "cache", "trusted.overlay.opaque", b"y")
    (upper / "cache/only").write_bytes(b"only")
    (upper / "bin").mkdir()
    (upper / "bin/su").write_bytes(b"su")
    os.chmod(upper / "bin/su", 0o4755)
    (upper / "home").mkdir()
    (upper / "home/a").write_bytes(b"linked")
    os.chown(upper / "home/a", 65534, 65534)
    os.chmod(upper / "home/a", 0o640)
    os.link(upper / "home/a", upper / "home/b")
    os.symlink("../etc/hosts", upper / "home/hosts")
    os.setxattr(upper / "home/a", "user.note", b"kept")
    os.setxattr(upper / "home/a", "trusted.overlay.origin", b"internal")
    os.mkfifo(upper / "home/pipe")  # layers cannot carry fifos: left out
    long_name = "n" * 200
    (upper / "home" / long_name).write_bytes(b"long")
    (upper / os.fsdecode(b"caf\xe9")).write_bytes(b"latin-1 name")

    digest, size, diff_id = await write_layer(upper, store)

    data = store.path_of(digest).read_bytes()
    assert digest == diff_id == sha256(data) and size == len(data)
    members = {m.name: m for m in read_layer(data)}
    assert sorted(members) == [
        "bin",
        "bin/su",
        "cache",
        "cache/.wh..wh..opq",
        "cache/only",
        os.fsdecode(b"caf\xe9"),
        "etc",
        "etc/.wh.removed",
        "etc/hosts",
        "home",
        "home/a",
        "home/b",
        "home/hosts",
        f"home/{long_name}",
    ]
    assert members["etc/.wh.removed"].isreg()
    assert members["home/b"].islnk() and members["home/b"].linkname == "home/a"
    assert members["home/a"].pax_headers.get("SCHILY.xattr.user.note") == "kept"
    assert not any("trusted" in key for key in members["home/a"].pax_headers)
    assert members["bin/su"].mode == 0o4755

    # Unpacked again it is the same upper dir in overlay's form.
    fs = (await cache.ensure(store, digest, MEDIA_TYPE_TAR, diff_id=diff_id)).path
    removed = os.lstat(fs / "etc/removed")
    assert stat.S_ISCHR(removed.st_mode) and removed.st_rdev == 0
    assert os.getxattr(fs / "cache", "trusted.overlay.opaque") == b"y"
    home = os.stat(fs / "home/a")
    assert (home.st_uid, home.st_gid, stat.S_IMODE(home.st_mode)) == (65534, 65534, 0o640)
    assert home.st_ino == os.stat(fs / "home/b").st_ino
    assert os.readlink(fs / "home/hosts") == "../etc/hosts"
    assert (fs / "home" / long_name).read_bytes() == b"long"
    assert os.listdir(os.fsencode(fs)).count(b"caf\xe9") == 1
    assert stat.S_IMODE(os.stat(fs / "bin/su").st_mode) == 0o4755


async def test_write_layer_of_an_empty_upper(store: ObjectStore, tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    digest, size, _ = await write_layer(upper, store)
    assert list(read_layer(store.path_of(digest).read_bytes())) == []
    assert size == 1024
