"""The sans-IO HTTP/2 core shared by the worker API's server and its client.

`h2.H2Connection` does the framing, HPACK and stream state; this module adds the policy a
long-lived, multiplexed connection between a controlplane and its workers needs, and nothing
that touches a socket:

- settings sized for bulk transfer (large windows and frames) and bounded everywhere
  (concurrent streams, header list size; h2 itself caps CONTINUATION frames);
- limits enforced as soon as a frame header announces a breach, before h2 parses, buffers or
  answers the frame (`_FrameScanner`);
- a stream past the concurrency limit refused (RST_STREAM REFUSED_STREAM), as RFC 9113 5.1.2
  asks, where h2 alone would end the whole connection;
- a graceful GOAWAY (NO_ERROR), sent or received, lets streams in flight finish; h2 alone
  refuses every frame after any GOAWAY;
- flood limits: frames that cost us work but carry nothing (RST_STREAM, PING, SETTINGS,
  PRIORITY, frames of unknown type, empty DATA/HEADERS/CONTINUATION, WINDOW_UPDATE beyond what
  the DATA we sent explains) are counted per time window from their headers, before h2 answers
  any of them, and answered with GOAWAY(ENHANCE_YOUR_CALM) past their limit;
- outbound header lists bounded by the peer's announced limit (a proxied answer's headers are
  not ours to trust) and long values sent as plain literals: hpack's Huffman encoder is
  quadratic in a value's length (a 650 kB value takes a core for half a minute);
- every h2 error turned into one of ours (`ProtocolViolation`), with the GOAWAY already queued.

Time is an argument (`now`), so the whole thing is tested by wiring two of these together,
with bytes split at random boundaries, and no clock or socket. The connection layer calls
`Http2Protocol`'s methods, never h2 itself, so those tests cover everything it asks of h2.

Some of this reaches past h2's documented API (private methods overridden, its output buffer
written, hyperframe patched): every such name is in `H2_HOOKS`, checked by
tests/test_h2_hooks.py against the versions pyproject.toml pins.
"""

from __future__ import annotations

import collections
import struct
from collections.abc import Iterable
from typing import Any

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.frame_buffer
import h2.settings
import h2.stream
import hpack
import hyperframe.frame
from h2.connection import ConnectionState


@attrs.frozen
class Hook:
    """One name of h2, hyperframe or hpack, beyond what they document, that this module
    overrides, calls, reads or writes. `tests/test_h2_hooks.py` checks each against the
    installed version, and pyproject.toml pins the versions they were written against: a
    release that renames or reshapes one fails a test, not a connection in production."""

    owner: type
    name: str
    parameters: tuple[str, ...] | None
    """A method's parameters after `self`, as the pinned versions have them (h2 calls the
    private ones positionally); None for an instance attribute."""
    why: str


_CONN = h2.connection.H2Connection
H2_HOOKS: tuple[Hook, ...] = (
    Hook(_CONN, "_prepare_for_sending", ("frames",), "overridden: large DATA queued by reference"),
    Hook(_CONN, "_stream_is_closed_by_reset", ("stream_id",), "overridden: closed-stream flood"),
    Hook(
        _CONN,
        "_handle_data_on_closed_stream",
        ("events", "exc", "frame"),
        "overridden: DATA on closed streams counted",
    ),
    Hook(_CONN, "_receive_goaway_frame", ("frame",), "overridden: GOAWAY(NO_ERROR) drains"),
    Hook(_CONN, "_receive_frame", ("frame",), "called: a DATA frame collected apart from h2"),
    Hook(_CONN, "_terminate_connection", ("error_code",), "called: that frame refused"),
    Hook(
        _CONN,
        "send_headers",
        (
            "stream_id",
            "headers",
            "end_stream",
            "priority_weight",
            "priority_depends_on",
            "priority_exclusive",
        ),
        "overridden: the peer's header list limit",
    ),
    Hook(
        _CONN,
        "send_data",
        ("stream_id", "data", "end_stream", "pad_length"),
        "overridden: DATA frames sent counted",
    ),
    Hook(_CONN, "data_to_send", ("amount",), "overridden: joins the parts queued apart"),
    Hook(_CONN, "clear_outbound_data_buffer", (), "overridden: drops the parts queued apart"),
    Hook(_CONN, "_data_to_send", None, "written: the output h2 appends to, taken as a part"),
    Hook(_CONN, "encoder", None, "replaced by `_Encoder`"),
    Hook(_CONN, "incoming_buffer", None, "read: whether h2 is inside a frame"),
    Hook(h2.frame_buffer.FrameBuffer, "_data", None, "read: bytes of a frame begun"),
    Hook(h2.frame_buffer.FrameBuffer, "_headers_buffer", None, "read: inside a header block"),
    Hook(h2.frame_buffer.FrameBuffer, "_preamble_len", None, "read: preface not yet taken"),
    Hook(
        h2.connection.H2ConnectionStateMachine,
        "state",
        None,
        "written back after a graceful GOAWAY",
    ),
    Hook(h2.stream.H2StreamStateMachine, "headers_sent", None, "read: a stream answered"),
    Hook(hpack.Encoder, "add", ("to_add", "sensitive", "huffman"), "overridden by `_Encoder`"),
    Hook(hyperframe.frame.DataFrame, "_body_repr", (), "replaced below, on import"),
)
"""Every such name, in one place: the test reads this list, so the two cannot drift."""

