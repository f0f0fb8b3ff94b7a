"""HTTP/2 API request handling: authentication, routing, JSON, streams and CONNECT.

Both programs serve their API with it, the agent the worker API and the controlplane its own,
and each names itself (`program`) in the errors it answers. One `Service` serves every HTTP/2
stream the agent accepts, whichever way the connection came (its own TLS listener, or the
tunnel it dialed): there is no second code path. The bearer secret is checked before any
route runs. Routes are a table of (method, path pattern) → handler; later capabilities add
theirs to the same `Router`. A handler returns a response value (JSON, a byte stream) or
raises `ApiError`; plain CONNECT to `host:port` becomes a two-way byte stream to that address
on the serving program's side (when policy allows it, or through `dial`) and RFC 8441
extended CONNECT with `:protocol websocket` reaches WebSocket routes.
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import hmac
import ipaddress
import logging
import time
import urllib.parse
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import attrs
import trio

from wire.client import OpeningStream
from wire.connection import BodyTooLarge, H2ByteStream, H2Stream, Headers, StreamError
from wire.errors import ApiError, ErrorCode, dumps, loads
from wire.h2websocket import H2WebSocket
from wire.untrusted import clip

log = logging.getLogger("levers9.api")
T = TypeVar("T")

MAX_JSON_BODY_BYTES = 4 * 1024 * 1024
PROXY_CHUNK_BYTES = 1024 * 1024


@attrs.frozen
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    params: dict[str, str]
    stream: H2Stream
    authority: str = ""
    principal: str = ""
    raw_query: str = ""

    async def body(self, limit_bytes: int = MAX_JSON_BODY_BYTES) -> bytes:
        """The whole body; one over `limit_bytes` is answered 400 naming the limit, and only
        then is the rest of it reset (NO_ERROR), so the caller reads why, not a bare reset."""
        try:
            return await self.stream.read_all(limit_bytes, reset=False)
        except BodyTooLarge:
            raise ApiError(
                ErrorCode.INVALID_ARGUMENT, f"request body is larger than {limit_bytes} bytes"
            ) from None

    async def json(self, cls: type[T]) -> T:
        return loads(await self.body(), cls)


@attrs.frozen
class JsonResponse:
    body: Any
    status: int = 200


@attrs.frozen
class StreamResponse:
    """A body produced while it is sent (logs, object downloads): chunks from an iterator."""

    chunks: Callable[[], AsyncGenerator[bytes, None]]
    content_type: str = "application/octet-stream"
    status: int = 200
    headers: Sequence[tuple[str, str]] = ()
    stall_timeout_s: float | None = None
    """Reset the stream when its caller has not taken a chunk for this long (a watch no one
    reads must not hold its generator, and its memory, for ever). None: wait as long as the
    caller keeps the stream."""


@attrs.frozen
class BytesResponse:
    """A whole body known up front, with its type and headers (pages, static files)."""

    body: bytes
    content_type: str
    status: int = 200
    headers: Sequence[tuple[str, str]] = ()


Response = JsonResponse | StreamResponse | BytesResponse
Authenticator = Callable[[dict[str, str]], str | None]
"""Returns who made the request (a principal name) from its headers, or None to refuse it."""
SessionAuthenticator = Callable[[dict[str, str]], Awaitable[str | None]]
"""Asked when the `Authenticator` found no one: who the request's session (state kept elsewhere,
such as the dashboard's cookie) stands for, or None; it may raise ApiError to refuse."""
ErrorHeaders = Callable[[str], Sequence[tuple[str, str]]]
"""Extra headers for an error answer to a path (the dashboard's security headers)."""


def bearer_auth(token: str, principal: str = "controlplane") -> Authenticator:
    """Accept exactly `Authorization: Bearer <token>`, compared in constant time."""
    if not token:
        raise ValueError("bearer authentication needs a non-empty token")
    expected = f"Bearer {token}".encode()

    def authenticate(headers: dict[str, str]) -> str | None:
        given = headers.get("authorization", "").encode("latin-1")
        return principal if hmac.compare_digest(given, expected) else None

    return authenticate


def bearer_token(headers: dict[str, str]) -> str | None:
    """The token of an `Authorization: Bearer` header, if any."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


Handler = Callable[[Request], Awaitable[Response | Any]]
WebSocketHandler = Callable[[Request, H2WebSocket], Awaitable[None]]
Dialer = Callable[[str, int, str], Awaitable[trio.abc.HalfCloseableStream]]
Observer = Callable[[str, str, int, float], None]
"""Told of every request once it is answered: (method, route pattern, status, seconds). The
route is the pattern (`/v1/tasks/{id}`), never the path, so what counts requests stays
bounded; `CONNECT` for a plain CONNECT and `unmatched` before any route was found. The method is
the client's own: make it a label only through `wire.untrusted.method_label`."""
UNMATCHED = "unmatched"


