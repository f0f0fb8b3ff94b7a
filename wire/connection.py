"""The thin trio layer that runs an `Http2Protocol` over any trio Stream.

Both ends of the worker API use it: the agent as the HTTP/2 server (over its TLS listener in
direct mode, inside the WebSocket it dialed in tunnel mode) and the controlplane as the client.
One reader task per connection feeds the protocol and hands events to per-stream objects; it
never waits on a consumer, so a slow reader stalls only its own stream. One task writes at a
time (a `trio.StrictFIFOLock`), and it writes until h2 has nothing queued: a stream whose small
frames find a write in progress leaves them to it and goes on, with no lock to wait for and no
second write. Received bytes are acknowledged to
the peer (WINDOW_UPDATE) only when the stream's consumer has read them, so what one stream
buffers is bounded by its window and what the connection buffers by the connection window.

Liveness: the connection PINGs its peer every `ping_interval_s` and declares the peer dead when
a PING stays unanswered for `ping_timeout_s`. A GOAWAY drain (`drain()`) lets streams in flight
finish while new ones go elsewhere.

A server connection may also bound how long it waits for its peer: `first_request_timeout_s`
from the start to the first request's HEADERS (a PING or SETTINGS does not count, so a
slowloris that only keeps the connection busy is closed), and, after that, `idle_timeout_s`
with no stream open and nothing received (a PING counts: the controlplane's pooled connections
to direct workers and `levers9 port` keep theirs alive that way). Either ends in a GOAWAY
drain and a close.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import operator
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager

import attrs
import h2.errors
import h2.events
import h2.exceptions
import trio

from wire.http2 import Http2Protocol, Http2Settings, ProtocolViolation
from wire.parts import send_parts
from wire.untrusted import clip

log = logging.getLogger("levers9.http2")

Headers = list[tuple[bytes, bytes]]
READ_BYTES = 1024 * 1024


class StreamError(trio.BrokenResourceError):
    """A stream can no longer be used."""


class StreamReset(StreamError):
    """The peer (or we) reset the stream; `error_code` says why."""

    def __init__(self, stream_id: int, error_code: int, *, by_peer: bool = True) -> None:
        who = "peer" if by_peer else "we"
        try:
            name = h2.errors.ErrorCodes(error_code).name
        except ValueError:
            name = str(error_code)
        super().__init__(f"stream {stream_id} was reset ({who}, {name})")
        self.stream_id = stream_id
        self.error_code = error_code


class ConnectionLost(StreamError):
    """The HTTP/2 connection under the stream is gone."""


class BodyTooLarge(StreamError):
    """A body went past the limit its reader set; the stream was reset (CANCEL) unless the
    reader asked to answer first (`H2Stream.read_all(reset=False)`)."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"body larger than {limit_bytes} bytes")
        self.limit_bytes = limit_bytes


class StreamRefused(ConnectionLost):
    """The peer never processed the stream (GOAWAY or REFUSED_STREAM); it is safe to retry."""


@attrs.frozen
class KeepaliveConfig:
    """PING-based liveness: a peer silent for ping_timeout_s after a PING is declared dead."""

    ping_interval_s: float = 15.0
    ping_timeout_s: float = 15.0


@attrs.frozen
class ConnectionStatistics:
    open_streams: int
    streams_opened: int
    bytes_buffered: int
    draining: bool
    closed: bool
    last_rtt_s: float | None


