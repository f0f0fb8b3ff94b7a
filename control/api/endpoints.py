"""Endpoints: HTTP requests for a task's port, forwarded as HTTP/1.1 to that port.

A client calls `https://<controlplane>/v1/tasks/{id}/ports/{port}/<path>` over HTTP/2; the
controlplane opens a byte stream to the port on the task's worker (an HTTP/2 CONNECT stream,
direct or through the tunnel) and speaks HTTP/1.1 over it. h11, python-hyper's sans-IO
HTTP/1.1, does the parsing and framing; what this module decides (which headers cross, how the
request body is framed, whether a failed request may be sent again) is pure functions, and
`EndpointProxy` is the thin trio layer that carries those decisions out.

Byte streams are expensive (a CONNECT round trip, maybe through a tunnel), so a connection
whose response ended cleanly and that h11 calls reusable is kept, per pool key, for the next
request. An upstream may close a kept connection while it sits idle; a request that finds it
dead before any response byte is sent again once on a fresh stream when that is safe. The
request body streams through with the client's HTTP/2 flow control, and the response body with
the upstream's TCP backpressure; nothing is buffered whole.

The endpoint is served on the dashboard's origin, so the client's credentials stay on our side:
`authorization` is dropped, and so is the dashboard's session cookie from `cookie` (the other
cookies pass: an app served through the endpoint keeps its own); a response's `Set-Cookie` for
the session cookie's name is dropped too (other cookies pass, for the same apps), so a
container can neither read a user's session nor plant or clear one.
"""

from __future__ import annotations

import collections
import enum
import logging
import string
from collections.abc import AsyncGenerator, Awaitable, Callable, Hashable, Iterable, Mapping

import attrs
import h11
import trio

from control.ui.session import sets_session_cookie, without_session_cookie
from wire.connection import H2Stream
from wire.errors import ApiError, ErrorCode
from wire.service import BytesResponse, Request, StreamResponse

log = logging.getLogger("levers9.endpoints")

READ_BYTES = 64 * 1024
FINISH_WAIT_S = 0.5
"""How long a finished connection's upstream is given to end its side before the stream is
reset instead."""
FIRST_BYTES_LIMIT = 16 * 1024
"""A request head up to this size goes out with the opening of a new byte stream (the CONNECT
carries it), saving a write and a round trip; a larger one is sent after."""
REPLAY_LIMIT_BYTES = 64 * 1024
"""Request body bytes kept while a reused connection has not answered, so the request can be
sent again on a fresh one; a longer body on a dead connection is not retried."""

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
"""Headers about one connection (RFC 9110 7.6.1), never forwarded; `proxy-*` ones neither."""

DROPPED_REQUEST_HEADERS = frozenset(
    {
        # The controlplane's token must never reach the task (nor the dashboard's session,
        # which is taken out of `cookie` below).
        "authorization",
        # Set from the client's :authority below.
        "host",
        # Framing is ours to choose (content-length is set again when the client gave one).
        "content-length",
        # The body is sent without waiting for 100 Continue, so there is nothing to expect.
        "expect",
        # Only the controlplane can say where the request came from; a client's claim is not
        # passed on as if it had been checked.
        "forwarded",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
    }
)

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
BODYLESS_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "TRACE"})
"""Methods whose empty request is sent without Content-Length (others get Content-Length: 0)."""

DEFAULT_CONTENT_TYPE = "application/octet-stream"
"""What a response without Content-Type is labelled (what RFC 9110 8.3 lets a recipient assume)."""

_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~" + string.ascii_letters + string.digits)


class Framing(enum.Enum):
    """How the upstream request's body is delimited."""

    NONE = "none"
    LENGTH = "content-length"
    CHUNKED = "chunked"


@attrs.frozen
class UpstreamRequest:
    """The HTTP/1.1 request head to send, and how its body is framed."""

    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    framing: Framing
    content_length: int | None = None


@attrs.frozen
class UpstreamResponse:
    """What the client gets from the upstream's response head."""

    status: int
    content_type: str
    headers: tuple[tuple[str, str], ...]


# -- decisions (pure) -------------------------------------------------------------------------