@attrs.frozen
class _Route:
    method: str
    parts: tuple[str, ...]
    handler: Any
    pattern: str = ""
    public: bool = False
    """Served without credentials (the dashboard's sign-in page and static files)."""

    def match(self, parts: Sequence[str]) -> dict[str, str] | None:
        params: dict[str, str] = {}
        if self.parts and self.parts[-1].startswith("{") and self.parts[-1].endswith("...}"):
            # `{name...}` takes the rest of the path (zero or more segments), unquoted as-is.
            head = len(self.parts) - 1
            if len(parts) < head:
                return None
            params[self.parts[-1][1:-4]] = "/".join(parts[head:])
            return self._match_fixed(self.parts[:head], parts[:head], params)
        if len(parts) != len(self.parts):
            return None
        return self._match_fixed(self.parts, parts, params)

    @staticmethod
    def _match_fixed(
        patterns: Sequence[str], parts: Sequence[str], params: dict[str, str]
    ) -> dict[str, str] | None:
        for pattern, value in zip(patterns, parts, strict=True):
            if pattern.startswith("{") and pattern.endswith("}"):
                if not value:
                    return None
                params[pattern[1:-1]] = urllib.parse.unquote(value)
            elif pattern != value:
                return None
        return params


class Router:
    """A table of (method, path pattern) → handler; `{name}` segments become params."""

    def __init__(self) -> None:
        self._routes: list[_Route] = []

    def add(self, method: str, pattern: str, handler: Handler, *, public: bool = False) -> None:
        """`public`: the route runs for a caller without credentials too (principal "")."""
        self._routes.append(_Route(method.upper(), _split(pattern), handler, pattern, public))

    def add_websocket(self, pattern: str, handler: WebSocketHandler) -> None:
        self._routes.append(_Route("WEBSOCKET", _split(pattern), handler, pattern))

    def route(self, method: str, pattern: str) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            self.add(method, pattern, handler)
            return handler

        return register

    def resolve(self, method: str, path: str) -> tuple[Any, dict[str, str]]:
        route, params = self.find(method, path)
        return route.handler, params

    def find(self, method: str, path: str) -> tuple[_Route, dict[str, str]]:
        """The route serving `method path` and its params, or NOT_FOUND / the methods allowed."""
        parts = _split(path)
        allowed: list[str] = []
        for route in self._routes:
            params = route.match(parts)
            if params is None:
                continue
            if route.method == method:
                return route, params
            allowed.append(route.method)
        if allowed:
            raise ApiError(
                ErrorCode.INVALID_ARGUMENT,
                f"{method} is not supported on {path}; use {', '.join(sorted(set(allowed)))}",
            )
        raise ApiError(ErrorCode.NOT_FOUND, f"no such route: {method} {path}")


def _split(path: str) -> tuple[str, ...]:
    return tuple(path.strip("/").split("/")) if path.strip("/") else ()


@attrs.frozen
class ConnectPolicy:
    """Which literal addresses a plain CONNECT may reach on the worker's side.

    None by default. A container's port is reached by name, `<container id>:<port>`, and only
    a port the container declared (`Service.resolve_name`); an address is another matter: with
    `hostNetwork: true` the worker's loopback is the node's (the kubelet's ports, sshd), which
    whoever holds a worker token must not reach. `loopback` opens 127.0.0.0/8 and ::1 (the
    agent's LEVERS9_LOOPBACK_CONNECT=on, for tests and benchmarks), `ports` narrows it.
    """

    loopback: bool = False
    ports: tuple[int, ...] = ()
    """With `loopback`: only these ports (empty: any)."""
    setting: str = ""
    """What turns `loopback` on, named in a refusal so the operator knows where to look."""

    def check(self, host: str, port: int) -> None:
        """Raise PERMISSION_DENIED unless `host:port` is an allowed literal address."""
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            raise ApiError(
                ErrorCode.INVALID_ARGUMENT,
                f"CONNECT target {host!r} must be an IP address",
                field=":authority",
            ) from None
        if not self.loopback:
            how = f"; {self.setting} allows its loopback" if self.setting else ""
            raise ApiError(
                ErrorCode.PERMISSION_DENIED,
                f"CONNECT to {host}:{port} is refused: this worker reaches only its containers' "
                f"declared ports (CONNECT <container id>:<port>){how}",
                field=":authority",
            )
        if not address.is_loopback:
            raise ApiError(
                ErrorCode.PERMISSION_DENIED,
                f"CONNECT to {host}:{port} is not allowed from this worker: it allows only "
                "its loopback (127.0.0.0/8, ::1)",
                field=":authority",
            )
        if self.ports and port not in self.ports:
            raise ApiError(
                ErrorCode.PERMISSION_DENIED,
                f"CONNECT to port {port} is not allowed from this worker",
                field=":authority",
            )