def header_value(headers: Headers, name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


WRITES_PER_TURN = 4
"""Writes a stream's task makes for the connection in one turn before it leaves the rest to the
connection's own flush (`Http2Connection._write_queued`)."""

COALESCE_BELOW_BYTES = 16 * 1024
"""A stream's flush of fewer queued bytes than this, on a connection with other streams open,
first lets those streams queue theirs, so small answers share a write; a bulk transfer's writes,
already large, go at once (waiting to gather several would only make them burstier)."""


class H2Stream:
    """One HTTP/2 stream: headers, a flow-controlled body in each direction, trailers."""

    def __init__(self, conn: Http2Connection, stream_id: int) -> None:
        self._conn = conn
        self.stream_id = stream_id
        self.headers: Headers | None = None
        self.trailers: Headers | None = None
        self._chunks: collections.deque[tuple[bytes, int]] = collections.deque()
        self._taken = 0
        """Bytes of the first chunk already returned: a reader asking for less than a chunk
        gets slices of it; the rest is not copied again at each read."""
        self._buffered = 0
        self._eof = False
        self._error: BaseException | None = None
        self._readable = trio.lowlevel.ParkingLot()
        self._headers_lot = trio.lowlevel.ParkingLot()
        self._window_lot = trio.lowlevel.ParkingLot()
        self._failed_lot = trio.lowlevel.ParkingLot()
        self._sent_end = False
        self.sent_headers = False
        self._receiving = False
        self._sending = False

    # -- called by the connection's reader task (synchronous, never block) --

    def _on_headers(self, headers: Headers) -> None:
        if self.headers is None:
            self.headers = headers
        else:
            self.trailers = headers
        self._headers_lot.unpark_all()

    def _on_data(self, data: bytes, flow_length: int) -> None:
        if self._error is not None or self._eof:
            self._conn._proto.acknowledge(self.stream_id, flow_length)
            return
        self._chunks.append((data, flow_length))
        self._buffered += len(data)
        self._readable.unpark_all()

    def _on_end(self) -> None:
        self._eof = True
        self._readable.unpark_all()
        self._headers_lot.unpark_all()

    def _on_window(self) -> None:
        self._window_lot.unpark_all()

    def _fail(self, exc: BaseException, *, discard: bool = False) -> None:
        if self._error is None:
            self._error = exc
        # A body the peer ended is complete and stays readable (a reset or a lost connection
        # after END_STREAM must not truncate it); one that never will be is dropped.
        if discard or not self._eof:
            self._discard()
        self._readable.unpark_all()
        self._headers_lot.unpark_all()
        self._window_lot.unpark_all()
        self._failed_lot.unpark_all()

    def _discard(self) -> None:
        """Drop unread body bytes, giving their window back to the peer."""
        # Acknowledged even after END_STREAM: the connection window counts them too.
        dropped = sum(flow for _, flow in self._chunks)
        if self._taken:
            data, flow = self._chunks[0]
            dropped -= flow - len(data) + self._taken  # acknowledged as it was read
            self._taken = 0
        self._chunks.clear()
        self._buffered = 0
        if dropped:
            self._conn._proto.acknowledge(self.stream_id, dropped)

    # -- the consumer's side --

    @property
    def ended(self) -> bool:
        """True once the peer has ended its side and everything has been read."""
        return self._eof and not self._chunks

    async def wait_failed(self) -> BaseException:
        """Until the stream is reset (by either side) or its connection is lost, even after
        its body has ended: what a relay watches to pass a reset on."""
        while self._error is None:
            await self._failed_lot.park()
        return self._error

    async def wait_headers(self) -> Headers:
        while self.headers is None:
            if self._error is not None:
                raise self._error
            if self._eof:
                raise StreamError(f"stream {self.stream_id} ended without headers")
            await self._headers_lot.park()
        return self.headers

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Next body bytes; b"" once the peer ended its side. Acknowledges what is returned."""
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this stream")
        self._receiving = True
        try:
            parked = False
            while not self._chunks:
                if self._error is not None and not self._eof:
                    raise self._error
                if self._eof:
                    if not parked:
                        await trio.lowlevel.checkpoint()
                    return b""
                await self._readable.park()
                parked = True
            chunk, flow = self._chunks[0]
            taken = self._taken
            # Padding (flow - len(chunk)) is acknowledged with the first piece.
            padding = 0 if taken else flow - len(chunk)
            if max_bytes is not None and len(chunk) - taken > max_bytes:
                self._taken = taken + max_bytes
                data = chunk[taken : self._taken]
            else:
                self._chunks.popleft()
                self._taken = 0
                data = chunk[taken:] if taken else chunk
            acked = len(data) + padding
            self._buffered -= len(data)
            self._conn._proto.acknowledge(self.stream_id, acked)
            if self._conn._proto.has_data_to_send():
                await self._conn._flush()  # the WINDOW_UPDATE; a scheduler pass
            elif not parked:
                await trio.lowlevel.checkpoint()
            # (Otherwise waiting was this call's checkpoint.)
            return data
        finally:
            self._receiving = False

    async def read_all(self, limit_bytes: int, *, reset: bool = True) -> bytes:
        """The rest of the body, refusing one larger than `limit_bytes`. `reset=False` leaves
        the stream open when it refuses: a server answers first (400 naming the limit), then
        the rest is reset with NO_ERROR (RFC 9113 8.1) once its handler is done."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.receive_some():
            size += len(chunk)
            if size > limit_bytes:
                if reset:
                    await self.reset(h2.errors.ErrorCodes.CANCEL)
                raise BodyTooLarge(limit_bytes)
            parts.append(chunk)
        return b"".join(parts)

    async def send_headers(
        self, headers: Headers, *, end_stream: bool = False, flush: bool = True
    ) -> None:
        """Send the headers (or trailers). With ``flush=False`` they wait for the body's first
        bytes (`send_data` or `end` right after), so a whole small response is one write."""
        self._check_send()
        with self._conn._h2_errors(self):
            self._conn._proto.send_headers(self.stream_id, headers, end_stream=end_stream)
        self.sent_headers = True
        if end_stream:
            self._sent_end = True
            self._conn._settle(self)
        if flush or end_stream:
            await self._conn._flush(gather=True)
        else:
            await trio.lowlevel.checkpoint_if_cancelled()

    async def send_data(self, data: bytes, *, end_stream: bool = False) -> None:
        """Send body bytes, waiting for flow-control window as needed."""
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this stream")
        self._sending = True
        try:
            self._check_send()
            proto = self._conn._proto
            view = memoryview(data)
            while len(view) > 0:
                window = proto.send_window(self.stream_id)
                if window <= 0:
                    if self._error is not None:
                        raise self._error
                    if self._conn._proto.has_data_to_send():
                        # Headers queued without a flush go out before we wait; the window
                        # may open meanwhile, so it is looked at again before parking.
                        await self._conn._flush()
                        self._check_send()
                        continue
                    self._conn._blocked.add(self)
                    try:
                        await self._window_lot.park()
                    finally:
                        self._conn._blocked.discard(self)
                    self._check_send()
                    continue
                frame = proto.max_outbound_frame_bytes
                burst = min(window, len(view), 4 * frame)
                piece, view = view[:burst], view[burst:]
                with self._conn._h2_errors(self):
                    # The whole body in one call: a bytes object of one frame is queued uncopied.
                    whole = burst == len(data) and isinstance(data, bytes)
                    proto.send_data(
                        self.stream_id,
                        data if whole else piece,
                        end_stream=end_stream and len(view) == 0,
                    )
                if end_stream and len(view) == 0:
                    self._sent_end = True
                    self._conn._settle(self)
                await self._conn._flush(gather=True)
            if end_stream and not self._sent_end:
                await self.end()
        finally:
            self._sending = False

    async def end(self) -> None:
        """End our side of the stream (END_STREAM)."""
        if self._sent_end:
            await trio.lowlevel.checkpoint()
            return
        self._check_send()
        with self._conn._h2_errors(self):
            self._conn._proto.end_stream(self.stream_id)
        self._sent_end = True
        self._conn._settle(self)
        await self._conn._flush(gather=True)

    async def send_trailers(self, headers: Headers) -> None:
        await self.send_headers(headers, end_stream=True)

    async def reset(self, error_code: int = h2.errors.ErrorCodes.CANCEL) -> None:
        """Abort the stream in both directions; safe to call more than once."""
        if self._error is None:
            self._fail(StreamReset(self.stream_id, error_code, by_peer=False), discard=True)
            try:
                self._conn._proto.reset_stream(self.stream_id, error_code)
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError, KeyError):
                pass
        try:
            await self._conn._flush()
        except trio.BrokenResourceError:
            pass

    def _check_send(self) -> None:
        if self._error is not None:
            raise self._error
        if self._sent_end:
            raise trio.ClosedResourceError(f"stream {self.stream_id} already ended our side")

    @property
    def buffered_bytes(self) -> int:
        return self._buffered


