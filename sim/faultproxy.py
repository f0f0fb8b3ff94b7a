"""A TCP proxy on loopback that a fault campaign can cut and stall: the network path between two
parts of the simulated installation, made breakable on command.

Why it exists: the loopback installation's parts (workers and controlplane replicas, agents and
the registry) reach each other over loopback, which never drops, stalls or half-delivers. The
faults a real network brings (a path that drops every connection at once, one that holds bytes
for a while and then delivers them, a registry that stops sending mid-blob) only show when
something in between can bring them on. A `FaultProxy` sits in such a path; each accepted
connection goes to the next backend that accepts it, round robin, as kube-proxy spreads a
Service's connections (so `sim.replicas.LoopbackService` is one).

The design choice: what may pass is decided by `Faults`, a plain synchronous object (no sockets,
no clock) that answers, for one direction of one connection, how many bytes of the chunk in hand
may go now; it is unit-tested directly. The trio layer only reads a chunk, sends what `Faults`
admits and waits for the next change of the faults for the rest. A held stream keeps at most
the one chunk it read (`CHUNK_BYTES`) plus what the kernel's socket buffers hold, and reads
nothing more until it moves again.

The proxy is driven from the trio thread that runs it (its methods are not thread-safe).
"""

from __future__ import annotations

import socket
import struct

import attrs
import trio

__all__ = ["CHUNK_BYTES", "FaultProxy", "Faults", "Meter"]

CHUNK_BYTES = 64 * 1024
"""The most one read takes from a socket: the bound on what a held stream keeps in memory."""


@attrs.define(eq=False)
class Meter:
    """One direction of one connection, as `Faults` counts it."""

    downstream: bool
    """Backend → client (what `stall_after` counts)."""
    carried: int = 0
    """Bytes passed since the `stall_after` numbered `armed_in` was armed."""
    armed_in: int = -1
    held_in: int | None = None
    """The `resume` count at which `stall_after` stopped this stream: it moves again at the
    next `resume`."""


@attrs.define
class Faults:
    """What the proxy lets through now (sans-IO): `admit` says how many bytes of a chunk may
    pass on one stream, and counts them.

    `stall()` holds every stream until `resume()`. `stall_after(n)` arms a one-shot: the first
    backend → client stream to carry more than `n` bytes from then on (counted from the arming,
    or from the stream's start if later) passes exactly `n` and is held until `resume()`.
    `resume()` ends every fault: the stall, a held stream, and a `stall_after` still armed.
    """

    stalled: bool = False
    armed_bytes: int | None = None
    """`stall_after`'s byte count, until a stream takes it."""
    armings: int = 0
    """How many times `stall_after` was called: a stream's count starts afresh with each."""
    resumes: int = 0
    """How many times `resume` was called: a stream held by `stall_after` moves at the next."""

    def stall(self) -> None:
        self.stalled = True

    def resume(self) -> None:
        self.stalled = False
        self.armed_bytes = None
        self.resumes += 1

    def stall_after(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"stall_after: nbytes must be 0 or more bytes, got {nbytes}")
        self.armed_bytes = nbytes
        self.armings += 1

    def holds(self, meter: Meter) -> bool:
        """Whether the stream may move nothing now (its end of stream included)."""
        return self.stalled or meter.held_in == self.resumes

    def admit(self, meter: Meter, size: int) -> int:
        """How many of the next `size` bytes of the stream may pass now (0: wait for the next
        change); counts them as passed."""
        if self.holds(meter):
            return 0
        if not meter.downstream or self.armed_bytes is None:
            return size
        if meter.armed_in != self.armings:
            meter.armed_in, meter.carried = self.armings, 0
        room = self.armed_bytes - meter.carried
        if size <= room:
            meter.carried += size
            return size
        # This stream carries more than the armed count: it takes the one-shot.
        meter.carried += room
        meter.held_in = self.resumes
        self.armed_bytes = None
        return room


def _reset(stream: trio.SocketStream) -> None:
    """Close at once with a RST, as a dropped path shows to the peer (SO_LINGER 0)."""
    try:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:  # already closed or never connected: close is all there is to do
        pass
    stream.socket.close()