def parse_authority(authority: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` → (host, port); INVALID_ARGUMENT naming :authority."""
    try:
        parsed = urllib.parse.urlsplit("//" + authority)
        host, port = parsed.hostname, parsed.port
    except ValueError:
        host, port = None, None
    if not host or port is None or not 0 < port < 65536:
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"CONNECT needs :authority host:port, not {authority!r}",
            field=":authority",
        )
    return host, port


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _decode(headers: Headers) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in headers:
        key, value = k.decode("latin-1"), v.decode("latin-1")
        if key == "cookie" and key in out:
            # HTTP/2 may split the cookie header into crumbs (RFC 9113 8.2.3): one again.
            value = f"{out[key]}; {value}"
        out[key] = value
    return out


def _date() -> bytes:
    """The `date` header (RFC 9110 6.6.1): callers compare it with their clock (self-check)."""
    return _http_date(int(time.time()))


@functools.lru_cache(maxsize=1)
def _http_date(second: int) -> bytes:
    """It names whole seconds: formatted once a second, not once a response."""
    return email.utils.formatdate(second, usegmt=True).encode()


def request_log_level(status: int) -> int:
    """A request answered with success is a debug line: on a busy endpoint or port forward
    that is one per request, which would crowd the agent's recent log (`/v1/agent/logs`) and
    cost the data path its CPU; the request metrics count them. An error, or a request that
    ended without a status (cancelled), is an info line."""
    return logging.DEBUG if 0 < status < 400 else logging.INFO


def _error_headers(status: int) -> Headers:
    return [
        (b":status", str(status).encode()),
        (b"content-type", b"application/json"),
        (b"date", _date()),
    ]


class Service:
    """Handles every stream of one program's API connections: auth, then routing."""

    def __init__(
        self,
        router: Router,
        *,
        program: str,
        authenticate: Authenticator,
        connect_policy: ConnectPolicy | None = None,
        resolve_name: Callable[[str, int], str] | None = None,
        dial: Dialer | None = None,
        name: str = "worker",
        observe: Observer | None = None,
        authenticate_session: SessionAuthenticator | None = None,
        error_headers: ErrorHeaders | None = None,
    ) -> None:
        self.router = router
        self.program = program
        """The program serving, as its users call it ("worker", "controlplane"): errors say
        which one failed, so a controlplane user is never told a worker did."""
        self.authenticate = authenticate
        self.authenticate_session = authenticate_session
        self.error_headers = error_headers
        self.connect_policy = connect_policy
        self.resolve_name = resolve_name
        """Plain CONNECT to a name (not an address): (name, port) → the address to dial, or
        ApiError (containers' declared ports are reached as `<container id>:<port>`)."""
        self.dial = dial
        """Plain CONNECT served by the caller: (host, port, principal) → the stream to splice
        with (the controlplane reaches a task's port through its worker)."""
        self.name = name
        self.observe = observe

    async def __call__(self, stream: H2Stream) -> None:
        started = time.monotonic()
        headers = _decode(stream.headers or [])
        method = headers.get(":method", "")
        raw_path = headers.get(":path", "")
        path, _, query = raw_path.partition("?")
        status = 0
        routed = [UNMATCHED]
        try:
            status = await self._handle(stream, headers, method, path, query, routed)
        except ApiError as exc:
            status = exc.code.status
            await self._send_error(stream, exc, path, head=method == "HEAD")
        except StreamError:
            status = 499
        except Exception:
            log.exception(
                "%s: handler failed for %s %s",
                self.name,
                clip(method),
                clip(path),
                extra={"api": self.name, "method": clip(method), "path": clip(path)},
            )
            status = 500
            await self._send_error(
                stream,
                ApiError(ErrorCode.INTERNAL, f"the {self.program} failed to handle the request"),
                path,
                head=method == "HEAD",
            )
        finally:
            duration = time.monotonic() - started
            if self.observe is not None:
                self.observe(method, routed[0], status, duration)
            level = request_log_level(status)
            if log.isEnabledFor(level):
                # What the client sent is clipped: a line stays short however long it was.
                target = clip(path or headers.get(":authority", ""))
                log.log(
                    level,
                    "%s %s %s",
                    clip(method),
                    target,
                    status,
                    extra={
                        "api": self.name,
                        "method": clip(method),
                        "path": target,
                        "status": status,
                        "duration_s": round(duration, 4),
                    },
                )

    async def _send_error(
        self, stream: H2Stream, exc: ApiError, path: str = "", *, head: bool = False
    ) -> None:
        """The error as a status and a JSON body; an answer to HEAD carries no body (RFC 9110
        9.3.2), which h2 clients enforce by breaking the connection."""
        if stream._error is not None or stream._sent_end:
            return
        try:
            if not stream.sent_headers:
                headers = _error_headers(exc.code.status)
                if self.error_headers is not None:
                    headers += [
                        (k.lower().encode(), v.encode()) for k, v in self.error_headers(path)
                    ]
                if head:
                    await stream.send_headers(headers, end_stream=True)
                    return
                await stream.send_headers(headers)
                await stream.send_data(dumps(exc.to_body()), end_stream=True)
        except StreamError:
            pass

    async def _handle(
        self,
        stream: H2Stream,
        headers: dict[str, str],
        method: str,
        path: str,
        query: str,
        routed: list[str],
    ) -> int:
        principal = self.authenticate(headers)
        if principal is None and self.authenticate_session is not None:
            principal = await self.authenticate_session(headers)
        if principal is None:
            principal = self._anonymous(method, path)
        protocol = headers.get(":protocol")
        if method == "CONNECT" and protocol is None:
            routed[0] = "CONNECT"
            return await self._connect(stream, headers.get(":authority", ""), principal)
        if method == "CONNECT":
            if protocol != "websocket":
                raise ApiError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"extended CONNECT protocol {protocol!r} is not supported; use 'websocket'",
                    field=":protocol",
                )
            route, params = self.router.find("WEBSOCKET", path)
            routed[0] = route.pattern
            handler = route.handler
            request = self._request(stream, headers, "WEBSOCKET", path, query, params, principal)
            await stream.send_headers([(b":status", b"200")])
            ws = H2WebSocket(H2ByteStream(stream), client_side=False)
            try:
                await handler(request, ws)
            finally:
                await ws.aclose()
            return 200
        route, params = self.router.find(method, path)
        routed[0] = route.pattern
        request = self._request(stream, headers, method, path, query, params, principal)
        result = await route.handler(request)
        response = (
            result
            if isinstance(result, JsonResponse | StreamResponse | BytesResponse)
            else (JsonResponse(result))
        )
        await self._respond(stream, response)
        return response.status

    def _anonymous(self, method: str, path: str) -> str:
        """A caller without credentials reaches public routes only (principal ""); anything
        else, an unknown path included, is UNAUTHENTICATED."""
        if method != "CONNECT":
            with contextlib.suppress(ApiError):
                route, _ = self.router.find(method, path)
                if route.public:
                    return ""
        raise ApiError(ErrorCode.UNAUTHENTICATED, "missing or wrong bearer token")

    def _request(
        self,
        stream: H2Stream,
        headers: dict[str, str],
        method: str,
        path: str,
        query: str,
        params: dict[str, str],
        principal: str,
    ) -> Request:
        return Request(
            method=method,
            path=path,
            query=dict(urllib.parse.parse_qsl(query)),
            headers={k: v for k, v in headers.items() if not k.startswith(":")},
            params=params,
            stream=stream,
            authority=headers.get(":authority", ""),
            principal=principal,
            raw_query=query,
        )

    async def _respond(self, stream: H2Stream, response: Response) -> None:
        if isinstance(response, JsonResponse):
            body = dumps(response.body)
            await stream.send_headers(
                [
                    (b":status", str(response.status).encode()),
                    (b"date", _date()),
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
                flush=False,
            )
            await stream.send_data(body, end_stream=True)
            return
        if isinstance(response, BytesResponse):
            # Head and body in one write. A proxied answer keeps its origin's Date, and its
            # Content-Length (a HEAD's, which has no body).
            names = {k.lower() for k, _ in response.headers}
            whole: Headers = [
                (b":status", str(response.status).encode()),
                (b"content-type", response.content_type.encode()),
            ]
            if "date" not in names:
                whole.append((b"date", _date()))
            if "content-length" not in names:
                whole.append((b"content-length", str(len(response.body)).encode()))
            whole += [(k.lower().encode(), v.encode()) for k, v in response.headers]
            await stream.send_headers(whole, flush=False)
            await stream.send_data(response.body, end_stream=True)
            return
        head: Headers = [
            (b":status", str(response.status).encode()),
            (b"content-type", response.content_type.encode()),
        ]
        if not any(k.lower() == "date" for k, _ in response.headers):
            head.append((b"date", _date()))  # a proxied answer keeps its origin's
        head += [(k.lower().encode(), v.encode()) for k, v in response.headers]
        await stream.send_headers(head)
        async with contextlib.aclosing(response.chunks()) as chunks:
            async for chunk in chunks:
                if not chunk:
                    continue
                if response.stall_timeout_s is None:
                    await stream.send_data(chunk)
                    continue
                with trio.move_on_after(response.stall_timeout_s) as stalled:
                    await stream.send_data(chunk)
                if stalled.cancelled_caught:
                    await stream.reset()
                    return
        await stream.end()

    async def _connect(self, stream: H2Stream, authority: str, principal: str) -> int:
        host, port = parse_authority(authority)
        if self.dial is not None:
            remote = await self.dial(host, port, principal)
            async with remote:
                if isinstance(remote, OpeningStream):
                    # Not yet answered: the client's bytes go on at once, and the answer
                    # (or the refusal, as this CONNECT's error) once the far end gives it.
                    answer = functools.partial(_answer_when_open, stream, remote)
                    await splice(H2ByteStream(stream), remote, opening=answer)
                    return 200
                await stream.send_headers([(b":status", b"200")])
                await splice(H2ByteStream(stream), remote)
            return 200
        if self.resolve_name is not None and not _is_address(host):
            host = self.resolve_name(host, port)
        elif self.connect_policy is not None:
            self.connect_policy.check(host, port)
        else:
            raise ApiError(ErrorCode.UNIMPLEMENTED, "CONNECT is not served here")
        try:
            target = await open_tcp(host, port)
        except OSError as exc:
            raise ApiError(
                ErrorCode.UNAVAILABLE,
                f"cannot reach {host}:{port} on the {self.program}: {exc.strerror or exc}",
            ) from None
        async with target:
            await stream.send_headers([(b":status", b"200")])
            await splice(H2ByteStream(stream), target)
        return 200


async def _answer_when_open(stream: H2Stream, remote: OpeningStream) -> None:
    await remote.wait_open()
    await stream.send_headers([(b":status", b"200")])


async def open_tcp(host: str, port: int) -> trio.SocketStream:
    """A TCP connection to `host:port`. An address (what a container's name resolves to) is
    connected to directly: `trio.open_tcp_stream`'s name lookup and happy-eyeballs race, a
    nursery and a task per connection, buy nothing when there is one address to try."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return await trio.open_tcp_stream(host, port)
    family = trio.socket.AF_INET6 if address.version == 6 else trio.socket.AF_INET
    sock = trio.socket.socket(family, trio.socket.SOCK_STREAM)
    try:
        await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def splice(
    a: trio.abc.HalfCloseableStream,
    b: trio.abc.HalfCloseableStream,
    *,
    opening: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Copy both ways until both sides have ended; EOF is passed on as a half-close.

    `opening`: b is still being opened (a CONNECT not yet answered). a's bytes flow to b at
    once while it is awaited; b's flow to a once it has returned. What it raises ends the
    splice and is raised here, before anything of b's reached a."""
    opened = opening is None

    async def pump(src: trio.abc.HalfCloseableStream, dst: trio.abc.HalfCloseableStream) -> None:
        try:
            while data := await src.receive_some(PROXY_CHUNK_BYTES):
                await dst.send_all(data)
            await dst.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # Before the answer a broken b is the refusal arriving: `opening` says why.
            if opened:
                nursery.cancel_scope.cancel()

    failure: BaseException | None = None
    async with trio.open_nursery() as nursery:
        if opening is None:
            nursery.start_soon(pump, b, a)
            await pump(a, b)  # in this task: one task fewer to start per connection
        else:
            nursery.start_soon(pump, a, b)
            try:
                await opening()
            except Exception as exc:
                failure = exc
                nursery.cancel_scope.cancel()
            else:
                opened = True
                await pump(b, a)
    if failure is not None:
        raise failure


__all__ = [
    "Authenticator",
    "ConnectPolicy",
    "ErrorHeaders",
    "JsonResponse",
    "Request",
    "Router",
    "Service",
    "SessionAuthenticator",
    "StreamResponse",
    "bearer_auth",
    "bearer_token",
    "open_tcp",
    "parse_authority",
    "splice",
]