# h2 logs `repr(frame)` for every received frame even when its logger is the do-nothing one,
# and hyperframe's default repr of a DATA frame serialises and hex-encodes the payload: with
# 1 MiB frames that was 40-61% of a receiver's CPU. A DATA frame's repr only needs its size.


def _data_frame_body_repr(self: hyperframe.frame.DataFrame) -> str:
    return f"<{len(self.data)} bytes>"


setattr(hyperframe.frame.DataFrame, "_body_repr", _data_frame_body_repr)  # noqa: B010

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
_PUSH_PROMISE, _PING, _WINDOW_UPDATE, _CONTINUATION = 0x5, 0x6, 0x8, 0x9
_KNOWN_TYPES = frozenset(range(0xA))
_END_STREAM, _ACK, _END_HEADERS, _PADDED = 0x1, 0x1, 0x4, 0x8
_HUFFMAN_MAX_BYTES = 1024
"""Longer names and values go out as plain literals (see `_Encoder`)."""


@attrs.frozen
class Http2Settings:
    """Limits and sizes of one HTTP/2 connection; the same for both roles.

    The flood limits count frames received per `flood_window_s`. An honest peer sends few of
    each: a SETTINGS now and then, a PING per keepalive, a RST_STREAM per cancelled request,
    a WINDOW_UPDATE per DATA frame or two it was sent (`window_updates_per_data_frame` of them
    per DATA frame we sent in the window are allowed on top of the fixed number), and empty
    frames almost never (a stream ends with END_STREAM set on its last frame, or one empty
    DATA frame carrying the flag, which is not counted). Frames on a closed stream are each
    answered with a RST_STREAM; a peer sends some that were in flight, not a stream of them.

    A RST_STREAM counts only for a stream we have not answered yet: that is the rapid reset
    (CVE-2023-44487), streams opened and dropped faster than their handlers can finish. A
    stream reset after our headers went is a request cancelled once its work was done or
    under way, which costs the peer a round trip each; a controlplane relaying many clients'
    cancellations to one worker sends those by the thousand, and must not be cut off for it.
    """

    stream_window_bytes: int = 8 * 1024 * 1024
    connection_window_bytes: int = 32 * 1024 * 1024
    max_frame_bytes: int = 1024 * 1024
    max_concurrent_streams: int = 2048
    max_header_list_bytes: int = 64 * 1024
    flood_window_s: float = 10.0
    max_resets_per_window: int = 2000
    max_pings_per_window: int = 200
    max_settings_per_window: int = 200
    max_priority_per_window: int = 1000
    max_unknown_frames_per_window: int = 1000
    max_empty_frames_per_window: int = 100
    max_frames_on_closed_streams_per_window: int = 2000
    max_window_updates_per_window: int = 1000
    window_updates_per_data_frame: int = 2

    def __attrs_post_init__(self) -> None:
        if not 16_384 <= self.max_frame_bytes <= 16_777_215:
            raise ValueError(
                f"max_frame_bytes must be between 16384 and 16777215, not {self.max_frame_bytes}"
            )
        for name in ("stream_window_bytes", "connection_window_bytes"):
            value = getattr(self, name)
            if not DEFAULT_WINDOW <= value <= MAX_WINDOW:
                raise ValueError(f"{name} must be between 65535 and 2**31-1, not {value}")
        if self.max_concurrent_streams < 1:
            raise ValueError("max_concurrent_streams must be at least 1")
        if self.flood_window_s <= 0:
            raise ValueError(f"flood_window_s must be above 0, not {self.flood_window_s}")
        for field in attrs.fields(Http2Settings):
            value = getattr(self, field.name)
            if value < 0:
                raise ValueError(f"{field.name} must be 0 or more, not {value}")


class ProtocolViolation(Exception):
    """The peer broke the protocol or a limit; a GOAWAY with `error_code` is queued to send."""

    def __init__(self, message: str, error_code: h2.errors.ErrorCodes) -> None:
        super().__init__(message)
        self.error_code = error_code