@attrs.define(eq=False)
class _Connection:
    client: trio.SocketStream
    upstream: trio.SocketStream
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)

    def abort(self) -> None:
        """Both sides reset and the pumps ended; safe to call twice."""
        _reset(self.client)
        _reset(self.upstream)
        self.scope.cancel()


@attrs.define(eq=False)
class FaultProxy:
    """Forwards each TCP connection accepted on 127.0.0.1:port to a backend (round robin over
    `backends`, skipping one that refuses, as a Service's kube-proxy does)."""

    backends: list[int]
    """Ports of 127.0.0.1 backends; may be changed at any time (new connections follow)."""
    port: int = attrs.field(default=0, kw_only=True)
    """The listening port (0 before `start` when the kernel is to pick one)."""
    connections: int = attrs.field(default=0, init=False)
    """Connections forwarded so far."""
    _faults: Faults = attrs.field(factory=Faults, init=False, repr=False)
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False, repr=False)
    _open: set[_Connection] = attrs.field(factory=set, init=False, repr=False)
    _next: int = attrs.field(default=0, init=False, repr=False)

    # -- serving

    async def start(self, nursery: trio.Nursery) -> int:
        """Listens, runs in `nursery` until it is cancelled, and returns the port."""
        port: int = await nursery.start(self.run)
        return port

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listens (`task_status.started(port)`) and forwards until cancelled; open connections
        are closed on the way out."""
        listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
        self.port = int(listeners[0].socket.getsockname()[1])
        task_status.started(self.port)
        await trio.serve_listeners(self._forward, listeners)

    # -- faults

    def cut(self) -> int:
        """Resets every open forwarded connection at once, both sides, as a path that dropped;
        returns how many. New connections are forwarded as before."""
        dropped = list(self._open)
        self._open.clear()
        for connection in dropped:
            connection.abort()
        return len(dropped)

    def stall(self) -> None:
        """From now on no byte moves either way on any connection, open or new (new ones are
        still accepted and connected), until `resume()`; bytes are held, not lost."""
        self._faults.stall()
        self._wake()

    def resume(self) -> None:
        """Ends the stall and any `stall_after`, held or still armed: everything held moves."""
        self._faults.resume()
        self._wake()

    def stall_after(self, nbytes: int) -> None:
        """The next backend → client stream to carry more than `nbytes` in one connection
        (counted from now) passes exactly `nbytes`, then stops until `resume()`."""
        self._faults.stall_after(nbytes)
        self._wake()

    @property
    def open_connections(self) -> int:
        return len(self._open)

    # -- forwarding

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _connect(self) -> trio.SocketStream | None:
        backends = list(self.backends)  # it may change while we connect
        count = len(backends)
        for offset in range(count):
            backend = backends[(self._next + offset) % count]
            try:
                upstream = await trio.open_tcp_stream("127.0.0.1", backend)
            except OSError:
                continue
            self._next = (self._next + offset + 1) % count
            return upstream
        return None

    async def _forward(self, client: trio.SocketStream) -> None:
        async with client:
            upstream = await self._connect()
            if upstream is None:
                # No backend takes it: the client sees a reset, as a refused connection.
                _reset(client)
                return
            connection = _Connection(client, upstream)
            self.connections += 1
            self._open.add(connection)
            try:
                async with upstream:
                    with connection.scope:
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(self._pump, connection, Meter(downstream=False))
                            nursery.start_soon(self._pump, connection, Meter(downstream=True))
            finally:
                self._open.discard(connection)

    async def _pump(self, connection: _Connection, meter: Meter) -> None:
        """One direction: bytes as `Faults` admits them, then the end of stream (half-close).
        A reset on either side resets the whole connection, as it would end to end."""
        source, sink = (
            (connection.upstream, connection.client)
            if meter.downstream
            else (connection.client, connection.upstream)
        )
        try:
            while chunk := await source.receive_some(CHUNK_BYTES):
                view = memoryview(chunk)
                while view:
                    passed = self._faults.admit(meter, len(view))
                    if not passed:
                        await self._changed.wait()
                        continue
                    await sink.send_all(view[:passed])
                    view = view[passed:]
            while self._faults.holds(meter):
                await self._changed.wait()
            await sink.send_eof()
        except trio.ClosedResourceError:
            return  # cut, or the other direction reset the connection
        except (trio.BrokenResourceError, OSError):
            connection.abort()