class H2ByteStream(trio.abc.HalfCloseableStream):
    """A CONNECT (or extended CONNECT) stream seen as a plain two-way byte stream."""

    def __init__(self, stream: H2Stream) -> None:
        self.stream = stream
        self._closed = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError("stream is closed")
        if not data:
            await trio.lowlevel.checkpoint()
            if self.stream._sent_end:
                raise trio.ClosedResourceError("send side already closed")
            return
        try:
            await self.stream.send_data(data if isinstance(data, bytes) else bytes(data))
        except trio.ClosedResourceError:
            raise
        except StreamError as exc:
            raise trio.BrokenResourceError(str(exc)) from exc

    async def wait_send_all_might_not_block(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("stream is closed")
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("stream is closed")
        try:
            await self.stream.end()
        except StreamError as exc:
            raise trio.BrokenResourceError(str(exc)) from exc

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._closed:
            raise trio.ClosedResourceError("stream is closed")
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)  # a float would park for ever, not raise
            if max_bytes < 1:
                raise ValueError("max_bytes must be >= 1")
        try:
            data = await self.stream.receive_some(max_bytes)
        except trio.BusyResourceError:
            raise
        except StreamError as exc:
            if self._closed:
                raise trio.ClosedResourceError("stream is closed") from None
            raise trio.BrokenResourceError(str(exc)) from exc
        if self._closed:
            raise trio.ClosedResourceError("stream is closed")
        return data

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        stream = self.stream
        # Nobody reads after a close: what is still buffered gives its window back.
        stream._discard()
        if stream._error is None and not stream._sent_end:
            # Our side ends cleanly, as closing a socket does: what we sent arrives, then EOF.
            # (Queued now, so a cancelled aclose still closes.)
            with contextlib.suppress(h2.exceptions.ProtocolError):
                stream._conn._proto.end_stream(stream.stream_id)
            stream._sent_end = True
            stream._conn._settle(stream)
        if stream._error is None and not stream._eof:
            # We will read no more: reset it so the peer stops sending and no window stays
            # held. It arrives after our END_STREAM, so the peer keeps what we sent.
            await stream.reset(h2.errors.ErrorCodes.CANCEL)
        elif stream._conn._proto.has_data_to_send():
            try:
                await stream._conn._flush()
            except trio.BrokenResourceError:
                pass
        else:
            await trio.lowlevel.checkpoint()
        stream._readable.unpark_all()
        stream._window_lot.unpark_all()


