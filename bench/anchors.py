"""Anchors for tunnel benchmarks: the paths ours is compared with, and the measurements.

A figure for our tunnel means little alone; each is reported as a ratio to anchors measured in
the same run. This module owns everything that does not depend on our tunnel:

- ``open_sink_process``: the separate process where every path ends (``bench.sink``);
- ``open_sshd`` and ``open_ssh_reverse_tunnel``: OpenSSH's ``ssh -R``, the job our tunnel does;
- measurements that take ``open_stream``, a zero-argument async callable returning a
  ``trio.abc.Stream``, so one piece of code measures direct TCP, the ``ssh -R`` public port and
  our tunnel's CONNECT stream alike.

Each process is owned by the ``open_*`` context manager that started it, which kills it on exit,
also when the body fails or is cancelled; sshd's per-connection processes are killed with it.

``python -m bench.anchors [--quick] [--json FILE]`` measures the anchors alone.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Protocol

import attrs
import psutil
import trio

from bench.report import render_table, write_report


class OpenStream(Protocol):
    """Opens a new byte stream to the sink, by whatever path is under test, with `first` sent
    on it as early as the path allows: over TCP, right after the connect; through a worker,
    with the CONNECT itself (what the endpoint route does with a request's head)."""

    def __call__(self, first: bytes = b"") -> Awaitable[trio.abc.Stream]: ...


# Bounds on starting and stopping helper processes; measurements themselves take no timeout, the
# caller wraps them (trio.fail_after) where it wants one.
STARTUP_DEADLINE_S = 10.0
STOP_GRACE_S = 2.0
POLL_INTERVAL_S = 0.02
SSHD_START_ATTEMPTS = 5
LOG_TAIL_BYTES = 2000

_REPO_ROOT = Path(__file__).resolve().parents[1]
_LENGTH = struct.Struct(">Q")
_ALLOCATED_PORT = re.compile(rb"Allocated port (\d+) for remote forward")


class AnchorError(RuntimeError):
    """A helper process (sink, sshd, ssh) did not start or died; the message carries its log."""


class SinkProtocolError(RuntimeError):
    """The far end did not answer as ``bench.sink`` does: bytes were lost, altered or added."""


# --- processes -------------------------------------------------------------------------------


async def _stop(process: trio.Process) -> None:
    """Terminate, then kill after a grace period; bounded, so it is safe to shield."""
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.terminate()
            with trio.move_on_after(STOP_GRACE_S):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _kill_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.Error):  # already gone
            process.kill()


def _log_tail(path: Path) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            return log.read().decode("utf-8", "replace").strip()
    except OSError as error:
        return f"(no log: {error})"


def _free_port() -> int:
    """A loopback port that was free a moment ago; for programs that cannot be told to use 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def wait_accepting(port: int, process: trio.Process, log_path: Path | None = None) -> None:
    """Wait until 127.0.0.1:`port` accepts a connection; `AnchorError` with the end of
    `log_path` if `process` exits first or `STARTUP_DEADLINE_S` passes.
    """
    with trio.move_on_after(STARTUP_DEADLINE_S):
        while process.returncode is None:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                await trio.sleep(POLL_INTERVAL_S)
            else:
                await stream.aclose()
                return
    what = "timed out" if process.returncode is None else f"exited with {process.returncode}"
    raise AnchorError(
        f"{process.args!r} {what} before port {port} accepted connections; its log ends:\n"
        + (_log_tail(log_path) if log_path else "(no log)")
    )


@asynccontextmanager
async def open_sink_process() -> AsyncIterator[int]:
    """Run ``python -m bench.sink`` in its own process; yields the port it listens on."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "bench.sink"],
        # The sink exits when this pipe closes, even if we die without running `finally`.
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=_REPO_ROOT,
    )
    try:
        yield await _read_sink_port(process)
    finally:
        await _stop(process)
        if process.stdin is not None:
            await process.stdin.aclose()
        if process.stdout is not None:
            await process.stdout.aclose()


