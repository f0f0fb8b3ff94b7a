"""Overlay rootfs mounts over real unpacked layers, and snapshots taken from them (as root).

Every test that mounts cleans up through the `mounts` fixture, which unmounts whatever overlay
is left under the test's temp dir, also when the test fails.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from agent.host.mount import parse_mountinfo
from agent.runtime.layers import MEDIA_TYPE_TAR, LayerCache
from agent.runtime.rootfs import (
    RootfsError,
    mount_overlay,
    overlay_mounts_under,
    overlays_under,
    unmount,
)
from agent.runtime.snapshots import write_layer
from agent.store.objects import ObjectStore
from tests.test_layers import Member, directory, ensure, entry, hardlink, put_layer, symlink
from wire.errors import ErrorCode

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: mounts overlays and unpacks layers with ownership"
)


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[Path]:
    """The test's temp dir; every overlay still mounted under it is unmounted afterwards."""
    yield tmp_path
    for mount in overlay_mounts_under(tmp_path):
        unmount(mount)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ObjectStore]:
    opened = ObjectStore(tmp_path / "state", budget_bytes=1 << 40, free_floor_bytes=0)
    yield opened
    opened.close()


@pytest.fixture
def cache(tmp_path: Path) -> LayerCache:
    return LayerCache(tmp_path / "state")


def container(base: Path, name: str) -> tuple[Path, Path, Path]:
    """A container's upper, work and rootfs dirs, on one filesystem."""
    dirs = tuple(base / name / part for part in ("upper", "work", "rootfs"))
    for path in dirs:
        path.mkdir(parents=True)
    upper, work, rootfs = dirs
    return upper, work, rootfs


BOTTOM: list[Member] = [
    entry("etc/passwd", b"root:x:0:0::/root:/bin/sh\n"),
    entry("etc/gone", b"deleted by the layer above"),
    entry("etc/motd", b"hello\n"),
    entry("cache/old1", b"1"),
    entry("cache/old2", b"2"),
    entry("data/secret", b"s3cret", mode=0o640, uid=65534, gid=65534),
    hardlink("data/alias", "data/secret"),
    entry("bin/busybox", b"\x7fELF", mode=0o755),
    entry("bin/su", b"su", mode=0o4755),
    symlink("bin/sh", "busybox"),
    entry("merged/a", b"a"),
    entry("olddir/x", b"x"),
    directory("tmp", mode=0o1777),
]
TOP: list[Member] = [
    entry("etc/.wh.gone"),
    entry("cache/.wh..wh..opq"),
    entry("cache/new", b"new"),
    entry("merged/b", b"b"),
]


async def image_layers(store: ObjectStore, cache: LayerCache) -> list[Path]:
    """The test image's layer dirs, topmost first."""
    layers = []
    for members in (BOTTOM, TOP):
        layers.append((await ensure(cache, store, await put_layer(store, members))).path)
    return layers[::-1]


def view(root: Path) -> dict[str, tuple[object, ...]]:
    """What a process in the container sees: every path's kind, mode, owner, content, links."""
    found: dict[str, tuple[object, ...]] = {}
    inodes: dict[int, list[str]] = {}
    for top, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            path = Path(top) / name
            rel = str(path.relative_to(root))
            st = os.lstat(path)
            owner = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("symlink", os.readlink(path), st.st_uid, st.st_gid)
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("dir", *owner)
            else:
                found[rel] = ("file", *owner, path.read_bytes())
                inodes.setdefault(st.st_ino, []).append(rel)
    for group in inodes.values():
        for rel in group:
            found[rel] = (*found[rel], tuple(sorted(group)))
    return found


@needs_root
async def test_merged_view_of_image_layers(
    mounts: Path, store: ObjectStore, cache: LayerCache
) -> None:
    lowers = await image_layers(store, cache)
    upper, work, rootfs = container(mounts, "c1")
    mount_overlay(lowers, upper, work, rootfs, image="test/image:1")

    assert not (rootfs / "etc/gone").exists()
    assert sorted(os.listdir(rootfs / "cache")) == ["new"]
    assert sorted(os.listdir(rootfs / "merged")) == ["a", "b"]
    secret = os.stat(rootfs / "data/secret")
    assert (stat.S_IMODE(secret.st_mode), secret.st_uid, secret.st_gid) == (0o640, 65534, 65534)
    assert secret.st_ino == os.stat(rootfs / "data/alias").st_ino
    assert os.readlink(rootfs / "bin/sh") == "busybox"
    assert stat.S_IMODE(os.stat(rootfs / "bin/su").st_mode) == 0o4755
    assert stat.S_IMODE(os.stat(rootfs / "tmp").st_mode) == 0o1777
    assert (rootfs / "etc/passwd").read_bytes() == b"root:x:0:0::/root:/bin/sh\n"

    # A second container on the same shared layers: both mounted, each with its own writes.
    upper2, work2, rootfs2 = container(mounts, "c2")
    mount_overlay(lowers, upper2, work2, rootfs2, image="test/image:1")
    (rootfs / "etc/motd").write_bytes(b"changed in c1\n")
    assert (rootfs2 / "etc/motd").read_bytes() == b"hello\n"
    assert (lowers[1] / "etc/motd").read_bytes() == b"hello\n"
    assert overlay_mounts_under(mounts) == [rootfs2, rootfs]


