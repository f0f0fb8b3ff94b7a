"""The far end of every benchmarked path: a small TCP service in its own process.

Every path under test (direct TCP, ``ssh -R``, our tunnel) ends at this same separate process, so
what differs between their figures is the path. It uses blocking sockets and one thread per
connection: each ``recv_into``/``sendall`` releases the GIL and moves up to 1 MiB from or into a
buffer allocated once, so it spends little CPU per byte and is not what limits a benchmark.

Protocol, per connection; the first byte picks the mode:

- ``S`` then N as 8 bytes big-endian: read exactly N bytes, then reply ``K`` (client to server).
- ``R`` then N as 8 bytes big-endian: send N bytes, then close (server to client).
- ``E``: send every received chunk back until EOF (round trips).

Anything else closes the connection. ``python -m bench.sink`` listens on 127.0.0.1 on a port the
kernel picks and prints ``PORT <n>`` as its first line of stdout. When its stdin is a pipe it exits
at that pipe's EOF, so it never outlives the process that spawned it, however that process ends.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import sys
import threading

BUFFER_BYTES = 1 << 20
ECHO_BUFFER_BYTES = 64 << 10
LENGTH = struct.Struct(">Q")

SINK = b"S"
SOURCE = b"R"
ECHO = b"E"
ACK = b"K"

# Sent by every source connection; its content matters only in that it is not compressible.
_SOURCE_DATA = memoryview(os.urandom(BUFFER_BYTES))


def _receive_exactly(sock: socket.socket, count: int) -> bytes | None:
    """The next `count` bytes, or None if the peer closed first."""
    buffer = bytearray(count)
    view = memoryview(buffer)
    received = 0
    while received < count:
        got = sock.recv_into(view[received:])
        if got == 0:
            return None
        received += got
    return bytes(buffer)


def _sink(sock: socket.socket, count: int) -> None:
    buffer = memoryview(bytearray(BUFFER_BYTES))
    remaining = count
    while remaining:
        # Never read past N: bytes after it are not ours to swallow.
        got = sock.recv_into(buffer[: min(remaining, BUFFER_BYTES)])
        if got == 0:
            return  # the peer gave up early: no ack, so it cannot mistake this for success
        remaining -= got
    sock.sendall(ACK)


def _source(sock: socket.socket, count: int) -> None:
    remaining = count
    while remaining:
        size = min(remaining, BUFFER_BYTES)
        sock.sendall(_SOURCE_DATA[:size])
        remaining -= size
    sock.shutdown(socket.SHUT_WR)


def _echo(sock: socket.socket) -> None:
    buffer = memoryview(bytearray(ECHO_BUFFER_BYTES))
    while got := sock.recv_into(buffer):
        sock.sendall(buffer[:got])


def _serve(sock: socket.socket) -> None:
    with sock:
        try:
            mode = _receive_exactly(sock, 1)
            if mode == ECHO:
                _echo(sock)
            elif mode in (SINK, SOURCE):
                header = _receive_exactly(sock, LENGTH.size)
                if header is None:
                    return
                (count,) = LENGTH.unpack(header)
                if mode == SINK:
                    _sink(sock, count)
                else:
                    _source(sock, count)
        except OSError:
            pass  # a peer that resets its connection ends only that connection


def _exit_at_stdin_eof() -> None:
    while os.read(0, 4096):
        pass
    os._exit(0)


def _stdin_is_pipe() -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(0).st_mode)
    except OSError:
        return False


def main() -> None:
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    if _stdin_is_pipe():
        threading.Thread(target=_exit_at_stdin_eof, name="stdin-eof", daemon=True).start()
    print(f"PORT {listener.getsockname()[1]}", flush=True)
    try:
        while True:
            sock, _ = listener.accept()
            # Echo replies are small writes that must leave at once.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_serve, args=(sock,), daemon=True).start()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