async def _read_sink_port(process: trio.Process) -> int:
    assert process.stdout is not None
    line = b""
    with trio.fail_after(STARTUP_DEADLINE_S):
        while b"\n" not in line:
            chunk = await process.stdout.receive_some(256)
            if not chunk:
                raise AnchorError(
                    f"bench.sink exited with {process.returncode} before printing its port"
                )
            line += chunk
    first = line.split(b"\n", 1)[0].decode("ascii", "replace")
    word, _, port = first.partition(" ")
    if word != "PORT" or not port.isdigit():
        raise AnchorError(f"bench.sink printed {first!r} where 'PORT <n>' was expected")
    return int(port)


@attrs.frozen
class Sshd:
    """A running loopback sshd that accepts `client_key_path` for `user`."""

    port: int
    user: str
    client_key_path: Path
    workdir: Path
    log_path: Path


def find_sshd() -> Path | None:
    """sshd's absolute path (it must be started by one), or None if OpenSSH's server is missing."""
    found = shutil.which("sshd") or shutil.which("sshd", path="/usr/sbin:/usr/local/sbin")
    return Path(found) if found else None


async def _keygen(path: Path) -> None:
    await trio.run_process(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "levers9-bench", "-f", str(path)],
        capture_stdout=True,
        capture_stderr=True,
    )


def _write_sshd_config(workdir: Path, port: int, host_key: Path, authorized_keys: Path) -> Path:
    config = workdir / "sshd_config"
    config.write_text(
        f"Port {port}\n"
        "ListenAddress 127.0.0.1\n"
        f"HostKey {host_key}\n"
        f"AuthorizedKeysFile {authorized_keys}\n"
        # No pid file: the system sshd's /run/sshd.pid is not ours to overwrite.
        "PidFile none\n"
        "UsePAM no\n"
        "StrictModes no\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "AllowTcpForwarding yes\n"
        "PrintMotd no\n"
        "LogLevel INFO\n",
        encoding="utf-8",
    )
    return config


def _authorize(client_key: Path, workdir: Path) -> Path:
    """Write the authorized_keys file sshd will read, and the directory sshd needs."""
    # sshd refuses to start without its privilege separation directory.
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    authorized_keys = workdir / "authorized_keys"
    authorized_keys.write_bytes(client_key.with_suffix(".pub").read_bytes())
    return authorized_keys


def ssh_reverse_command(sshd: Sshd, public_port: int, target_port: int) -> list[str]:
    """The ``ssh -R`` command line: no user config, only our key, no questions, no remote command,
    and exit if the forward cannot be set up.
    """
    forward = f"127.0.0.1:{public_port}:127.0.0.1:{target_port}"
    return ssh_forward_command(sshd, "-R", forward)


def ssh_forward_command(sshd: Sshd, flag: str, forward: str) -> list[str]:
    """``ssh`` with one forward (``-R`` or ``-L`` and its spec) to `sshd` and nothing else."""
    command = ["ssh", "-F", "/dev/null", "-i", str(sshd.client_key_path)]
    for option in (
        "IdentitiesOnly=yes",
        "StrictHostKeyChecking=no",
        "UserKnownHostsFile=/dev/null",
        "ExitOnForwardFailure=yes",
        "BatchMode=yes",
    ):
        command += ["-o", option]
    return [*command, "-p", str(sshd.port), "-N", flag, forward, f"{sshd.user}@127.0.0.1"]