def connection_scoped(headers: Iterable[tuple[str, str]]) -> frozenset[str]:
    """The (lowercase) names not to forward: hop-by-hop ones and those Connection lists."""
    named = {
        token.strip().lower()
        for name, value in headers
        if name.lower() == "connection"
        for token in value.split(",")
        if token.strip()
    }
    return HOP_BY_HOP | named


def end_to_end(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers that cross a proxy, names lowercased, order and repeats kept."""
    headers = list(headers)
    scoped = connection_scoped(headers)
    return [
        (name.lower(), value)
        for name, value in headers
        if name.lower() not in scoped and not name.lower().startswith("proxy-")
    ]


def forwarded_value(host: str, proto: str = "https") -> str:
    """An RFC 7239 `Forwarded` element naming the host and protocol the client used."""
    if host and set(host) <= _TOKEN_CHARS:
        return f"host={host};proto={proto}"
    quoted = host.replace("\\", "\\\\").replace('"', '\\"')
    return f'host="{quoted}";proto={proto}'


def plan_request(
    method: str,
    target: str,
    headers: Mapping[str, str],
    *,
    authority: str,
    body_ended: bool,
) -> UpstreamRequest:
    """The upstream request for a client's: end-to-end headers minus the client's credentials,
    Host and forwarding headers from the authority it asked for, and the body framed as
    Content-Length when the client gave one, chunked when it streams one of unknown length,
    none for a GET or HEAD that did not say it has one. `body_ended`: the client's request
    has already ended (nothing more will come)."""
    method = method.upper()
    host = authority or headers.get("host", "")
    if not host:
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            "the request names no host; send :authority (or Host)",
            field=":authority",
        )
    if not target.startswith("/"):
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"the upstream target must be an absolute path, not {target!r}",
            field=":path",
        )
    length: int | None = None
    given = headers.get("content-length")
    if given is not None:
        if not (given.strip().isascii() and given.strip().isdigit()):
            raise ApiError(
                ErrorCode.INVALID_ARGUMENT,
                f"content-length must be a number of bytes, not {given!r}",
                field="content-length",
            )
        length = int(given.strip())
    if length is not None:
        framing = Framing.LENGTH
    elif body_ended:
        framing = Framing.NONE if method in BODYLESS_METHODS else Framing.LENGTH
        length = None if framing is Framing.NONE else 0
    elif method in ("GET", "HEAD"):
        framing = Framing.NONE
    else:
        framing = Framing.CHUNKED
    kept = [
        (name, value)
        for name, value in end_to_end(headers.items())
        if name not in DROPPED_REQUEST_HEADERS and not name.startswith(":")
    ]
    kept = [
        (name, without_session_cookie(value) if name == "cookie" else value)
        for name, value in kept
        if name != "cookie" or without_session_cookie(value)
    ]
    out = [("host", host), *kept]
    if framing is Framing.LENGTH:
        out.append(("content-length", str(length)))
    elif framing is Framing.CHUNKED:
        out.append(("transfer-encoding", "chunked"))
    out += [
        ("x-forwarded-host", host),
        ("x-forwarded-proto", "https"),
        ("forwarded", forwarded_value(host)),
    ]
    return UpstreamRequest(method, target, tuple(out), framing, length)


def plan_response(status: int, headers: Iterable[tuple[str, str]]) -> UpstreamResponse:
    """The client's response head from the upstream's: end-to-end headers, Content-Type
    apart, without a Set-Cookie for the dashboard's session. A 204 or 304 loses
    Content-Length: HTTP/2 peers check it against a body that those responses never have."""
    content_type = DEFAULT_CONTENT_TYPE
    kept: list[tuple[str, str]] = []
    typed = False
    for name, value in end_to_end(headers):
        if name == "content-type":
            if not typed:
                content_type, typed = value, True
            continue
        if name == "content-length" and status in (204, 304):
            continue
        if name == "set-cookie" and sets_session_cookie(value):
            continue
        kept.append((name, value))
    return UpstreamResponse(status, content_type, tuple(kept))


def may_retry(
    method: str, *, reused: bool, answered: bool, body_bytes_sent: int, replayable: bool
) -> bool:
    """Whether a request that failed on its connection is sent again on a fresh one: only when
    the connection was a kept one (an upstream closing an idle connection is routine), nothing
    of a response came, the body can be sent again, and the request was idempotent or no body
    byte reached the upstream."""
    if not reused or answered or not replayable:
        return False
    return method.upper() in IDEMPOTENT_METHODS or body_bytes_sent == 0


def upstream_target(raw_path: str, *, strip_segments: int) -> str:
    """The origin-form target left after the first `strip_segments` path segments, with the
    query kept byte for byte: `/v1/tasks/t/ports/80/a?x=1` with 5 → `/a?x=1`."""
    path, sep, query = raw_path.partition("?")
    rest = path.split("/")[1 + strip_segments :]
    return "/" + "/".join(rest) + (sep + query)


# -- I/O --------------------------------------------------------------------------------------


@attrs.define(eq=False)
class _Upstream:
    """One HTTP/1.1 connection to a task's port: its byte stream and h11's view of it."""

    stream: trio.abc.HalfCloseableStream
    http: h11.Connection = attrs.field(factory=lambda: h11.Connection(h11.CLIENT))
    prepared: tuple[bytes, bool] | None = None
    """A new connection's first request, already given to h11: the head bytes still to send
    (none when they went with the opening) and whether the request has no body."""
    idle_since: float = 0.0
    received_bytes: int = 0
    reusable: bool = True
    """False once a request on it was cut off: h11 may think it complete, the wire may not."""

    async def aclose(self) -> None:
        """Close at once: the stream is reset when its end has not come (an abandoned
        request)."""
        await trio.aclose_forcefully(self.stream)

    async def finish(self) -> None:
        """Close after a whole exchange: our side ends, and the upstream's end (it closes a
        connection it answered with `Connection: close`, or on our EOF) is waited for, briefly,
        so the stream ends without a reset. A reset per request is what a flood of resets
        looks like to the worker, which ends the whole connection past its limit."""
        with trio.move_on_after(FINISH_WAIT_S):
            try:
                await self.stream.send_eof()
                while await self.stream.receive_some(READ_BYTES):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        await trio.aclose_forcefully(self.stream)

    async def next_event(self) -> h11.Event:
        """The next h11 event, reading as needed. Raises trio.BrokenResourceError (the stream
        broke) and h11.RemoteProtocolError (not HTTP, or closed mid-message)."""
        while True:
            event = self.http.next_event()
            if isinstance(event, h11.Event):
                return event
            if event is h11.PAUSED:
                # Only asked for while a response is due, so this is the upstream's doing.
                raise h11.RemoteProtocolError("more data after the end of the response")
            try:
                data = await self.stream.receive_some(READ_BYTES)
            except trio.ClosedResourceError as exc:
                raise trio.BrokenResourceError(str(exc)) from exc
            self.received_bytes += len(data)
            self.http.receive_data(bytes(data))


class _Body:
    """The client's request body, read once. While `keeping`, what is read is kept (up to
    REPLAY_LIMIT_BYTES) so `rewind` can hand it out again for a second attempt."""

    def __init__(self, stream: H2Stream | None) -> None:
        self._stream = stream
        self._kept: list[bytes] = []
        self._kept_bytes = 0
        self._replay: collections.deque[bytes] = collections.deque()
        self.keeping = False
        self.replayable = True

    async def next_chunk(self) -> bytes:
        if self._replay:
            await trio.lowlevel.checkpoint()
            return self._replay.popleft()
        if self._stream is None:
            await trio.lowlevel.checkpoint()
            return b""
        chunk = await self._stream.receive_some(READ_BYTES)
        if self.keeping and chunk:
            if self._kept_bytes + len(chunk) <= REPLAY_LIMIT_BYTES:
                self._kept.append(chunk)
                self._kept_bytes += len(chunk)
            else:
                self.stop_keeping()
                self.replayable = False
        return chunk

    def stop_keeping(self) -> None:
        self.keeping = False
        self._kept.clear()
        self._kept_bytes = 0

    def rewind(self) -> None:
        self._replay.extend(self._kept)
        self.stop_keeping()


@attrs.define
class _Exchange:
    """One attempt's progress, shared by the body sender and the head reader."""

    upstream: _Upstream
    plan: UpstreamRequest
    body: _Body
    body_bytes_sent: int = 0
    body_done: bool = False
    answered: bool = False
    """Some response byte arrived (a request that got one is never sent again)."""
    head: h11.Response | None = None
    failure: str | None = None
    """Why the upstream did not answer (it broke, closed, or sent no HTTP)."""
    error: BaseException | None = None
    """A problem with the client's request (its body), raised to the caller."""