@attrs.frozen
class _FrameHead:
    """What a frame's 9-byte header (and, for a padded DATA frame, its pad length) says."""

    length: int
    type: int
    flags: int
    payload: int
    """Bytes of content: the length less padding for a padded DATA frame."""
    stream_id: int = 0


ROUTED_DATA_BYTES = 16 * 1024
"""DATA payloads from this size on are collected apart from h2 (`Http2Protocol._route`); a
smaller one costs less to copy through h2 than to route around it."""
_RAW, _DATA_START, _DATA_PIECE = 0, 1, 2
"""What `_FrameScanner.routes` holds: bytes for h2 as they are; the header of a DATA frame
(the frame head and its 9 bytes); a piece of that DATA frame's payload."""
Route = tuple[Any, ...]


class _FrameScanner:
    """Follows frame boundaries in the received bytes and reports each frame header.

    h2 checks a frame's length only once the whole frame is buffered (up to 16 MiB for a
    header announcing that much, which is what an HTTP/1.1 answer or TLS record looks like),
    a header block's size only after its last CONTINUATION frame (up to 64 frames of
    max_frame_bytes each), and answers every PING in a buffer before its caller can count
    them. Seeing the headers first lets each be refused when announced. A server's scanner
    also checks the client preface, so that anything else is refused as what it is.

    It also routes the bytes (`routes`, for the last `feed`): the payload pieces of an
    unpadded DATA frame of `ROUTED_DATA_BYTES` or more apart from everything else, which
    goes to h2 as it is. A frame header is
    passed on only once whole, so a DATA frame's can still be kept from h2.
    """

    def __init__(self, *, server: bool) -> None:
        self._preface = 0 if server else len(PREFACE)  # preface bytes checked so far
        self._skip = 0  # payload bytes of the current frame still to pass over
        self._pieces = _RAW  # how the current frame's payload is routed
        self._header = bytearray()
        self._padded: _FrameHead | None = None  # a padded DATA frame waiting for its pad byte
        self.routes: list[Route] = []

    def feed(self, data: bytes | bytearray) -> list[_FrameHead]:
        """Every frame header completed by `data`; ValueError for a wrong client preface."""
        found: list[_FrameHead] = []
        routes: list[Route] = []
        self.routes = routes
        view = memoryview(data)
        end = len(view)
        at = 0
        raw = 0  # where the bytes for h2 not yet in `routes` begin
        while at < end:
            if self._preface < len(PREFACE):
                step = min(len(PREFACE) - self._preface, end - at)
                if view[at : at + step] != PREFACE[self._preface : self._preface + step]:
                    raise ValueError("the client's first bytes are not the HTTP/2 preface")
                self._preface += step
                at += step
            elif self._padded is not None:
                head, self._padded = self._padded, None
                pad = view[at]
                found.append(attrs.evolve(head, payload=max(head.length - 1 - pad, 0)))
            elif self._skip:
                step = min(self._skip, end - at)
                self._skip -= step
                if self._pieces == _DATA_PIECE:
                    routes.append((_DATA_PIECE, view[at : at + step]))
                    raw = at + step
                at += step
            else:
                begun = at - len(self._header)  # before `at` when it began in an earlier chunk
                step = min(9 - len(self._header), end - at)
                self._header += view[at : at + step]
                at += step
                if len(self._header) == 9:
                    length = int.from_bytes(self._header[:3], "big")
                    stream_id = int.from_bytes(self._header[5:9], "big") & 0x7FFFFFFF
                    head = _FrameHead(length, self._header[3], self._header[4], length, stream_id)
                    self._skip = length
                    padded = head.flags & _PADDED and length
                    if head.type == _DATA and not padded and length >= ROUTED_DATA_BYTES:
                        if raw < begun:
                            routes.append((_RAW, view[raw:begun]))
                        routes.append((_DATA_START, head, bytes(self._header)))
                        raw = at
                        self._pieces = _DATA_PIECE
                    else:
                        if begun < 0:  # its first bytes were held back from an earlier chunk
                            routes.append((_RAW, bytes(self._header)))
                            raw = at
                        self._pieces = _RAW
                    self._header.clear()
                    if head.type == _DATA and padded:
                        self._padded = head
                    else:
                        found.append(head)
        # A frame header not yet whole is held back (in `_header`) until it is.
        held = min(len(self._header), end - raw)
        if raw < end - held:
            routes.append((_RAW, view[raw : end - held]))
        return found


