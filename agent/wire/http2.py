"""The sans-IO HTTP/2 core shared by the worker API's server and its client.

`h2.H2Connection` does the framing, HPACK and stream state; this module adds the policy a
long-lived, multiplexed connection between a controlplane and its workers needs, and nothing
that touches a socket:

- settings sized for bulk transfer (large windows and frames) and bounded everywhere
  (concurrent streams, header list size; h2 itself caps CONTINUATION frames);
- limits enforced as soon as a frame header announces a breach, not once h2 has buffered the
  frame or header block (`_FrameScanner`);
- a stream past the concurrency limit refused (RST_STREAM REFUSED_STREAM), as RFC 9113 5.1.2
  asks, where h2 alone would end the whole connection;
- a graceful GOAWAY (NO_ERROR), sent or received, lets streams in flight finish; h2 alone
  refuses every frame after any GOAWAY;
- flood limits: RST_STREAM, PING and SETTINGS frames received are counted per time window and
  answered with GOAWAY(ENHANCE_YOUR_CALM) past their limit;
- every h2 error turned into one of ours (`ProtocolViolation`), with the GOAWAY already queued.

Time is an argument (`now`), so the whole thing is tested by wiring two of these together,
with bytes split at random boundaries, and no clock or socket.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hyperframe.frame
from h2.connection import ConnectionState

# h2 logs `repr(frame)` for every received frame even when its logger is the do-nothing one,
# and hyperframe's default repr of a DATA frame serialises and hex-encodes the payload: with
# 1 MiB frames that was 40-61% of a receiver's CPU. A DATA frame's repr only needs its size.


def _data_frame_body_repr(self: hyperframe.frame.DataFrame) -> str:
    return f"<{len(self.data)} bytes>"


setattr(hyperframe.frame.DataFrame, "_body_repr", _data_frame_body_repr)  # noqa: B010

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADERS, _PUSH_PROMISE, _CONTINUATION = 0x1, 0x5, 0x9
_END_HEADERS = 0x4


@attrs.frozen
class Http2Settings:
    """Limits and sizes of one HTTP/2 connection; the same for both roles."""

    stream_window_bytes: int = 8 * 1024 * 1024
    connection_window_bytes: int = 32 * 1024 * 1024
    max_frame_bytes: int = 1024 * 1024
    max_concurrent_streams: int = 2048
    max_header_list_bytes: int = 64 * 1024
    flood_window_s: float = 10.0
    max_resets_per_window: int = 2000
    max_pings_per_window: int = 200
    max_settings_per_window: int = 200

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


class ProtocolViolation(Exception):
    """The peer broke the protocol or a limit; a GOAWAY with `error_code` is queued to send."""

    def __init__(self, message: str, error_code: h2.errors.ErrorCodes) -> None:
        super().__init__(message)
        self.error_code = error_code


class _FrameScanner:
    """Follows frame boundaries in the received bytes and reports each frame header.

    h2 checks a frame's length only once the whole frame is buffered (up to 16 MiB for a
    header announcing that much, which is what an HTTP/1.1 answer or TLS record looks like),
    and a header block's size only after its last CONTINUATION frame (up to 64 frames of
    max_frame_bytes each). Seeing the headers first lets both be refused when announced.
    """

    def __init__(self, *, server: bool) -> None:
        self._skip = len(PREFACE) if server else 0  # the preface, or the rest of a frame
        self._header = bytearray()

    def feed(self, data: bytes | bytearray) -> list[tuple[int, int, int]]:
        """(length, type, flags) of every frame header completed by `data`."""
        found: list[tuple[int, int, int]] = []
        view = memoryview(data)
        at = 0
        while at < len(view):
            if self._skip:
                step = min(self._skip, len(view) - at)
                self._skip -= step
                at += step
                continue
            step = min(9 - len(self._header), len(view) - at)
            self._header += view[at : at + step]
            at += step
            if len(self._header) == 9:
                length = int.from_bytes(self._header[:3], "big")
                found.append((length, self._header[3], self._header[4]))
                self._header.clear()
                self._skip = length
        return found


class _H2Connection(h2.connection.H2Connection):
    """h2's connection, except that a GOAWAY with NO_ERROR does not end it.

    h2 moves to CLOSED on any GOAWAY and then refuses DATA, WINDOW_UPDATE and everything else
    for streams still in flight; RFC 9113 6.8 lets those streams finish, which a drain needs.
    """

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


class _FloodCounter:
    """Counts events in a sliding window of `window_s` seconds."""

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit = limit
        self.window_s = window_s
        self._times: collections.deque[float] = collections.deque()

    def hit(self, now: float) -> bool:
        """Record one event at `now`; True when the limit is exceeded."""
        times = self._times
        times.append(now)
        horizon = now - self.window_s
        while times and times[0] < horizon:
            times.popleft()
        return len(times) > self.limit


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
        self.h2 = _H2Connection(config=config)
        self._frames = _FrameScanner(server=not client_side)
        self._header_block_bytes = 0
        s = self.settings
        # Encoded header blocks are no larger than the header lists they carry for any sane
        # encoder; twice the limit leaves room for padding and odd encoders.
        self._max_header_block_bytes = 2 * s.max_header_list_bytes
        self._resets = _FloodCounter(s.max_resets_per_window, s.flood_window_s)
        self._pings = _FloodCounter(s.max_pings_per_window, s.flood_window_s)
        self._settings_changes = _FloodCounter(s.max_settings_per_window, s.flood_window_s)
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

    def has_data_to_send(self) -> bool:
        """Whether frames are queued, without taking them (h2 offers no peek of its own)."""
        return bool(self.h2._data_to_send)

    def receive_data(self, data: bytes | bytearray, now: float) -> list[h2.events.Event]:
        """Feed received bytes; returns h2's events or raises `ProtocolViolation`."""
        if self.closed:
            return []
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            code = getattr(exc, "error_code", h2.errors.ErrorCodes.PROTOCOL_ERROR)
            if self.h2.state_machine.state is not ConnectionState.CLOSED:
                # h2 queues a GOAWAY for every error but a bad preface.
                self.go_away(code)
            self.closed = True
            raise ProtocolViolation(f"peer broke HTTP/2: {exc}", code) from None
        self._check_frame_headers(data)
        self._check_floods(events, now)
        return self._refuse_excess_streams(events)

    def _violation(self, message: str, code: h2.errors.ErrorCodes) -> ProtocolViolation:
        self.go_away(code)
        self.closed = True
        return ProtocolViolation(message, code)

    def _check_frame_headers(self, data: bytes | bytearray) -> None:
        max_frame = self.h2.max_inbound_frame_size
        for length, frame_type, flags in self._frames.feed(data):
            if length > max_frame:
                raise self._violation(
                    f"peer sent a frame of {length} bytes, more than the {max_frame} announced",
                    h2.errors.ErrorCodes.FRAME_SIZE_ERROR,
                )
            if frame_type in (_HEADERS, _PUSH_PROMISE):
                self._header_block_bytes = length
            elif frame_type == _CONTINUATION:
                self._header_block_bytes += length
            else:
                continue
            if self._header_block_bytes > self._max_header_block_bytes:
                raise self._violation(
                    f"peer sent a header block over {self._max_header_block_bytes} bytes",
                    h2.errors.ErrorCodes.ENHANCE_YOUR_CALM,
                )
            if flags & _END_HEADERS:
                self._header_block_bytes = 0

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

    def _check_floods(self, events: Iterable[h2.events.Event], now: float) -> None:
        for event in events:
            counter: _FloodCounter | None = None
            what = ""
            if isinstance(event, h2.events.StreamReset) and event.remote_reset:
                counter, what = self._resets, "RST_STREAM"
            elif isinstance(event, h2.events.PingReceived):
                counter, what = self._pings, "PING"
            elif isinstance(event, h2.events.RemoteSettingsChanged):
                counter, what = self._settings_changes, "SETTINGS"
            if counter is not None and counter.hit(now):
                raise self._violation(
                    f"peer sent more than {counter.limit} {what} frames in {counter.window_s:g} s",
                    h2.errors.ErrorCodes.ENHANCE_YOUR_CALM,
                )

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