@needs_root
async def test_snapshot_reproduces_the_containers_filesystem(
    mounts: Path, store: ObjectStore, cache: LayerCache
) -> None:
    lowers = await image_layers(store, cache)
    upper, work, rootfs = container(mounts, "c1")
    mount_overlay(lowers, upper, work, rootfs)

    (rootfs / "root").mkdir()
    (rootfs / "root/notes").write_bytes(b"added")
    os.chown(rootfs / "root/notes", 65534, 65534)
    os.chmod(rootfs / "root/notes", 0o600)
    os.link(rootfs / "root/notes", rootfs / "root/notes-again")
    with (rootfs / "etc/passwd").open("ab") as passwd:
        passwd.write(b"app:x:1000:1000::/home/app:/bin/sh\n")
    (rootfs / "etc/motd").unlink()
    shutil.rmtree(rootfs / "merged")  # a lower directory replaced by a new one
    (rootfs / "merged").mkdir()
    (rootfs / "merged/only").write_bytes(b"only")
    os.rename(rootfs / "cache/new", rootfs / "cache/renamed")
    shutil.move(rootfs / "olddir", rootfs / "newdir")  # copied, as redirect_dir is off
    os.chmod(rootfs / "bin/su", 0o755)
    (rootfs / "bin/sh").unlink()
    os.symlink("busybox", rootfs / "bin/ash")
    (rootfs / "data/alias").unlink()
    before = view(rootfs)
    assert "etc/motd" not in before and "merged/a" not in before and "newdir/x" in before
    unmount(rootfs)

    digest, size, diff_id = await write_layer(upper, store)
    assert size == store.size_of(digest)
    snapshot = await cache.ensure(store, digest, MEDIA_TYPE_TAR, diff_id=diff_id)
    upper2, work2, rootfs2 = container(mounts, "restored")
    mount_overlay([snapshot.path, *lowers], upper2, work2, rootfs2)

    assert view(rootfs2) == before


@needs_root
async def test_unmount_of_a_busy_rootfs_detaches_it(
    mounts: Path, store: ObjectStore, cache: LayerCache
) -> None:
    lowers = await image_layers(store, cache)
    upper, work, rootfs = container(mounts, "busy")
    mount_overlay(lowers, upper, work, rootfs)
    assert overlay_mounts_under(mounts) == [rootfs]
    assert overlay_mounts_under(mounts / "elsewhere") == []

    process = await trio.lowlevel.open_process(["sleep", "60"], cwd=rootfs)
    try:
        unmount(rootfs)
        assert overlay_mounts_under(mounts) == []
        assert os.listdir(rootfs) == []
    finally:
        process.kill()
        with trio.fail_after(10):
            await process.wait()


@needs_root
def test_unmount_of_what_is_not_mounted(tmp_path: Path) -> None:
    unmount(tmp_path)
    unmount(tmp_path / "missing")
    assert tmp_path.is_dir()


@needs_root
def test_too_many_layers_for_one_mount(mounts: Path) -> None:
    lowers = []
    for index in range(70):
        lowers.append(mounts / "layers" / f"{index:04d}-{'x' * 48}")
        lowers[-1].mkdir(parents=True)
    upper, work, rootfs = container(mounts, "deep")
    with pytest.raises(RootfsError) as caught:
        mount_overlay(lowers, upper, work, rootfs, image="registry.test/deep:1")
    assert "registry.test/deep:1" in caught.value.message
    assert "70 layers" in caught.value.message
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert overlay_mounts_under(mounts) == []
    # Fewer of the same layers fit.
    mount_overlay(lowers[:20], upper, work, rootfs, image="registry.test/deep:1")
    assert overlay_mounts_under(mounts) == [rootfs]


@needs_root
def test_paths_overlay_cannot_carry_are_refused(mounts: Path) -> None:
    upper, work, rootfs = container(mounts, "odd")
    odd = mounts / "layer:with,separators"
    odd.mkdir()
    with pytest.raises(RootfsError) as caught:
        mount_overlay([odd], upper, work, rootfs)
    assert str(odd) in caught.value.message
    assert overlay_mounts_under(mounts) == []


@needs_root
def test_mount_failure_names_the_target(mounts: Path) -> None:
    upper, work, rootfs = container(mounts, "broken")
    with pytest.raises(RootfsError) as caught:
        mount_overlay([mounts / "no-such-layer"], upper, work, rootfs)
    assert str(rootfs) in caught.value.message
    assert overlay_mounts_under(mounts) == []


def test_mountinfo_parsing() -> None:
    text = (
        "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        "57 22 0:49 / /var/lib/l9/containers/a/rootfs rw,relatime shared:30 - overlay levers9 "
        "rw,lowerdir=/var/lib/l9/layers/0123/fs,upperdir=/u,workdir=/w\n"
        "58 22 0:50 / /var/lib/l9/containers/with\\040space/rootfs rw - overlay levers9 rw\n"
        "59 22 0:51 / /var/lib/l9/containers/b/rootfs rw master:3 - tmpfs tmpfs rw\n"
        "60 22 0:52 / /var/lib/l9-other/rootfs rw - overlay levers9 rw\n"
        "61 57 0:53 / /var/lib/l9/containers/a/rootfs rw - overlay levers9 rw\n"
        "not a mountinfo line\n"
    )
    entries = parse_mountinfo(text)
    assert [e.mount_id for e in entries] == [22, 57, 58, 59, 60, 61]
    assert entries[1].fs_type == "overlay" and entries[1].source == "levers9"
    assert entries[1].options.startswith("rw,lowerdir=/var/lib/l9/layers/0123/fs")
    assert entries[2].mount_point == Path("/var/lib/l9/containers/with space/rootfs")

    assert overlays_under(entries, Path("/var/lib/l9")) == [
        Path("/var/lib/l9/containers/a/rootfs"),  # stacked twice: listed twice, newest first
        Path("/var/lib/l9/containers/with space/rootfs"),
        Path("/var/lib/l9/containers/a/rootfs"),
    ]