class _Encoder(hpack.Encoder):
    """hpack's encoder, Huffman-coding only short names and values, and no secret.

    Its Huffman encoder shifts one big integer per symbol, so its time grows with the square
    of a value's length (28 s for 650 kB here). Long values are rare and barely shrink.

    A sensitive field (h2 marks `authorization` so) is never indexed, so it goes whole with
    every request. Huffman-coding a bearer token saved 10 bytes a request and cost the two
    ends 27 us of CPU (47 us to encode and decode a CONNECT's fields, 20 us without).
    """

    def add(self, to_add: tuple[bytes, bytes], sensitive: bool, huffman: bool = False) -> bytes:
        short = len(to_add[0]) <= _HUFFMAN_MAX_BYTES and len(to_add[1]) <= _HUFFMAN_MAX_BYTES
        return super().add(to_add, sensitive, huffman and short and not sensitive)


class _Flood(h2.exceptions.ProtocolError):
    """Raised inside h2 for a flood only h2 can see; h2 queues the GOAWAY with this code."""

    error_code = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM


class HeaderListTooLarge(h2.exceptions.ProtocolError):
    """Headers we were asked to send are over the size the peer accepts; nothing was sent."""


def _header_list_bytes(headers: Iterable[Any]) -> int:
    """RFC 9113 6.5.2: each field counts its name, its value and 32 bytes."""
    return sum(len(header[0]) + len(header[1]) + 32 for header in headers)


_FRAME_HEADER = struct.Struct("!HBBBL")
_DATA_TYPE = 0x0
_END_STREAM_FLAG = 0x1
ZERO_COPY_DATA_BYTES = 16 * 1024
"""DATA payloads from this size on are queued as they are, beside their frame header, not
copied into h2's buffer (see `_H2Connection._prepare_for_sending`)."""

OutboundParts = list[bytes | bytearray]
"""Queued output in order: frame headers and small frames joined, large DATA payloads apart."""


class _H2Connection(h2.connection.H2Connection):
    """h2's connection, with five changes:

    - a GOAWAY with NO_ERROR does not end it. h2 moves to CLOSED on any GOAWAY and then
      refuses DATA, WINDOW_UPDATE and everything else for streams still in flight; RFC 9113
      6.8 lets those streams finish, which a drain needs;
    - headers over the peer's header list limit are refused before anything changes (no
      stream opened, no HPACK state touched);
    - DATA frames sent are counted, which is what WINDOW_UPDATE frames answer;
    - frames on closed streams, which h2 answers with one RST_STREAM each, are counted
      against `closed_stream_frames` at `now` (set by the caller before each batch);
    - a large DATA payload is queued as the bytes object it came as, after its 9-byte header,
      where h2 copies it four times (into the frame's body, the frame, its buffer, and out of
      it): 280 us of a sender's CPU per MiB, which is what bounded a tunnel's throughput.
      `take_parts` hands the queue over in order; `data_to_send` still joins it.
    """

    def __init__(
        self,
        config: h2.config.H2Configuration,
        *,
        default_header_limit: int,
        closed_stream_frames: _FloodCounter,
    ) -> None:
        super().__init__(config=config)
        self.encoder = _Encoder()
        self.default_header_limit = default_header_limit
        self.data_frames_sent = 0
        self.closed_stream_frames = closed_stream_frames
        self.now = 0.0
        self._parts: OutboundParts = []
        """What was queued before `_data_to_send` (the tail h2 appends to), in order."""
        self._parts_bytes = 0

    def _prepare_for_sending(self, frames: list[hyperframe.frame.Frame]) -> None:
        for frame in frames:
            if (
                type(frame) is hyperframe.frame.DataFrame
                # Only an immutable payload may wait in the queue by reference.
                and type(frame.data) is bytes
                and len(frame.data) >= ZERO_COPY_DATA_BYTES
                and "PADDED" not in frame.flags
                and len(frame.data) <= self.max_outbound_frame_size
            ):
                length = len(frame.data)
                flags = _END_STREAM_FLAG if "END_STREAM" in frame.flags else 0
                header = _FRAME_HEADER.pack(
                    length >> 8, length & 0xFF, _DATA_TYPE, flags, frame.stream_id & 0x7FFFFFFF
                )
                if self._data_to_send:
                    self._parts.append(self._data_to_send)
                    self._parts_bytes += len(self._data_to_send)
                    self._data_to_send = bytearray()
                self._parts.append(header)
                self._parts.append(frame.data)
                self._parts_bytes += len(header) + length
            else:
                super()._prepare_for_sending([frame])

    def take_parts(self) -> OutboundParts:
        """Everything queued, in order, as the pieces it was queued in; the queue is empty after."""
        parts = self._parts
        if self._data_to_send:
            parts.append(self._data_to_send)
            self._data_to_send = bytearray()
        self._parts, self._parts_bytes = [], 0
        return parts

    def queued_bytes(self) -> int:
        return self._parts_bytes + len(self._data_to_send)

    def data_to_send(self, amount: int | None = None) -> bytes:
        if self._parts:
            self._data_to_send = bytearray(b"".join(self.take_parts()))
        return bytes(super().data_to_send(amount))

    def clear_outbound_data_buffer(self) -> None:
        self._parts, self._parts_bytes = [], 0
        super().clear_outbound_data_buffer()

    def _count_closed_stream_frame(self) -> None:
        counter = self.closed_stream_frames
        if counter.hit(self.now):
            raise _Flood(
                f"peer sent more than {counter.limit} frames on closed streams in "
                f"{counter.window_s:g} s"
            )

    def _stream_is_closed_by_reset(self, stream_id: int) -> bool:
        # h2 asks this only to decide whether to answer a frame on a closed stream with a
        # RST_STREAM (a stream error) rather than end the connection.
        closed = bool(super()._stream_is_closed_by_reset(stream_id))
        if closed:
            self._count_closed_stream_frame()
        return closed

    def _handle_data_on_closed_stream(self, *args: Any) -> Any:
        # h2 answers each DATA frame on a closed stream with a RST_STREAM.
        self._count_closed_stream_frame()
        return super()._handle_data_on_closed_stream(*args)

    def _receive_goaway_frame(
        self, frame: hyperframe.frame.GoAwayFrame
    ) -> tuple[list[hyperframe.frame.Frame], list[h2.events.Event]]:
        if frame.error_code != h2.errors.ErrorCodes.NO_ERROR or (
            self.state_machine.state is ConnectionState.CLOSED
        ):
            return super()._receive_goaway_frame(frame)
        event = h2.events.ConnectionTerminated()
        event.error_code = h2.errors.ErrorCodes.NO_ERROR
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]

    def send_headers(self, stream_id: int, headers: Any, *args: Any, **kwargs: Any) -> None:
        headers = list(headers)
        limit = self.remote_settings.max_header_list_size or self.default_header_limit
        size = _header_list_bytes(headers)
        if size > limit:
            raise HeaderListTooLarge(
                f"a header list of {size} bytes is over the {limit} bytes the peer accepts"
            )
        super().send_headers(stream_id, headers, *args, **kwargs)

    def send_data(self, stream_id: int, data: Any, *args: Any, **kwargs: Any) -> None:
        super().send_data(stream_id, data, *args, **kwargs)
        self.data_frames_sent += 1