RequestHandler = Callable[["H2Stream"], Awaitable[None]]


class Http2Connection:
    """Runs one HTTP/2 connection (either role) over a trio Stream."""

    def __init__(
        self,
        transport: trio.abc.Stream,
        *,
        client_side: bool,
        settings: Http2Settings | None = None,
        keepalive: KeepaliveConfig | None = None,
        handler: RequestHandler | None = None,
        name: str = "",
        write_timeout_s: float = 30.0,
        first_request_timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
    ) -> None:
        if client_side and (first_request_timeout_s is not None or idle_timeout_s is not None):
            raise ValueError("first_request_timeout_s and idle_timeout_s are for the server role")
        self.transport = transport
        self._write_timeout_s = write_timeout_s
        self._first_request_timeout_s = first_request_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._last_receive = 0.0
        self.client_side = client_side
        self.name = name
        self._proto = Http2Protocol(client_side=client_side, settings=settings)
        self._keepalive = keepalive
        self._handler = handler
        self._write_lock = trio.StrictFIFOLock()
        self._streams: dict[int, H2Stream] = {}
        self._blocked: set[H2Stream] = set()
        self._closed = False
        self._close_reason: str | None = None
        self._closed_by_peer = False
        self._draining = False
        self._closed_event = trio.Event()
        self.peer_going_away = trio.Event()
        """Set when the peer sent GOAWAY: it is shutting down or draining this connection."""
        self._ready = trio.Event()
        self._opened = 0
        self._ping_ids = itertools.count(1)
        self._pings: dict[bytes, float] = {}
        self._last_rtt: float | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        """Bytes written to and read from the transport (frames and all), for metrics."""
        self.on_rtt: Callable[[float], None] | None = None
        """Told each keepalive PING's round trip, in seconds (metrics)."""
        self._settings_acked = trio.Event()
        self._handler_nursery: trio.Nursery | None = None
        self._idle_lot = trio.lowlevel.ParkingLot()
        self._ping_lot = trio.lowlevel.ParkingLot()
        self._flush_scheduled = False

    # -- lifecycle --

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the connection until it closes; handlers run in a nursery owned here.

        A connection that ends before it is ready (the peer reset it, or closed it right after
        the TLS handshake, before our preface went out) raises `ConnectionLost` to whoever
        starts it, the error every caller already retries, instead of returning without
        calling `task_status.started()` (which `nursery.start` turns into a RuntimeError).
        """
        ready = False
        try:
            async with trio.open_nursery() as nursery:
                self._handler_nursery = nursery
                self._proto.initiate()
                try:
                    await self._flush()
                    ready = True
                except trio.BrokenResourceError as exc:
                    self._mark_closed(f"transport broke before the connection was ready: {exc}")
                if ready:
                    self._ready.set()
                    task_status.started()
                    if self._keepalive is not None:
                        nursery.start_soon(self._keepalive_loop, self._keepalive)
                    if self._first_request_timeout_s or self._idle_timeout_s:
                        nursery.start_soon(self._watch_quiet)
                    await self._read_loop()
                nursery.cancel_scope.cancel()
        except trio.BrokenResourceError as exc:
            self._mark_closed(f"transport broke: {exc}")
        finally:
            self._mark_closed(self._close_reason or "connection closed")
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                try:
                    await self.transport.aclose()
                except trio.BrokenResourceError:
                    pass
        if not ready:
            raise ConnectionLost(self._close_reason or "connection closed before it was ready")

    async def _read_loop(self) -> None:
        while True:
            try:
                data = await self.transport.receive_some(READ_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._mark_closed(f"transport broke: {exc}")
                return
            if not data:
                self._closed_by_peer = True
                self._mark_closed("peer closed the connection")
                return
            self._last_receive = trio.current_time()
            self.bytes_received += len(data)
            try:
                events = self._proto.receive_data(data, trio.current_time())
            except ProtocolViolation as exc:
                # The violation may quote what the peer sent: clipped.
                log.warning(
                    "http2 connection closed: %s", clip(exc), extra={"connection": self.name}
                )
                # Send the GOAWAY first: marking the connection closed cancels its tasks.
                try:
                    await self._flush(wait=True)
                except trio.BrokenResourceError:
                    pass
                self._mark_closed(str(exc))
                return
            for event in events:
                self._dispatch(event)
            if self._proto.has_data_to_send():
                # Only when there is something to send (ACKs, WINDOW_UPDATEs): the receive
                # above was already this loop's checkpoint.
                try:
                    await self._flush()
                except trio.BrokenResourceError:
                    return
            if self._closed:
                return

    def _dispatch(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.DataReceived):
            sid = event.stream_id
            assert sid is not None
            stream = self._streams.get(sid)
            flow = event.flow_controlled_length or 0
            if stream is None:
                self._proto.acknowledge(sid, flow)
            else:
                stream._on_data(event.data or b"", flow)
        elif isinstance(event, h2.events.RequestReceived):
            self._on_request(event)
        elif isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
            headers = event.headers
            stream = self._streams.get(event.stream_id or 0)
            if stream is not None and headers is not None:
                stream._on_headers(list(headers))
        elif isinstance(event, h2.events.InformationalResponseReceived):
            pass
        elif isinstance(event, h2.events.StreamEnded):
            stream = self._streams.get(event.stream_id or 0)
            if stream is not None:
                stream._on_end()
                self._settle(stream)
        elif isinstance(event, h2.events.StreamReset):
            stream = self._streams.pop(event.stream_id or 0, None)
            if stream is not None:
                code = int(event.error_code or 0)
                exc: StreamError
                if code == h2.errors.ErrorCodes.REFUSED_STREAM:
                    exc = StreamRefused(f"peer refused stream {event.stream_id}")
                else:
                    exc = StreamReset(stream.stream_id, code, by_peer=event.remote_reset)
                stream._fail(exc)
                self._idle_lot.unpark_all()
        elif isinstance(event, h2.events.WindowUpdated):
            if event.stream_id == 0:
                for stream in list(self._blocked):
                    stream._on_window()
            else:
                stream = self._streams.get(event.stream_id or 0)
                if stream is not None:
                    stream._on_window()
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            for stream in list(self._blocked):
                stream._on_window()
        elif isinstance(event, h2.events.SettingsAcknowledged):
            self._settings_acked.set()
        elif isinstance(event, h2.events.PingAckReceived):
            sent = self._pings.pop(event.ping_data or b"", None)
            if sent is not None:
                self._last_rtt = trio.current_time() - sent
                if self.on_rtt is not None:
                    self.on_rtt(self._last_rtt)
                self._ping_lot.unpark_all()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self._on_goaway(event)

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id
        assert sid is not None
        if self._handler is None or self._handler_nursery is None or self._draining:
            self._proto.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        stream = H2Stream(self, sid)
        stream._on_headers(list(event.headers or []))
        self._streams[sid] = stream
        self._opened += 1
        self._handler_nursery.start_soon(self._run_handler, stream)

    async def _run_handler(self, stream: H2Stream) -> None:
        assert self._handler is not None
        try:
            await self._handler(stream)
        except StreamError:
            pass
        except Exception:
            # One failing handler costs its own stream (reset below), never the connection.
            log.exception(
                "handler failed on stream %d",
                stream.stream_id,
                extra={"connection": self.name, "stream": stream.stream_id},
            )
        finally:
            # The handler is done with the stream. A response it did not finish is an
            # internal error; a request body it did not read is refused (NO_ERROR, RFC 9113
            # 8.1), so the peer stops sending and no window stays held.
            try:
                if stream._error is None and not stream._sent_end:
                    await stream.reset(h2.errors.ErrorCodes.INTERNAL_ERROR)
                elif stream._error is None and not stream._eof:
                    await stream.reset(h2.errors.ErrorCodes.NO_ERROR)
            finally:
                # A complete body the handler did not read still holds connection window.
                stream._discard()
                self._streams.pop(stream.stream_id, None)
                self._idle_lot.unpark_all()

    def _settle(self, stream: H2Stream) -> None:
        """Forget a stream both sides have ended; its object keeps what is still unread."""
        if stream._sent_end and stream._eof and self._streams.get(stream.stream_id) is stream:
            del self._streams[stream.stream_id]
            self._idle_lot.unpark_all()

    def _on_goaway(self, event: h2.events.ConnectionTerminated) -> None:
        last = event.last_stream_id or 0
        self._draining = True
        self.peer_going_away.set()
        error = int(event.error_code or 0)
        for sid, stream in list(self._streams.items()):
            mine = (sid % 2 == 1) == self.client_side
            if mine and sid > last:
                stream._fail(StreamRefused(f"stream {sid} not processed: peer is going away"))
                self._streams.pop(sid, None)
        if error != h2.errors.ErrorCodes.NO_ERROR:
            try:
                name = h2.errors.ErrorCodes(error).name
            except ValueError:
                name = str(error)
            self._mark_closed(f"peer sent GOAWAY ({name})")
        self._idle_lot.unpark_all()

    def _mark_closed(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_reason = reason
        for stream in list(self._streams.values()):
            stream._fail(ConnectionLost(f"connection lost: {reason}"))
        self._streams.clear()
        self._closed_event.set()
        self._idle_lot.unpark_all()
        self._ping_lot.unpark_all()
        if self._handler_nursery is not None:
            self._handler_nursery.cancel_scope.cancel()

    async def aclose(self) -> None:
        """Close now: GOAWAY, then the transport; open streams fail with ConnectionLost."""
        if not self._closed:
            self._proto.go_away()
            try:
                await self._flush(wait=True)
            except trio.BrokenResourceError:
                pass
            self._mark_closed("closed locally")
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            try:
                await self.transport.aclose()
            except trio.BrokenResourceError:
                pass

    async def drain(self) -> None:
        """GOAWAY(NO_ERROR): streams in flight finish, no new ones start. Waits for them."""
        if not self._draining and not self._closed:
            self._draining = True
            self._proto.go_away()
            await self._flush(wait=True)
        while self._streams and not self._closed:
            await self._idle_lot.park()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def close_reason(self) -> str | None:
        return self._close_reason

    @property
    def closed_by_peer(self) -> bool:
        """The peer ended the connection cleanly (end of stream), the ordinary way to go."""
        return self._closed_by_peer

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def usable(self) -> bool:
        """True while new streams may be opened on this connection."""
        return not self._closed and not self._draining

    async def wait_closed(self) -> None:
        await self._closed_event.wait()

    def statistics(self) -> ConnectionStatistics:
        return ConnectionStatistics(
            open_streams=len(self._streams),
            streams_opened=self._opened,
            bytes_buffered=sum(s.buffered_bytes for s in self._streams.values()),
            draining=self._draining,
            closed=self._closed,
            last_rtt_s=self._last_rtt,
        )

    # -- writing --

    async def _flush(
        self, *, gather: bool = False, wait: bool = False, scheduled: bool = False
    ) -> None:
        """Send what h2 has queued. A write, once started, is never cut by cancellation (a
        half-written frame would corrupt every stream); it is bounded by the write timeout
        instead, past which the peer is taken to have stopped reading and the connection
        closes. `gather`: a stream's headers or body, which may wait one scheduler pass for
        other streams' (see `COALESCE_BELOW_BYTES`); WINDOW_UPDATEs and control frames never
        wait.

        The task that writes keeps writing until h2 holds nothing more, so a small flush that
        finds a write in progress returns at once: its frames leave with that task's next
        write. Only a flush with more than `COALESCE_BELOW_BYTES` queued waits for its turn,
        which is what holds a bulk sender to the pace of the socket, and one that must `wait`
        until its frames are on the wire (a GOAWAY before the transport closes). A flush with
        nothing queued is no scheduler pass: a caller that promises one makes its own.
        `scheduled`: the connection's own flush (`_flush_later`), which may write for as long
        as frames keep coming, and which waits for a write in progress instead of leaving its
        frames to it: that writer may be handing them back to this flush, which while it runs
        is the one `_flush_later` counts on."""
        if not self._proto.has_data_to_send():
            await trio.lowlevel.checkpoint_if_cancelled()
            return
        try:
            small = self._proto.queued_bytes() < COALESCE_BELOW_BYTES
            if self._write_lock.locked() and small and not wait and not scheduled:
                await trio.lowlevel.checkpoint()
                return
            if small and gather and len(self._streams) > 1:
                # Other streams' tasks may queue frames in this same scheduler batch (16
                # requests answered at once): let them, so that all of it leaves in this one
                # write, one TLS record and one system call where there were several. A flush
                # that finds its frames taken by another's write has nothing left to do.
                await trio.lowlevel.checkpoint()
                if not self._proto.has_data_to_send() or (self._write_lock.locked() and not wait):
                    return
            else:
                # Uncontended, the lock is taken without a trip through the scheduler: the
                # send below is this call's checkpoint.
                await trio.lowlevel.checkpoint_if_cancelled()
            try:
                self._write_lock.acquire_nowait()
            except trio.WouldBlock:
                # A bulk sender: what it queued is written by the task writing now, or by
                # this one once that is done.
                await self._write_lock.acquire()
            try:
                await self._write_queued(hand_over=not scheduled)
            finally:
                self._write_lock.release()
        except trio.Cancelled:
            # Frames a cancelled caller queued (a reset, an END_STREAM from a cancelled
            # aclose) must still go out, or the peer waits on them for ever.
            self._flush_later()
            raise

    async def _write_queued(self, *, hand_over: bool) -> None:
        """Write what h2 holds, and again what it holds after that, until nothing is left;
        called with the write lock held. Others' frames queued meanwhile go with these.

        A task that waits for the lock (a bulk sender) ends the turn: it writes what is left,
        in its order. `hand_over`: after `WRITES_PER_TURN` writes the rest is left to the
        connection's own flush, so a stream's task that happened to be writing goes back to
        its stream instead of writing for the others while they keep sending."""
        parts = self._proto.take_parts()
        if not parts:
            await trio.lowlevel.checkpoint()
            return
        writes = 0
        while parts:
            self.bytes_sent += sum(len(part) for part in parts)
            with trio.CancelScope(shield=True):
                with trio.move_on_after(self._write_timeout_s) as timer:
                    try:
                        await send_parts(self.transport, parts)
                    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                        self._mark_closed(f"transport broke while sending: {exc}")
                        raise ConnectionLost(f"connection lost: {exc}") from exc
            if timer.cancelled_caught:
                reason = (
                    f"peer stopped reading (a write did not finish in {self._write_timeout_s:g} s)"
                )
                log.warning("http2 connection closed: %s", reason, extra={"connection": self.name})
                self._mark_closed(reason)
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(self.transport)
                raise ConnectionLost(f"connection lost: {reason}")
            writes += 1
            if not self._proto.has_data_to_send():
                return
            if self._write_lock.statistics().tasks_waiting:
                return  # the next holder writes the rest
            if hand_over and writes >= WRITES_PER_TURN:
                self._flush_later()
                return
            parts = self._proto.take_parts()

    def _flush_later(self) -> None:
        """Have the connection's own nursery send whatever h2 holds."""
        nursery = self._handler_nursery
        if (
            self._closed
            or self._flush_scheduled
            or nursery is None
            or nursery.cancel_scope.cancel_called
        ):
            return
        self._flush_scheduled = True
        nursery.start_soon(self._flush_scheduled_frames)

    async def _flush_scheduled_frames(self) -> None:
        try:
            with contextlib.suppress(trio.BrokenResourceError):
                await self._flush(scheduled=True)
        finally:
            # Cleared only now, so a cancelled flush here does not schedule another.
            self._flush_scheduled = False

    @contextlib.contextmanager
    def _h2_errors(self, stream: H2Stream) -> Iterator[None]:
        """Turn h2's refusal to act on a stream into our errors, with the real cause."""
        try:
            yield
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError) as exc:
            if stream._error is not None:
                raise stream._error from None
            if self._closed:
                raise ConnectionLost(f"connection lost: {self._close_reason}") from None
            raise StreamError(f"stream {stream.stream_id}: {exc}") from None

    # -- client role --

    async def open_stream(
        self, headers: Headers, *, end_stream: bool = False, flush: bool = True
    ) -> H2Stream:
        """Open a new stream by sending its request headers. With ``flush=False`` they wait
        for the stream's first bytes (a `send_data` right after), so the two leave in one
        write."""
        if self._closed:
            raise ConnectionLost(f"connection lost: {self._close_reason}")
        if self._draining:
            raise StreamRefused("connection is draining; open the stream elsewhere")
        if not self._ready.is_set():
            await self._ready.wait()
        try:
            sid = self._proto.next_stream_id()
        except h2.exceptions.NoAvailableStreamIDError:
            self._draining = True
            raise StreamRefused("stream ids exhausted; open the stream elsewhere") from None
        stream = H2Stream(self, sid)
        self._streams[sid] = stream
        self._opened += 1
        while True:
            try:
                self._proto.send_headers(sid, headers, end_stream=end_stream)
                break
            except h2.exceptions.TooManyStreamsError:
                # Wait for one of ours to end rather than failing the caller.
                await self._idle_lot.park()
                if self._closed:
                    self._streams.pop(sid, None)
                    raise ConnectionLost(f"connection lost: {self._close_reason}") from None
            except h2.exceptions.ProtocolError as exc:
                self._streams.pop(sid, None)
                raise StreamError(f"cannot open stream: {exc}") from None
        if end_stream:
            stream._sent_end = True
        if flush or end_stream:
            await self._flush()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        return stream

    def forget(self, stream: H2Stream) -> None:
        """Drop a finished client stream from the table (its owner is done with it)."""
        if self._streams.get(stream.stream_id) is stream:
            del self._streams[stream.stream_id]
        # Unread body bytes would hold connection window for ever.
        stream._discard()
        self._idle_lot.unpark_all()

    # -- liveness --

    async def _watch_quiet(self) -> None:
        """Close a server connection that opens no stream in time, or later goes idle."""
        first_s, idle_s = self._first_request_timeout_s, self._idle_timeout_s
        if first_s is not None:
            await trio.sleep(first_s)
            if self._opened == 0:
                await self._close_quiet(f"no request within {first_s:g} s")
                return
        if idle_s is None:
            return
        seen = self._opened
        quiet_since = trio.current_time()
        while not self._closed:
            if self._streams:
                await self._idle_lot.park()  # woken whenever a stream goes
                seen, quiet_since = self._opened, trio.current_time()
                continue
            if self._opened != seen:
                # Streams came and went while this slept: idle from now (at most idle_s late).
                seen, quiet_since = self._opened, trio.current_time()
            deadline = max(quiet_since, self._last_receive) + idle_s
            if trio.current_time() >= deadline:
                await self._close_quiet(f"idle for {idle_s:g} s")
                return
            await trio.sleep_until(deadline)

    async def _close_quiet(self, reason: str) -> None:
        """GOAWAY(NO_ERROR); a request that raced it still finishes; then close."""
        with contextlib.suppress(trio.BrokenResourceError):
            await self.drain()
        self._mark_closed(reason)

    async def ping(self) -> float:
        """Send one PING and wait for its ACK; returns the round trip in seconds."""
        opaque = next(self._ping_ids).to_bytes(8, "big")
        sent = trio.current_time()
        self._pings[opaque] = sent
        self._proto.ping(opaque)
        await self._flush()
        while opaque in self._pings:
            if self._closed:
                raise ConnectionLost(f"connection lost: {self._close_reason}")
            await self._ping_lot.park()
        return trio.current_time() - sent

    async def _keepalive_loop(self, config: KeepaliveConfig) -> None:
        while not self._closed:
            await trio.sleep(config.ping_interval_s)
            opaque = b"ka" + os.urandom(6)
            sent_at = trio.current_time()
            self._pings[opaque] = sent_at
            self._proto.ping(opaque)
            try:
                await self._flush()
            except ConnectionLost:
                return
            with trio.move_on_after(config.ping_timeout_s):
                while opaque in self._pings and not self._closed:
                    await self._ping_lot.park()
            if opaque in self._pings and self._last_receive > sent_at:
                # The ACK may sit behind a full window of data; bytes arriving are proof
                # enough that the peer is alive.
                self._pings.pop(opaque, None)
                continue
            if opaque in self._pings and not self._closed:
                self._pings.pop(opaque, None)
                log.warning(
                    "http2 peer did not answer PING within %.1f s; closing",
                    config.ping_timeout_s,
                    extra={"connection": self.name},
                )
                self._mark_closed(
                    f"peer unresponsive (PING unanswered for {config.ping_timeout_s:g} s)"
                )
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    try:
                        await self.transport.aclose()
                    except trio.BrokenResourceError:
                        pass
                return


@asynccontextmanager
async def open_http2_connection(
    transport: trio.abc.Stream,
    *,
    client_side: bool,
    settings: Http2Settings | None = None,
    keepalive: KeepaliveConfig | None = None,
    handler: RequestHandler | None = None,
    name: str = "",
) -> AsyncIterator[Http2Connection]:
    """Run a connection for the body of the `async with`; closed when it exits. One that ends
    before it is ready raises `ConnectionLost` itself (not inside an ExceptionGroup)."""
    conn = Http2Connection(
        transport,
        client_side=client_side,
        settings=settings,
        keepalive=keepalive,
        handler=handler,
        name=name,
    )
    lost: ConnectionLost | None = None
    async with trio.open_nursery() as nursery:
        try:
            await nursery.start(conn.run)
        except ConnectionLost as exc:
            lost = exc
        else:
            try:
                yield conn
            finally:
                await conn.aclose()
                nursery.cancel_scope.cancel()
    if lost is not None:
        raise lost


__all__ = [
    "ConnectionLost",
    "H2ByteStream",
    "H2Stream",
    "Headers",
    "Http2Connection",
    "KeepaliveConfig",
    "StreamError",
    "StreamRefused",
    "StreamReset",
    "header_value",
    "open_http2_connection",
]