class EndpointProxy:
    """HTTP/1.1 to task ports over opened byte streams, connections kept alive and reused per
    key. `forward` is called from the controlplane's endpoint route; `forget_where` when a
    task ends; `aclose` at shutdown."""

    def __init__(self, *, max_idle_per_key: int = 16, idle_timeout_s: float = 30.0) -> None:
        self.max_idle_per_key = max_idle_per_key
        self.idle_timeout_s = idle_timeout_s
        self._idle: dict[Hashable, list[_Upstream]] = {}
        self._closed = False

    async def forward(
        self,
        request: Request,
        *,
        key: Hashable,
        target: str,
        open_stream: Callable[[bytes], Awaitable[trio.abc.HalfCloseableStream]],
        label: str = "",
    ) -> StreamResponse | BytesResponse:
        """Send `request` to the upstream as `<method> <target> HTTP/1.1` and return its
        response, the body streamed. `key` picks the pool of kept connections (e.g. (worker,
        task, port)); `open_stream(first)` opens a new byte stream when none is kept, with
        `first` (the request's head, or nothing) sent on it before the stream is returned
        (a CONNECT carries it with its own request); `label` names
        the upstream in errors (default: "the task's port N" when the key ends with the port).
        Errors: the opener's ApiError as it is; UNAVAILABLE when the upstream gives no HTTP
        answer; INVALID_ARGUMENT when the request cannot be sent as HTTP/1.1. A body the
        upstream cuts short fails the response stream, so the client never gets a truncated
        body that looks complete."""
        name = label or _describe(key)
        plan = plan_request(
            request.method,
            target,
            request.headers,
            authority=request.authority,
            body_ended=request.stream.ended,
        )
        body = _Body(None if plan.framing is Framing.NONE else request.stream)
        upstream = await self._take(key)
        reused = upstream is not None
        if upstream is None:
            upstream = await self._open(open_stream, name, plan)
        try:
            body.keeping = reused
            exchange = await self._exchange(upstream, plan, body)
            if exchange.head is None and may_retry(
                plan.method,
                reused=reused,
                answered=exchange.answered,
                body_bytes_sent=exchange.body_bytes_sent,
                replayable=body.replayable,
            ):
                log.debug("%s: kept connection was dead (%s); retrying", name, exchange.failure)
                await upstream.aclose()
                body.rewind()
                upstream = await self._open(open_stream, name, plan)
                exchange = await self._exchange(upstream, plan, body)
            body.stop_keeping()
            if exchange.head is None:
                raise ApiError(
                    ErrorCode.UNAVAILABLE,
                    f"{name} did not answer with HTTP ({plan.method} {target}): "
                    f"{exchange.failure or 'no response'}; check that the task serves "
                    "HTTP/1.1 on that port",
                )
            return await self._respond(key, name, upstream, exchange.head, exchange)
        except BaseException:
            await upstream.aclose()
            raise

    async def forget_where(self, predicate: Callable[[Hashable], bool]) -> int:
        """Close the kept connections whose key matches (a task ended); returns how many."""
        doomed: list[_Upstream] = []
        for key in [k for k in self._idle if predicate(k)]:
            doomed += self._idle.pop(key)
        for upstream in doomed:
            await upstream.aclose()
        return len(doomed)

    async def aclose(self) -> None:
        """Close every kept connection; later responses close theirs instead of keeping them."""
        self._closed = True
        await self.forget_where(lambda _: True)

    def idle_connections(self, key: Hashable) -> int:
        """How many connections are kept for `key`."""
        return len(self._idle.get(key, ()))

    # -- the pool --

    async def _take(self, key: Hashable) -> _Upstream | None:
        idle = self._idle.pop(key, [])
        now = trio.current_time()
        fresh = [u for u in idle if now - u.idle_since <= self.idle_timeout_s]
        stale = [u for u in idle if now - u.idle_since > self.idle_timeout_s]
        upstream = fresh.pop() if fresh else None  # the most recently used
        if fresh:
            self._idle[key] = fresh
        for old in stale:
            await old.aclose()
        return upstream

    async def _release(self, key: Hashable, upstream: _Upstream) -> None:
        http = upstream.http
        if upstream.reusable and http.our_state is h11.DONE and http.their_state is h11.DONE:
            http.start_next_cycle()
            idle = self._idle.setdefault(key, [])
            if not self._closed and len(idle) < self.max_idle_per_key:
                upstream.idle_since = trio.current_time()
                idle.append(upstream)
                return
            if not idle:
                del self._idle[key]
        await upstream.finish()

    async def _open(
        self,
        open_stream: Callable[[bytes], Awaitable[trio.abc.HalfCloseableStream]],
        name: str,
        plan: UpstreamRequest,
    ) -> _Upstream:
        """A new connection for `plan`, its request head sent with the opening when small."""
        http = h11.Connection(h11.CLIENT)
        head, body_done = _request_head(http, plan)
        first = head if len(head) <= FIRST_BYTES_LIMIT else b""
        try:
            stream = await open_stream(first)
        except (OSError, trio.BrokenResourceError) as exc:
            raise ApiError(
                ErrorCode.UNAVAILABLE,
                f"cannot reach {name}: {exc}; check that the task is running and listens there",
            ) from None
        return _Upstream(stream, http, prepared=(b"" if first else head, body_done))

    # -- one attempt --

    async def _exchange(self, upstream: _Upstream, plan: UpstreamRequest, body: _Body) -> _Exchange:
        """Send the request head, then the body while waiting for the response head. An
        upstream that answers before taking the whole body gets no more of it."""
        exchange = _Exchange(upstream, plan, body)
        if upstream.prepared is None:
            head, exchange.body_done = _request_head(upstream.http, plan)
        else:
            (head, exchange.body_done), upstream.prepared = upstream.prepared, None
        try:
            if head:
                await upstream.stream.send_all(head)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            exchange.failure = f"the connection broke while sending the request: {exc}"
            return exchange
        async with trio.open_nursery() as nursery:
            if not exchange.body_done:
                nursery.start_soon(self._send_body, exchange, nursery.cancel_scope)
            await self._read_head(exchange)
            # With a response head, the body has normally all gone; if not, the upstream
            # answered early (a 413, say) and gets no more. Without one, sending is pointless.
            nursery.cancel_scope.cancel()
        if exchange.error is not None:
            raise exchange.error
        if exchange.head is not None and not exchange.body_done:
            await self._end_early(exchange)
        return exchange

    async def _send_body(self, exchange: _Exchange, scope: trio.CancelScope) -> None:
        """Stream the client's body up. Errors are left in `exchange`, not raised, so no
        ExceptionGroup comes out of the nursery: a broken upstream is the head reader's to
        judge (an answer may still be readable), a broken client request ends the attempt."""
        http, stream = exchange.upstream.http, exchange.upstream.stream
        while True:
            try:
                chunk = await exchange.body.next_chunk()
                data = http.send(h11.Data(data=chunk) if chunk else h11.EndOfMessage())
            except h11.LocalProtocolError:
                declared = exchange.plan.content_length
                exchange.error = ApiError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"the request body does not match its content-length ({declared} bytes)",
                    field="content-length",
                )
                scope.cancel()
                return
            except trio.BrokenResourceError as exc:
                # The client's stream (an H2 StreamError): it reset or its connection went.
                exchange.error = exc
                scope.cancel()
                return
            try:
                await stream.send_all(data or b"")
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                exchange.failure = f"the connection broke while sending the request body: {exc}"
                return
            if not chunk:
                exchange.body_done = True
                return
            exchange.body_bytes_sent += len(chunk)

    async def _read_head(self, exchange: _Exchange) -> None:
        """Read up to the final response head (1xx are skipped); failures land in exchange."""
        upstream = exchange.upstream
        start = upstream.received_bytes - len(upstream.http.trailing_data[0])
        try:
            while True:
                event = await upstream.next_event()
                if isinstance(event, h11.Response):
                    exchange.head = event
                    return
                if not isinstance(event, h11.InformationalResponse):
                    exchange.failure = "the connection closed before a response"
                    return
        except h11.RemoteProtocolError as exc:
            if upstream.received_bytes > start:
                exchange.failure = f"it sent something that is not an HTTP/1.1 response ({exc})"
            else:
                exchange.failure = "the connection closed before a response"
        except trio.BrokenResourceError as exc:
            exchange.failure = f"the connection broke before a response: {exc}"
        finally:
            exchange.answered = upstream.received_bytes > start

    async def _end_early(self, exchange: _Exchange) -> None:
        """The upstream answered before the body was all sent. When every byte of a
        Content-Length body went, the request is complete after all; otherwise the upstream
        is told no more is coming (half-close) and the connection is not kept."""
        plan, upstream = exchange.plan, exchange.upstream
        if plan.framing is Framing.LENGTH and exchange.body_bytes_sent == plan.content_length:
            if upstream.http.our_state is h11.SEND_BODY:
                upstream.http.send(h11.EndOfMessage())  # no bytes with Content-Length
            return
        upstream.reusable = False
        try:
            await upstream.stream.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _respond(
        self,
        key: Hashable,
        name: str,
        upstream: _Upstream,
        head: h11.Response,
        exchange: _Exchange,
    ) -> StreamResponse | BytesResponse:
        response = plan_response(
            head.status_code,
            [(k.decode("latin-1"), v.decode("latin-1")) for k, v in head.headers],
        )
        # Whatever of the body came with the head is taken now; a response that is complete
        # (HEAD, 204, small bodies) frees its connection before the client reads a byte.
        ready: list[bytes] = []
        complete = False
        try:
            while True:
                event = upstream.http.next_event()
                if isinstance(event, h11.Data):
                    ready.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    complete = True
                    break
                else:
                    break
        except h11.RemoteProtocolError as exc:
            raise ApiError(
                ErrorCode.UNAVAILABLE, f"{name} sent a malformed response body: {exc}"
            ) from None
        if complete:
            # The whole answer is here: sent as one write, head and body together.
            await self._release(key, upstream)
            return BytesResponse(
                b"".join(ready), response.content_type, response.status, response.headers
            )

        async def chunks() -> AsyncGenerator[bytes, None]:
            for piece in ready:
                yield piece
            finished = False
            try:
                while True:
                    try:
                        event = await upstream.next_event()
                    except (h11.RemoteProtocolError, trio.BrokenResourceError) as exc:
                        # Raised into the response stream: the client sees it reset, never a
                        # short body that looks whole.
                        raise ApiError(
                            ErrorCode.UNAVAILABLE,
                            f"{name} stopped sending the response to {exchange.plan.method} "
                            f"{exchange.plan.target} before its end: {exc}",
                        ) from None
                    if isinstance(event, h11.Data):
                        yield bytes(event.data)
                    elif isinstance(event, h11.EndOfMessage):
                        finished = True
                        return
            finally:
                if finished:
                    await self._release(key, upstream)
                else:
                    await upstream.aclose()

        return StreamResponse(
            chunks=chunks,
            content_type=response.content_type,
            status=response.status,
            headers=response.headers,
        )