class _FloodCounter:
    """Counts events in a sliding window of `window_s` seconds; keeps at most limit+1 times."""

    def __init__(self, limit: int, window_s: float, what: str) -> None:
        self.limit = limit
        self.window_s = window_s
        self.what = what
        self._times: collections.deque[float] = collections.deque()

    def hit(self, now: float) -> bool:
        """Record one event at `now`; True when the limit is exceeded."""
        times = self._times
        times.append(now)
        horizon = now - self.window_s
        while times and times[0] < horizon:
            times.popleft()
        return len(times) > self.limit


class _WindowUpdateCounter:
    """WINDOW_UPDATE frames per fixed window, allowed in proportion to the DATA frames sent.

    A peer that is sent DATA answers with WINDOW_UPDATEs as it reads, on the stream and on
    the connection; one that is sent nothing has little reason to send any.
    """

    def __init__(self, settings: Http2Settings) -> None:
        self.base = settings.max_window_updates_per_window
        self.per_data_frame = settings.window_updates_per_data_frame
        self.window_s = settings.flood_window_s
        self._start = -float("inf")
        self._count = 0
        self._sent_at_start = 0
        self.limit = self.base

    def hit(self, now: float, data_frames_sent: int) -> bool:
        if now >= self._start + self.window_s:
            self._start, self._count, self._sent_at_start = now, 0, data_frames_sent
        self._count += 1
        self.limit = self.base + self.per_data_frame * (data_frames_sent - self._sent_at_start)
        return self._count > self.limit


