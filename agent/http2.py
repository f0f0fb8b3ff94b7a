"""The sans-IO HTTP/2 core shared by the worker API's server and its client.

`h2.H2Connection` does the framing, HPACK and stream state; this module adds the policy a
long-lived, multiplexed connection between a controlplane and its workers needs, and nothing
that touches a socket:

- settings sized for bulk transfer (large windows and frames) and bounded everywhere
  (concurrent streams, header list size; h2 itself caps CONTINUATION frames);
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

# h2 logs `repr(frame)` for every received frame even when its logger is the do-nothing one,
# and hyperframe's default repr of a DATA frame serialises and hex-encodes the payload: with
# 1 MiB frames that was 40-61% of a receiver's CPU. A DATA frame's repr only needs its size.


def _data_frame_body_repr(self: hyperframe.frame.DataFrame) -> str:
    return f"<{len(self.data)} bytes>"


hyperframe.frame.DataFrame._body_repr = _data_frame_body_repr

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535


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
        self.h2 = h2.connection.H2Connection(config=config)
        s = self.settings
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
        increment = s.connection_window_bytes - DEFAULT_WINDOW
        if increment > 0:
            self.h2.increment_flow_control_window(increment)

    def data_to_send(self) -> bytes:
        return self.h2.data_to_send()

    def receive_data(self, data: bytes, now: float) -> list[h2.events.Event]:
        """Feed received bytes; returns h2's events or raises `ProtocolViolation`."""
        if self.closed:
            return []
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            self.closed = True
            code = getattr(exc, "error_code", h2.errors.ErrorCodes.PROTOCOL_ERROR)
            raise ProtocolViolation(f"peer broke HTTP/2: {exc}", code) from None
        self._check_floods(events, now)
        return events

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
                self.go_away(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
                raise ProtocolViolation(
                    f"peer sent more than {counter.limit} {what} frames in "
                    f"{counter.window_s:g} s",
                    h2.errors.ErrorCodes.ENHANCE_YOUR_CALM,
                )

    def go_away(
        self, error_code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.NO_ERROR
    ) -> None:
        """Queue a GOAWAY; streams the peer opened so far may still finish."""
        if self.closed:
            return
        self.closed = error_code != h2.errors.ErrorCodes.NO_ERROR
        try:
            self.h2.close_connection(
                error_code=error_code, last_stream_id=self.h2.highest_inbound_stream_id
            )
        except h2.exceptions.ProtocolError:
            self.closed = True

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