def _request_head(http: h11.Connection, plan: UpstreamRequest) -> tuple[bytes, bool]:
    """`plan`'s request head given to h11: its bytes, and whether the request is complete
    with them (no body). INVALID_ARGUMENT when it cannot be sent as HTTP/1.1."""
    try:
        head = http.send(
            h11.Request(
                method=plan.method.encode("ascii"),
                target=plan.target.encode("ascii"),
                headers=[(k.encode("latin-1"), v.encode("latin-1")) for k, v in plan.headers],
            )
        )
        if plan.framing is Framing.NONE:
            return (head or b"") + (http.send(h11.EndOfMessage()) or b""), True
    except (h11.LocalProtocolError, UnicodeEncodeError) as exc:
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT, f"the request cannot be sent as HTTP/1.1: {exc}"
        ) from None
    return head or b"", False


def _describe(key: Hashable) -> str:
    if isinstance(key, tuple) and key and isinstance(key[-1], int):
        return f"the task's port {key[-1]}"
    return f"the endpoint {key!r}"


__all__ = [
    "DEFAULT_CONTENT_TYPE",
    "HOP_BY_HOP",
    "EndpointProxy",
    "Framing",
    "UpstreamRequest",
    "UpstreamResponse",
    "connection_scoped",
    "end_to_end",
    "forwarded_value",
    "may_retry",
    "plan_request",
    "plan_response",
    "upstream_target",
]