def _open_log(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


@asynccontextmanager
async def open_sshd(workdir: Path) -> AsyncIterator[Sshd]:
    """A loopback sshd with its own config, host key and authorized key, all under `workdir`.

    Default cipher and key exchange, as a user of ``ssh -R`` would get them. sshd cannot be given
    port 0, so it gets a port that was free a moment ago, and another if it fails to bind.
    """
    sshd_path = find_sshd()
    if sshd_path is None:
        raise AnchorError("sshd is not installed; install the Debian package openssh-server")
    host_key = workdir / "ssh_host_ed25519_key"
    client_key = workdir / "client_ed25519"
    await _keygen(host_key)
    await _keygen(client_key)
    authorized_keys = _authorize(client_key, workdir)
    log_path = workdir / "sshd.log"

    for attempt in range(1, SSHD_START_ATTEMPTS + 1):
        port = _free_port()
        config = _write_sshd_config(workdir, port, host_key, authorized_keys)
        log_fd = _open_log(log_path)
        try:
            process = await trio.lowlevel.open_process(
                [str(sshd_path), "-D", "-e", "-f", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log_fd,
            )
        finally:
            os.close(log_fd)
        try:
            try:
                await _wait_ssh_banner(port, process, log_path)
            except AnchorError:
                if attempt == SSHD_START_ATTEMPTS:
                    raise
                continue  # most likely someone else took the port in between: another one
            yield Sshd(
                port=port,
                user=pwd.getpwuid(os.getuid()).pw_name,
                client_key_path=client_key,
                workdir=workdir,
                log_path=log_path,
            )
            return
        finally:
            # sshd forks one process per connection (in its own session) and does not end them
            # when it is terminated; find them before it goes and they are reparented.
            sessions = _descendants(process.pid)
            await _stop(process)
            _kill_all(sessions)


async def _wait_ssh_banner(port: int, process: trio.Process, log_path: Path) -> None:
    """Wait until `port` answers with an SSH banner, i.e. our sshd rather than a stranger."""
    await wait_accepting(port, process, log_path)
    banner = b""
    with trio.move_on_after(STARTUP_DEADLINE_S):
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            banner = await stream.receive_some(256)
    if not banner.startswith(b"SSH-"):
        raise AnchorError(f"port {port} answered {banner[:40]!r}, not an SSH banner")


@asynccontextmanager
async def open_ssh_reverse_tunnel(sshd: Sshd, target_port: int) -> AsyncIterator[int]:
    """``ssh -R``: sshd listens on a public port and forwards each connection over one SSH
    connection to ssh, which connects to 127.0.0.1:`target_port`. Yields the public port.

    The public port is ``0`` on the command line: sshd asks the kernel for one and ssh reports it,
    so no other program can take it between choosing and binding.
    """
    log_path = sshd.workdir / f"ssh-R-{target_port}.log"
    log_fd = _open_log(log_path)
    try:
        process = await trio.lowlevel.open_process(
            ssh_reverse_command(sshd, 0, target_port),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log_fd,
        )
    finally:
        os.close(log_fd)
    try:
        public_port = await _wait_allocated_port(process, log_path)
        await wait_accepting(public_port, process, log_path)
        yield public_port
    finally:
        await _stop(process)


@asynccontextmanager
async def open_ssh_local_forward(sshd: Sshd, host: str, port: int) -> AsyncIterator[int]:
    """``ssh -L``: ssh listens on a local port and forwards each connection over one SSH
    connection to sshd, which connects to `host`:`port`. Yields the local port."""
    local_port = _free_port()
    log_path = sshd.workdir / f"ssh-L-{port}.log"
    log_fd = _open_log(log_path)
    try:
        process = await trio.lowlevel.open_process(
            ssh_forward_command(sshd, "-L", f"127.0.0.1:{local_port}:{host}:{port}"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log_fd,
        )
    finally:
        os.close(log_fd)
    try:
        await wait_accepting(local_port, process, log_path)
        yield local_port
    finally:
        await _stop(process)


async def _wait_allocated_port(process: trio.Process, log_path: Path) -> int:
    with trio.move_on_after(STARTUP_DEADLINE_S):
        while process.returncode is None:
            found = _ALLOCATED_PORT.search(await trio.Path(log_path).read_bytes())
            if found:
                return int(found[1])
            await trio.sleep(POLL_INTERVAL_S)
    what = "timed out" if process.returncode is None else f"exited with {process.returncode}"
    raise AnchorError(
        f"ssh -R {what} before its forward was set up; its log ends:\n{_log_tail(log_path)}"
    )


# --- measurements ----------------------------------------------------------------------------


def tcp_opener(port: int, host: str = "127.0.0.1") -> OpenStream:
    """An `OpenStream` that connects straight to `host`:`port` over TCP."""

    async def open_stream(first: bytes = b"") -> trio.abc.Stream:
        stream = await trio.open_tcp_stream(host, port)
        if first:
            await stream.send_all(first)
        return stream

    return open_stream


async def receive_exactly(stream: trio.abc.ReceiveStream, count: int) -> bytes:
    """The next `count` bytes of `stream`; `SinkProtocolError` if it ends first."""
    received = bytearray()
    while len(received) < count:
        chunk = await stream.receive_some(count - len(received))
        if not chunk:
            raise SinkProtocolError(f"stream ended after {len(received)} of {count} bytes")
        received += chunk
    return bytes(received)


def _shares(total_bytes: int, streams: int) -> list[int]:
    if streams < 1:
        raise ValueError(f"streams is {streams}; measure with at least 1 stream")
    if total_bytes < streams:
        raise ValueError(f"total_bytes is {total_bytes}; give each of {streams} streams a byte")
    share, extra = divmod(total_bytes, streams)
    return [share + (1 if index < extra else 0) for index in range(streams)]


async def _open_all(
    stack: AsyncExitStack, open_stream: OpenStream, count: int
) -> list[trio.abc.Stream]:
    return [await stack.enter_async_context(await open_stream()) for _ in range(count)]


async def _upload_one(stream: trio.abc.Stream, count: int, payload: memoryview) -> None:
    await stream.send_all(b"S" + _LENGTH.pack(count))
    remaining = count
    while remaining:
        size = min(remaining, len(payload))
        await stream.send_all(payload[:size])
        remaining -= size
    ack = await receive_exactly(stream, 1)
    if ack != b"K":
        raise SinkProtocolError(f"sink acknowledged {count} bytes with {ack!r} instead of b'K'")


async def measure_upload(
    open_stream: OpenStream, *, streams: int, total_bytes: int, chunk_bytes: int = 1 << 20
) -> float:
    """MB/s (10**6 bytes) client to sink over `streams` parallel streams sharing `total_bytes`,
    from the first byte sent to the last stream's acknowledgement that all its bytes arrived.
    """
    shares = _shares(total_bytes, streams)
    payload = memoryview(os.urandom(chunk_bytes))  # incompressible, like the data users move
    async with AsyncExitStack() as stack:
        opened = await _open_all(stack, open_stream, streams)
        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for stream, share in zip(opened, shares, strict=True):
                nursery.start_soon(_upload_one, stream, share, payload)
        elapsed = time.perf_counter() - started
    return total_bytes / elapsed / 1e6


async def _download_one(stream: trio.abc.Stream, count: int, chunk_bytes: int) -> float:
    await stream.send_all(b"R" + _LENGTH.pack(count))
    remaining = count
    while remaining > 0:
        chunk = await stream.receive_some(chunk_bytes)
        if not chunk:
            raise SinkProtocolError(f"source ended {remaining} bytes short of {count}")
        remaining -= len(chunk)
    finished = time.perf_counter()
    if remaining < 0 or await stream.receive_some(1):
        raise SinkProtocolError(f"source sent more than the {count} bytes asked for")
    return finished


async def measure_download(
    open_stream: OpenStream, *, streams: int, total_bytes: int, chunk_bytes: int = 1 << 20
) -> float:
    """MB/s (10**6 bytes) sink to client over `streams` parallel streams sharing `total_bytes`,
    from the requests sent to the last byte received.
    """
    shares = _shares(total_bytes, streams)
    finished: list[float] = []

    async def download(stream: trio.abc.Stream, share: int) -> None:
        finished.append(await _download_one(stream, share, chunk_bytes))

    async with AsyncExitStack() as stack:
        opened = await _open_all(stack, open_stream, streams)
        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for stream, share in zip(opened, shares, strict=True):
                nursery.start_soon(download, stream, share)
    return total_bytes / (max(finished) - started) / 1e6


async def _exchange(stream: trio.abc.Stream, message: bytes) -> None:
    await stream.send_all(message)
    echoed = await receive_exactly(stream, len(message))
    if echoed != message:
        raise SinkProtocolError(f"echo of {len(message)} bytes came back altered")


async def measure_round_trips(
    open_stream: OpenStream, *, count: int, message_bytes: int = 64
) -> list[float]:
    """Seconds per exchange (send `message_bytes`, receive them back) for `count` sequential
    exchanges on one echo stream, after one untimed exchange that lets the path finish opening.
    """
    message = os.urandom(message_bytes)
    samples: list[float] = []
    async with await open_stream() as stream:
        await stream.send_all(b"E")
        await _exchange(stream, message)
        for _ in range(count):
            started = time.perf_counter()
            await _exchange(stream, message)
            samples.append(time.perf_counter() - started)
    return samples


async def measure_stream(
    open_stream: OpenStream, *, count: int, message_bytes: int = 64, rate_hz: float = 1000.0
) -> list[float]:
    """Seconds from each message's slot in the schedule to receiving its echo, for `count`
    messages of `message_bytes` sent at `rate_hz` on one echo stream without waiting for the
    echoes: a token stream's or a terminal's pace, data moving both ways at once. One untimed
    exchange first.

    A message the sender reaches late is timed from when it was due, not from when the sender
    got to send it: a sender held up (a full window, a stalled path) sends late, and timing from
    the late send would leave the stall out of every sample (coordinated omission), so the p99
    would not show it. A message the sender waited for is timed from when its wait ended: the
    event loop's timer wakes up to a millisecond after the slot (epoll counts milliseconds),
    which is the benchmark's clock, not the path, and would add the same ~0.5 ms to every path.
    """
    message = os.urandom(message_bytes)
    samples: list[float] = []
    async with await open_stream() as stream:
        await stream.send_all(b"E")
        await _exchange(stream, message)
        # trio's clock: perf_counter's in a real run, and a test's mock clock in a test.
        start = trio.current_time()
        due = [start + index / rate_hz for index in range(count)]
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                for index, when in enumerate(due):
                    if trio.current_time() < when:
                        await trio.sleep_until(when)
                        due[index] = trio.current_time()
                    await stream.send_all(message)

            nursery.start_soon(send)
            for index in range(count):
                echoed = await receive_exactly(stream, message_bytes)
                samples.append(trio.current_time() - due[index])
                if echoed != message:
                    raise SinkProtocolError("the echo of a streamed message differs from it")
    return samples


async def measure_connects(
    open_stream: OpenStream, *, count: int, message_bytes: int = 64, early: bool = False
) -> list[float]:
    """Seconds from asking for a new stream to the end of its first echo exchange, `count` times,
    one stream after another; closing a stream is not timed. `early`: the first message goes
    with the opening (`OpenStream`'s `first`), not after the stream is there.
    """
    message = os.urandom(message_bytes)
    samples: list[float] = []
    for _ in range(count):
        started = time.perf_counter()
        async with await open_stream(b"E" + message if early else b"") as stream:
            if not early:
                await stream.send_all(b"E" + message)
            echoed = await receive_exactly(stream, message_bytes)
            samples.append(time.perf_counter() - started)
        if echoed != message:
            raise SinkProtocolError(f"echo of {message_bytes} bytes came back altered")
    return samples


def percentile(samples: Sequence[float], p: float) -> float:
    """The `p`-th percentile (0-100) of `samples`, interpolating linearly between ranks."""
    if not samples:
        raise ValueError("samples is empty; measure at least once")
    if not 0 <= p <= 100:
        raise ValueError(f"p is {p}; give a percentile from 0 to 100")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# --- a whole path, and the anchors -----------------------------------------------------------


@attrs.frozen
class Plan:
    """How much to measure on each path."""

    total_bytes: int
    stream_counts: tuple[int, ...]
    round_trips: int
    connects: int
    chunk_bytes: int = 1 << 20
    message_bytes: int = 64
    stream_messages: int = 1000
    """Messages of `measure_stream`, at 1 kHz: a second per path and repeat."""


QUICK_PLAN = Plan(total_bytes=1 << 30, stream_counts=(1, 8), round_trips=2000, connects=50)
FULL_PLAN = Plan(total_bytes=4 << 30, stream_counts=(1, 8), round_trips=20000, connects=200)

ANCHOR_PATHS = ("direct", "ssh_R")
"""The prefixes of `measure_anchors`' keys: ``direct.rtt_p50_us``, ``ssh_R.rtt_p50_us``, ..."""


async def measure_path(open_stream: OpenStream, plan: Plan) -> dict[str, float]:
    """Every measurement of `plan` over one path, keyed by figure name with its unit, e.g.
    ``upload_8_streams_MBps``, ``rtt_p99_us``, ``connect_p50_ms``; the same keys for every path,
    so ours divided by an anchor's is a ratio.
    """
    figures: dict[str, float] = {}
    for streams in plan.stream_counts:
        figures[f"upload_{streams}_streams_MBps"] = await measure_upload(
            open_stream,
            streams=streams,
            total_bytes=plan.total_bytes,
            chunk_bytes=plan.chunk_bytes,
        )
    for streams in plan.stream_counts:
        figures[f"download_{streams}_streams_MBps"] = await measure_download(
            open_stream,
            streams=streams,
            total_bytes=plan.total_bytes,
            chunk_bytes=plan.chunk_bytes,
        )
    rtts = await measure_round_trips(
        open_stream, count=plan.round_trips, message_bytes=plan.message_bytes
    )
    figures["rtt_p50_us"] = percentile(rtts, 50) * 1e6
    figures["rtt_p99_us"] = percentile(rtts, 99) * 1e6
    connects = await measure_connects(
        open_stream, count=plan.connects, message_bytes=plan.message_bytes
    )
    figures["connect_p50_ms"] = percentile(connects, 50) * 1e3
    figures["connect_p99_ms"] = percentile(connects, 99) * 1e3
    return figures


async def measure_anchors(sink_port: int, workdir: Path, plan: Plan) -> dict[str, float]:
    """`measure_path` over direct TCP and over ``ssh -R`` to the sink at `sink_port`, one after
    the other so they do not share the CPU; keys are prefixed with `ANCHOR_PATHS`.
    """
    direct = await measure_path(tcp_opener(sink_port), plan)
    async with open_sshd(workdir) as sshd, open_ssh_reverse_tunnel(sshd, sink_port) as public:
        ssh_r = await measure_path(tcp_opener(public), plan)
    return {f"direct.{k}": v for k, v in direct.items()} | {
        f"ssh_R.{k}": v for k, v in ssh_r.items()
    }


async def _measure(workdir: Path, plan: Plan) -> dict[str, float]:
    async with open_sink_process() as sink_port:
        return await measure_anchors(sink_port, workdir, plan)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.anchors",
        description="Measure the tunnel benchmark's anchors alone: direct TCP and ssh -R.",
    )
    parser.add_argument("--quick", action="store_true", help=f"measure less: {QUICK_PLAN}")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here")
    args = parser.parse_args(argv)
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    with tempfile.TemporaryDirectory(prefix="levers9-anchors-") as workdir:
        anchors = trio.run(_measure, Path(workdir), plan)
    names = [key.removeprefix("direct.") for key in anchors if key.startswith("direct.")]
    rows = [
        (name, *(f"{anchors[f'{path}.{name}']:.1f}" for path in ANCHOR_PATHS)) for name in names
    ]
    print(render_table(rows, ("figure", "direct TCP", "ssh -R")))
    if args.json:
        write_report(args.json, figures={}, ratios={}, anchors=anchors)


if __name__ == "__main__":
    main()