class Http2Protocol:
    """One end of an HTTP/2 connection: bytes in, events out; calls in, bytes out."""

    def __init__(self, *, client_side: bool, settings: Http2Settings | None = None) -> None:
        self.settings = settings or Http2Settings()
        self.client_side = client_side
        config = h2.config.H2Configuration(
            client_side=client_side,
            header_encoding=None,
            validate_inbound_headers=True,
            validate_outbound_headers=True,
            normalize_inbound_headers=True,
        )
        s = self.settings
        window = s.flood_window_s
        self.h2 = _H2Connection(
            config,
            default_header_limit=s.max_header_list_bytes,
            closed_stream_frames=_FloodCounter(
                s.max_frames_on_closed_streams_per_window, window, "closed-stream"
            ),
        )
        """h2's connection. Tests and benchmarks look inside it; the code that runs this
        protocol calls the methods below instead, which the sans-IO tests cover."""
        self._frames = _FrameScanner(server=not client_side)
        self._data_head: _FrameHead | None = None
        self._data_pieces: list[bytes | memoryview] | None = None
        """The payload so far of the DATA frame being received apart from h2 (`_route`)."""
        self._data_left = 0
        self._header_block_bytes = 0
        # Encoded header blocks are no larger than the header lists they carry for any sane
        # encoder; twice the limit leaves room for padding and odd encoders.
        self._max_header_block_bytes = 2 * s.max_header_list_bytes
        self._resets = _FloodCounter(s.max_resets_per_window, window, "RST_STREAM")
        self._pings = _FloodCounter(s.max_pings_per_window, window, "PING")
        self._settings_changes = _FloodCounter(s.max_settings_per_window, window, "SETTINGS")
        self._priorities = _FloodCounter(s.max_priority_per_window, window, "PRIORITY")
        self._unknown = _FloodCounter(s.max_unknown_frames_per_window, window, "unknown-type")
        self._empty = _FloodCounter(s.max_empty_frames_per_window, window, "empty")
        self._window_updates = _WindowUpdateCounter(s)
        self.closed = False

    def initiate(self) -> None:
        """Queue the preface and our SETTINGS, and open the connection window."""
        s = self.settings
        values = {
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: s.stream_window_bytes,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: s.max_frame_bytes,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: s.max_concurrent_streams,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: s.max_header_list_bytes,
        }
        if not self.client_side:
            values[h2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL] = 1
        # Settings given as initial values are what the preface announces; assigning them
        # one by one would only queue them until acknowledged.
        self.h2.local_settings = h2.settings.Settings(
            client=self.client_side, initial_values=values
        )
        # h2 copies these two from the settings only when a change is acknowledged.
        self.h2.max_inbound_frame_size = s.max_frame_bytes
        self.h2.decoder.max_header_list_size = s.max_header_list_bytes
        self.h2.initiate_connection()
        # The limit is announced above, but enforced by `_refuse_excess_streams`: h2 would
        # answer a stream past it with a connection error, and a client may well open streams
        # before our SETTINGS reach it.
        values[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = MAX_WINDOW
        self.h2.local_settings = h2.settings.Settings(
            client=self.client_side, initial_values=values
        )
        increment = s.connection_window_bytes - DEFAULT_WINDOW
        if increment > 0:
            self.h2.increment_flow_control_window(increment)

    def data_to_send(self) -> bytes:
        return self.h2.data_to_send()

    def take_parts(self) -> OutboundParts:
        """What `data_to_send` would return, as the pieces it was queued in (no join)."""
        return self.h2.take_parts()

    def has_data_to_send(self) -> bool:
        """Whether frames are queued, without taking them (h2 offers no peek of its own)."""
        return self.h2.queued_bytes() > 0

    def queued_bytes(self) -> int:
        """How many bytes of frames are queued, without taking them."""
        return self.h2.queued_bytes()

    # Calls in: each queues frames for `data_to_send`. h2's exceptions pass as they are
    # (`StreamClosedError`, `ProtocolError` and its kinds); the connection turns them into
    # errors of its own, with the stream's or the connection's cause.

    def next_stream_id(self) -> int:
        """The id a new stream of ours takes; `NoAvailableStreamIDError` once ids run out."""
        return self.h2.get_next_available_stream_id()

    def send_headers(
        self, stream_id: int, headers: Iterable[tuple[bytes, bytes]], *, end_stream: bool = False
    ) -> None:
        """Queue a header block, opening the stream if it is new. `HeaderListTooLarge` over
        the peer's header list limit, `TooManyStreamsError` past its concurrent streams."""
        self.h2.send_headers(stream_id, headers, end_stream=end_stream)

    def send_data(
        self, stream_id: int, data: bytes | memoryview, *, end_stream: bool = False
    ) -> None:
        """Queue `data` as DATA frames no larger than the peer accepts, END_STREAM on the last
        when `end_stream`. The caller has checked `send_window`. A bytes object that fits one
        frame is queued as it is, uncopied (see `_H2Connection._prepare_for_sending`)."""
        frame = self.h2.max_outbound_frame_size
        if len(data) <= frame:
            self.h2.send_data(stream_id, data, end_stream=end_stream)
            return
        view = memoryview(data)
        for offset in range(0, len(view), frame):
            last = offset + frame >= len(view)
            self.h2.send_data(
                stream_id, view[offset : offset + frame], end_stream=end_stream and last
            )

    def end_stream(self, stream_id: int) -> None:
        """Queue END_STREAM (an empty DATA frame) on a stream whose body is sent."""
        self.h2.end_stream(stream_id)

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        """Queue a RST_STREAM; the stream is closed both ways from here."""
        self.h2.reset_stream(stream_id, error_code)

    def ping(self, opaque: bytes) -> None:
        """Queue a PING carrying 8 `opaque` bytes, which the peer's ACK echoes."""
        self.h2.ping(opaque)

    def receive_data(self, data: bytes | bytearray, now: float) -> list[h2.events.Event]:
        """Feed received bytes; returns h2's events or raises `ProtocolViolation`.

        The frame headers in `data` are checked against every limit first: nothing of a
        chunk that breaks one reaches h2, so no PING of a flood is answered past its limit."""
        if self.closed:
            return []
        try:
            self._check_frame_headers(data, now)
            self.h2.now = now
            events = self._route(self._frames.routes, isinstance(data, bytes))
        except h2.exceptions.ProtocolError as exc:
            code = getattr(exc, "error_code", h2.errors.ErrorCodes.PROTOCOL_ERROR)
            if self.h2.state_machine.state is not ConnectionState.CLOSED:
                # h2 queues a GOAWAY for every error but a bad preface.
                self.go_away(code)
            self.closed = True
            raise ProtocolViolation(f"peer broke HTTP/2: {exc}", code) from None
        finally:
            # Views of `data` are not kept past this call: a caller may reuse its buffer.
            self._frames.routes = []
        return self._refuse_excess_streams(events)

    def _route(self, routes: list[Route], kept: bool) -> list[h2.events.Event]:
        """Hand the scanned bytes to h2, except a large unpadded DATA frame's payload: that is
        collected here and the frame given to h2 whole, its payload copied once. Through h2's
        buffer each payload byte was copied three times or more (into the buffer as it grew,
        out as a frame, into the frame's data), the larger part of a receiver's CPU per MiB.
        `kept`: the pieces are views of bytes that will not change, so they need no copy
        before the join."""
        events: list[h2.events.Event] = []
        connection = self.h2
        for route in routes:
            kind = route[0]
            if kind == _RAW:
                events += connection.receive_data(route[1])
            elif kind == _DATA_PIECE:
                piece = route[1]
                if self._data_pieces is None:
                    events += connection.receive_data(piece)  # h2 takes this frame whole
                    continue
                self._data_pieces.append(piece if kept else bytes(piece))
                self._data_left -= len(piece)
                if not self._data_left:
                    events += self._deliver_data()
            else:
                head: _FrameHead = route[1]
                buffer = connection.incoming_buffer
                if (
                    head.stream_id
                    and not buffer._headers_buffer
                    and not buffer._data
                    and not buffer._preamble_len
                ):
                    self._data_head = head
                    self._data_pieces = []
                    self._data_left = head.length
                else:
                    # Stream 0, or inside a header block: h2 says what is wrong with it.
                    self._data_pieces = None
                    events += connection.receive_data(route[2])
        return events

    def _deliver_data(self) -> list[h2.events.Event]:
        head, pieces = self._data_head, self._data_pieces
        assert head is not None and pieces is not None
        self._data_pieces = None
        frame = hyperframe.frame.DataFrame(head.stream_id)
        frame.parse_flags(head.flags)
        frame.data = bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)
        frame.body_len = head.length
        try:
            return self.h2._receive_frame(frame)
        except h2.exceptions.ProtocolError as exc:
            # What h2's receive_data does for a frame it refuses: a GOAWAY with the code.
            self.h2._terminate_connection(
                getattr(exc, "error_code", h2.errors.ErrorCodes.PROTOCOL_ERROR)
            )
            raise

    def _violation(self, message: str, code: h2.errors.ErrorCodes) -> ProtocolViolation:
        self.go_away(code)
        self.closed = True
        return ProtocolViolation(message, code)

    def _check_frame_headers(self, data: bytes | bytearray, now: float) -> None:
        try:
            heads = self._frames.feed(data)
        except ValueError as exc:
            raise self._violation(
                f"peer broke HTTP/2: {exc}", h2.errors.ErrorCodes.PROTOCOL_ERROR
            ) from None
        max_frame = self.h2.max_inbound_frame_size
        for head in heads:
            if head.length > max_frame:
                raise self._violation(
                    f"peer sent a frame of {head.length} bytes, more than the {max_frame} "
                    "announced",
                    h2.errors.ErrorCodes.FRAME_SIZE_ERROR,
                )
            self._check_header_block(head)
            self._count(head, now)

    def _check_header_block(self, head: _FrameHead) -> None:
        if head.type in (_HEADERS, _PUSH_PROMISE):
            self._header_block_bytes = head.length
        elif head.type == _CONTINUATION:
            self._header_block_bytes += head.length
        else:
            return
        if self._header_block_bytes > self._max_header_block_bytes:
            raise self._violation(
                f"peer sent a header block over {self._max_header_block_bytes} bytes",
                h2.errors.ErrorCodes.ENHANCE_YOUR_CALM,
            )
        if head.flags & _END_HEADERS:
            self._header_block_bytes = 0

    def _answered(self, stream_id: int) -> bool:
        """We have sent this open stream's headers (a server: its response has begun)."""
        stream = self.h2.streams.get(stream_id)
        return stream is not None and bool(stream.state_machine.headers_sent)

    def _count(self, head: _FrameHead, now: float) -> None:
        """Count a frame against the flood limit of its kind, if it has one."""
        counter: _FloodCounter | None = None
        kind = head.type
        if kind == _DATA:
            if head.payload == 0 and not head.flags & _END_STREAM:
                counter = self._empty
        elif kind in (_HEADERS, _CONTINUATION):
            ends = _END_STREAM if kind == _HEADERS else _END_HEADERS
            if head.length == 0 and not head.flags & ends:
                counter = self._empty
        elif kind == _PING:
            counter = self._pings
        elif kind == _SETTINGS:
            if not head.flags & _ACK:
                counter = self._settings_changes
        elif kind == _RST_STREAM:
            if not self._answered(head.stream_id):
                counter = self._resets
        elif kind == _PRIORITY:
            counter = self._priorities
        elif kind == _WINDOW_UPDATE:
            updates = self._window_updates
            if updates.hit(now, self.h2.data_frames_sent):
                raise self._violation(
                    f"peer sent more than {updates.limit} WINDOW_UPDATE frames in "
                    f"{updates.window_s:g} s for the {self.h2.data_frames_sent} DATA frames "
                    "it was sent",
                    h2.errors.ErrorCodes.ENHANCE_YOUR_CALM,
                )
        elif kind not in _KNOWN_TYPES:
            counter = self._unknown
        if counter is not None and counter.hit(now):
            raise self._violation(
                f"peer sent more than {counter.limit} {counter.what} frames in "
                f"{counter.window_s:g} s",
                h2.errors.ErrorCodes.ENHANCE_YOUR_CALM,
            )

    def _refuse_excess_streams(self, events: list[h2.events.Event]) -> list[h2.events.Event]:
        """Reset streams opened past max_concurrent_streams and drop their events."""
        new = [e.stream_id for e in events if isinstance(e, h2.events.RequestReceived)]
        if not new:
            return events
        # h2 has processed the whole batch: count what was open before it.
        streams = self.h2.streams
        still_open = sum(1 for sid in new if sid in streams and streams[sid].open)
        room = self.settings.max_concurrent_streams - (self.h2.open_inbound_streams - still_open)
        if len(new) <= room:
            return events
        refused: set[int] = set()
        kept: list[h2.events.Event] = []
        for event in events:
            sid = getattr(event, "stream_id", None)
            if isinstance(event, h2.events.RequestReceived):
                if room > 0:
                    room -= 1
                else:
                    assert sid is not None
                    refused.add(sid)
                    self.h2.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
                    continue
            elif sid in refused:
                if isinstance(event, h2.events.DataReceived) and event.flow_controlled_length:
                    self.h2.acknowledge_received_data(event.flow_controlled_length, sid)
                continue
            kept.append(event)
        return kept

    def go_away(self, error_code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.NO_ERROR) -> None:
        """Queue a GOAWAY; streams the peer opened so far may still finish."""
        if self.closed:
            return
        graceful = error_code == h2.errors.ErrorCodes.NO_ERROR
        self.closed = not graceful
        state = self.h2.state_machine.state
        try:
            self.h2.close_connection(
                error_code=error_code, last_stream_id=self.h2.highest_inbound_stream_id
            )
        except h2.exceptions.ProtocolError:
            self.closed = True
            return
        if graceful and state is not ConnectionState.CLOSED:
            # h2 would refuse everything from here on; streams up to last_stream_id may
            # still finish (see `_H2Connection`).
            self.h2.state_machine.state = state

    def open_window(self) -> int:
        """Bytes we may send now on the connection, regardless of stream."""
        return self.h2.outbound_flow_control_window

    def send_window(self, stream_id: int) -> int:
        """Bytes we may send now on `stream_id` (the smaller of stream and connection)."""
        try:
            return self.h2.local_flow_control_window(stream_id)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError, KeyError):
            return 0

    @property
    def max_outbound_frame_bytes(self) -> int:
        return self.h2.max_outbound_frame_size

    def acknowledge(self, stream_id: int, size: int) -> None:
        """Hand `size` flow-controlled bytes back to the peer once their consumer read them."""
        if size <= 0 or self.closed:
            return
        try:
            self.h2.acknowledge_received_data(size, stream_id)
        except h2.exceptions.ProtocolError:
            pass
