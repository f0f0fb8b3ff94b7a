"""Endpoints: HTTP/2 requests to the controlplane forwarded as HTTP/1.1 to a task's port.

The client side is real: an `ApiClient` talks HTTP/2 (in memory) to a `Service` whose route
calls `EndpointProxy.forward`, so the request body arrives as a flow-controlled H2 stream. The
upstream is a small trio + h11 server on loopback that records what it was sent and can
misbehave on request (close, cut a body short, answer early, send garbage).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator

import attrs
import h11
import pytest
import trio
import trio.testing

from control.api import endpoints
from control.api.endpoints import (
    DEFAULT_CONTENT_TYPE,
    EndpointProxy,
    Framing,
    end_to_end,
    forwarded_value,
    may_retry,
    plan_request,
    plan_response,
    upstream_target,
)
from control.ui.session import COOKIE
from wire.client import ApiClient, open_api_client
from wire.connection import Headers, Http2Connection, header_value
from wire.errors import ApiError, ErrorCode
from wire.http2 import Http2Settings
from wire.service import (
    BytesResponse,
    ConnectPolicy,
    Request,
    Router,
    Service,
    StreamResponse,
    bearer_auth,
)

TOKEN = "controlplane-s3cr3t"
AUTHORITY = "t-1.endpoints.example.com"

# -- the upstream: a task's HTTP/1.1 server ---------------------------------------------------


@attrs.frozen
class Seen:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body_bytes: int

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)


@attrs.define
class Upstream:
    """Answers by path: /close, /garbage, /cut, /chunked, /upload, /reject, /bye, /last (with
    Connection: close); any other path echoes the request as JSON. Counts the connections it
    accepted."""

    port: int = 0
    connections: int = 0
    seen: list[Seen] = attrs.field(factory=list)

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        http = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                request = await _next_event(http, stream)
                if not isinstance(request, h11.Request):
                    return
                target = request.target.decode()
                path = target.partition("?")[0]
                headers = [(k.decode(), v.decode()) for k, v in request.headers]
                if path == "/close":
                    return
                if path == "/garbage":
                    await stream.send_all(b"SPDY/3 what is this\r\n\r\n")
                    return
                if path == "/reject":
                    # Answers before reading the body, then drains it as a polite server does.
                    await _respond(
                        stream, http, 413, b"too large", [("content-type", "text/plain")]
                    )
                    while await stream.receive_some():
                        pass
                    return
                digest, size = hashlib.sha256(), 0
                while True:
                    event = await _next_event(http, stream)
                    if isinstance(event, h11.Data):
                        digest.update(event.data)
                        size += len(event.data)
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        return
                self.seen.append(Seen(request.method.decode(), target, headers, size))
                if path == "/cut":
                    head = h11.Response(status_code=200, headers=[("content-length", "100")])
                    await stream.send_all(http.send(head) or b"")
                    await stream.send_all(http.send(h11.Data(data=b"x" * 10)) or b"")
                    return
                if path == "/chunked":
                    chunked = [("content-type", "text/plain"), ("transfer-encoding", "chunked")]
                    head = h11.Response(status_code=200, headers=chunked)
                    await stream.send_all(http.send(head) or b"")
                    for part in (b"one,", b"two,", b"three"):
                        await stream.send_all(http.send(h11.Data(data=part)) or b"")
                    await stream.send_all(http.send(h11.EndOfMessage()) or b"")
                elif path == "/upload":
                    answer = {"sha256": digest.hexdigest(), "bytes": size}
                    await _respond(stream, http, 200, json.dumps(answer).encode(), [])
                else:
                    echo = {"method": request.method.decode(), "target": target, "headers": headers}
                    extra = [
                        ("content-type", "application/json"),
                        ("x-upstream", "yes"),
                        ("set-cookie", "a=1"),
                        ("set-cookie", "b=2"),
                        ("connection", "x-hop"),
                        ("x-hop", "only for this connection"),
                        ("keep-alive", "timeout=5"),
                    ]
                    if path == "/last":
                        extra = [h for h in extra if h[0] not in ("connection", "keep-alive")]
                        extra.append(("connection", "close"))
                    if path == "/plant":
                        # A task's code trying to set (or clear) the dashboard's session.
                        extra += [
                            ("set-cookie", f"{COOKIE}=planted; Path=/; Secure; HttpOnly"),
                            ("set-cookie", f"{COOKIE.upper()}=; Path=/; Max-Age=0"),
                        ]
                    await _respond(
                        stream,
                        http,
                        200,
                        json.dumps(echo).encode(),
                        extra,
                        head_request=request.method == b"HEAD",
                    )
                if path == "/bye":
                    return  # closed while the client keeps it for reuse, as idle timeouts do
                if path == "/last":
                    return  # answered with Connection: close (below), then closed
                if http.our_state is not h11.DONE or http.their_state is not h11.DONE:
                    return
                http.start_next_cycle()


async def _next_event(http: h11.Connection, stream: trio.SocketStream) -> object:
    while (event := http.next_event()) is h11.NEED_DATA:
        try:
            http.receive_data(await stream.receive_some(65536))
        except trio.BrokenResourceError:
            return h11.ConnectionClosed()
    return event


async def _respond(
    stream: trio.SocketStream,
    http: h11.Connection,
    status: int,
    body: bytes,
    headers: list[tuple[str, str]],
    *,
    head_request: bool = False,
) -> None:
    head = h11.Response(status_code=status, headers=[*headers, ("content-length", str(len(body)))])
    data = http.send(head) or b""
    if body and not head_request:
        data += http.send(h11.Data(data=body)) or b""
    data += http.send(h11.EndOfMessage()) or b""
    await stream.send_all(data)


# -- the controlplane side: Service → route → proxy -------------------------------------------


@attrs.define
class Harness:
    client: ApiClient
    upstream: Upstream
    proxy: EndpointProxy
    opened: int = 0
    firsts: list[bytes] = attrs.field(factory=list)
    """What each opening carried (`open_stream(first)`)."""

    @property
    def key(self) -> tuple[str, str, int]:
        return ("w-1", "t-1", self.upstream.port)

    async def get(self, path: bytes, headers: Headers) -> tuple[Headers, bytes]:
        """A GET of `path` with the token and `headers` as they are, past what `ApiClient`
        would send: the answer's headers and body."""
        stream = await self.client.conn.open_stream(
            [
                (b":method", b"GET"),
                (b":scheme", b"https"),
                (b":authority", AUTHORITY.encode()),
                (b":path", path),
                (b"authorization", f"Bearer {TOKEN}".encode()),
                *headers,
            ],
            end_stream=True,
        )
        answer = await stream.wait_headers()
        body = await stream.read_all(1 << 20)
        self.client.conn.forget(stream)
        return answer, body


@pytest.fixture
async def harness(nursery: trio.Nursery) -> AsyncIterator[Harness]:
    upstream = Upstream()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    upstream.port = listeners[0].socket.getsockname()[1]
    nursery.start_soon(trio.serve_listeners, upstream.handle, listeners)
    proxy = EndpointProxy()
    router = Router()
    server_side, client_side = trio.testing.memory_stream_pair()
    async with open_api_client(client_side, ApiClient, token=TOKEN, authority=AUTHORITY) as client:
        harness = Harness(client, upstream, proxy)

        async def open_upstream(first: bytes) -> trio.abc.HalfCloseableStream:
            harness.opened += 1
            harness.firsts.append(first)
            stream = await trio.open_tcp_stream("127.0.0.1", upstream.port)
            await stream.send_all(first)
            return stream

        async def to_port(request: Request) -> StreamResponse | BytesResponse:
            raw_path = header_value(request.stream.headers or [], b":path") or b"/"
            return await proxy.forward(
                request,
                key=harness.key,
                target=upstream_target(raw_path.decode(), strip_segments=1),
                open_stream=open_upstream,
            )

        async def unreachable(request: Request) -> StreamResponse | BytesResponse:
            async def gone(first: bytes) -> trio.abc.HalfCloseableStream:
                raise ApiError(ErrorCode.UNAVAILABLE, "worker w-9 is not connected")

            return await proxy.forward(
                request, key=("w-9", "t-9", 80), target="/", open_stream=gone
            )

        for method in ("GET", "HEAD", "POST", "PUT", "DELETE"):
            router.add(method, "/p/{rest}", to_port)
        router.add("GET", "/gone", unreachable)
        service = Service(router, program="controlplane", authenticate=bearer_auth(TOKEN))
        conn = Http2Connection(server_side, client_side=False, handler=service)
        nursery.start_soon(conn.run)
        try:
            yield harness
        finally:
            await proxy.aclose()


async def _get_json(client: ApiClient, path: str) -> dict[str, object]:
    response = await client.open("GET", path)
    try:
        body = await response.read()
    finally:
        await response.aclose()
    assert response.status == 200, body
    result: dict[str, object] = json.loads(body)
    return result


# -- forwarding --------------------------------------------------------------------------------


async def test_get_with_query_returns_status_headers_and_body(harness: Harness) -> None:
    response = await harness.client.open("GET", "/p/hello?x=1&y=a%20b")
    body = await response.read()
    await response.aclose()
    assert response.status == 200
    echo = json.loads(body)
    assert echo["method"] == "GET"
    assert echo["target"] == "/hello?x=1&y=a%20b"
    headers = response.stream.headers or []
    assert header_value(headers, b"content-type") == b"application/json"
    assert header_value(headers, b"x-upstream") == b"yes"
    assert header_value(headers, b"content-length") == str(len(body)).encode()
    assert [v for k, v in headers if k == b"set-cookie"] == [b"a=1", b"b=2"]
    # What the upstream said about its own connection stays on that connection.
    names = {k for k, _ in headers}
    assert not names & {b"connection", b"keep-alive", b"x-hop"}


async def test_authorization_stays_behind_and_host_is_the_clients_authority(
    harness: Harness,
) -> None:
    await harness.get(
        b"/p/whoami",
        [
            (b"proxy-authorization", b"Basic c2VjcmV0"),
            (b"x-forwarded-host", b"spoofed.example"),
            (b"x-custom", b"kept"),
        ],
    )
    seen = harness.upstream.seen[-1]
    names = {k for k, _ in seen.headers}
    assert "authorization" not in names
    assert "proxy-authorization" not in names
    assert TOKEN not in json.dumps(seen.headers)
    assert seen.header("host") == AUTHORITY
    assert seen.header("x-forwarded-host") == AUTHORITY
    assert seen.header("x-forwarded-proto") == "https"
    assert seen.header("forwarded") == f"host={AUTHORITY};proto=https"
    assert seen.header("x-custom") == "kept"
    # A GET without a body goes without framing headers.
    assert "content-length" not in names and "transfer-encoding" not in names


async def test_the_dashboards_session_cookie_stays_behind_and_the_apps_cookies_pass(
    harness: Harness,
) -> None:
    session = "S" * 43
    await harness.get(
        b"/p/whoami",
        [(b"cookie", f"app=1; {COOKIE}={session}".encode()), (b"cookie", b"theme=dark")],
    )
    seen = harness.upstream.seen[-1]
    assert "authorization" not in {k for k, _ in seen.headers}
    assert session not in json.dumps(seen.headers) and TOKEN not in json.dumps(seen.headers)
    assert seen.header("cookie") == "app=1; theme=dark"
    await harness.get(b"/p/whoami", [(b"cookie", f"{COOKIE}={session}".encode())])
    assert "cookie" not in {k for k, _ in harness.upstream.seen[-1].headers}


async def test_a_task_cannot_set_the_dashboards_session_cookie(harness: Harness) -> None:
    headers, _ = await harness.get(b"/p/plant", [])
    cookies = [v.decode() for k, v in headers if k == b"set-cookie"]
    assert cookies == ["a=1", "b=2"]


async def test_post_streams_a_large_body_with_its_length(harness: Harness) -> None:
    payload = bytes(range(256)) * (3 * 1024 * 4)  # 3 MiB
    response = await harness.client.open(
        "POST", "/p/upload", payload, content_type="application/octet-stream"
    )
    body = await response.read()
    await response.aclose()
    assert response.status == 200
    assert json.loads(body) == {
        "sha256": hashlib.sha256(payload).hexdigest(),
        "bytes": len(payload),
    }
    seen = harness.upstream.seen[-1]
    assert seen.header("content-length") == str(len(payload))
    assert seen.header("content-type") == "application/octet-stream"


async def test_post_of_unknown_length_is_sent_chunked(harness: Harness) -> None:
    stream = await harness.client.conn.open_stream(
        [
            (b":method", b"POST"),
            (b":scheme", b"https"),
            (b":authority", AUTHORITY.encode()),
            (b":path", b"/p/upload"),
            (b"authorization", f"Bearer {TOKEN}".encode()),
        ]
    )
    digest, size = hashlib.sha256(), 0
    for i in range(48):
        piece = bytes([i]) * 65536
        digest.update(piece)
        size += len(piece)
        await stream.send_data(piece)
    await stream.end()
    headers = await stream.wait_headers()
    body = await stream.read_all(1 << 20)
    harness.client.conn.forget(stream)
    assert header_value(headers, b":status") == b"200"
    assert json.loads(body) == {"sha256": digest.hexdigest(), "bytes": size}
    assert harness.upstream.seen[-1].header("transfer-encoding") == "chunked"


async def test_sequential_requests_share_one_upstream_connection(harness: Harness) -> None:
    for i in range(20):
        if i % 2:
            response = await harness.client.open("POST", f"/p/upload?i={i}", b"x" * i * 1000)
        else:
            response = await harness.client.open("GET", f"/p/hello?i={i}")
        await response.read()
        await response.aclose()
        assert response.status == 200
    assert len(harness.upstream.seen) == 20
    assert harness.upstream.connections == 1
    assert harness.opened == 1


@pytest.mark.parametrize("limit", [endpoints.FIRST_BYTES_LIMIT, 10])
async def test_a_new_connections_request_head_goes_with_its_opening_when_small(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    """The head travels with the CONNECT that opens the connection (one write, no round trip);
    one over the limit is sent after the opening. Either way the upstream gets it whole."""
    monkeypatch.setattr(endpoints, "FIRST_BYTES_LIMIT", limit)
    for query in ("a=1", "b=2"):
        response = await harness.client.open("GET", f"/p/hello?{query}")
        body = await response.read()
        await response.aclose()
        assert response.status == 200
        assert json.loads(body)["target"] == f"/hello?{query}"
    assert len(harness.firsts) == 1  # the second request reused the connection
    if limit == 10:
        assert harness.firsts == [b""]
    else:
        assert harness.firsts[0].startswith(b"GET /hello?a=1 HTTP/1.1\r\n")
        assert harness.firsts[0].endswith(b"\r\n\r\n")


async def test_a_request_http11_cannot_carry_is_refused_before_any_connection_opens(
    harness: Harness,
) -> None:
    """HTTP/2 lets through a header name HTTP/1.1 forbids: the client hears which, and no
    stream to the task's port was opened for it."""
    headers, body = await harness.get(b"/p/x", [(b"bad{name", b"v")])
    error = json.loads(body)
    assert header_value(headers, b":status") == b"400"
    assert error["code"] == "INVALID_ARGUMENT"
    assert "cannot be sent as HTTP/1.1" in error["message"] and "bad{name" in error["message"]
    assert harness.opened == 0


async def test_a_kept_connection_the_upstream_closed_is_retried_once(harness: Harness) -> None:
    await _get_json(harness.client, "/p/bye")  # the upstream closes it after answering
    echo = await _get_json(harness.client, "/p/hello?after=bye")
    assert echo["target"] == "/hello?after=bye"
    assert harness.upstream.connections == 2
    assert [s.target for s in harness.upstream.seen] == ["/bye", "/hello?after=bye"]


async def test_a_connection_idle_too_long_is_not_reused(
    harness: Harness, mock_clock: trio.testing.MockClock
) -> None:
    await _get_json(harness.client, "/p/one")
    mock_clock.jump(harness.proxy.idle_timeout_s + 1)
    await _get_json(harness.client, "/p/two")
    assert harness.upstream.connections == 2


async def test_forget_where_closes_a_tasks_kept_connections(harness: Harness) -> None:
    await _get_json(harness.client, "/p/one")
    assert harness.proxy.idle_connections(harness.key) == 1
    assert await harness.proxy.forget_where(lambda key: key == harness.key) == 1
    assert harness.proxy.idle_connections(harness.key) == 0
    await _get_json(harness.client, "/p/two")
    assert harness.opened == 2


async def test_chunked_upstream_response_reaches_the_client_whole(harness: Harness) -> None:
    response = await harness.client.open("GET", "/p/chunked")
    body = await response.read()
    await response.aclose()
    assert response.status == 200
    assert body == b"one,two,three"
    assert response.headers["content-type"] == "text/plain"
    assert "content-length" not in response.headers
    assert "transfer-encoding" not in response.headers


async def test_head_has_headers_and_no_body(harness: Harness) -> None:
    response = await harness.client.open("HEAD", "/p/hello")
    body = await response.read()
    await response.aclose()
    assert response.status == 200
    assert body == b""
    assert int(response.headers["content-length"]) > 0
    assert harness.upstream.seen[-1].method == "HEAD"
    # The connection is still good for the next request.
    await _get_json(harness.client, "/p/hello")
    assert harness.upstream.connections == 1


async def test_upstream_closing_without_an_answer_is_unavailable(harness: Harness) -> None:
    with pytest.raises(ApiError) as err:
        await harness.client.call("GET", "/p/close")
    assert err.value.code is ErrorCode.UNAVAILABLE
    assert f"port {harness.upstream.port}" in err.value.message
    assert "did not answer with HTTP" in err.value.message


async def test_upstream_speaking_something_else_is_unavailable(harness: Harness) -> None:
    with pytest.raises(ApiError) as err:
        await harness.client.call("GET", "/p/garbage")
    assert err.value.code is ErrorCode.UNAVAILABLE
    assert "not an HTTP/1.1 response" in err.value.message


async def test_a_response_cut_short_fails_the_clients_stream(harness: Harness) -> None:
    response = await harness.client.open("GET", "/p/cut")
    assert response.status == 200  # the head went out before the body broke
    with pytest.raises(ApiError) as err:
        await response.read()
    await response.aclose()
    assert err.value.code is ErrorCode.UNAVAILABLE  # a reset stream, not a short body


async def test_an_early_answer_reaches_the_client_and_the_upload_stops(harness: Harness) -> None:
    response = await harness.client.open("POST", "/p/reject", b"z" * (4 * 1024 * 1024))
    body = await response.read()
    await response.aclose()
    assert response.status == 413
    assert body == b"too large"
    # That connection carried half a request, so the next one gets a fresh connection.
    await _get_json(harness.client, "/p/hello")
    assert harness.opened == 2


async def test_the_openers_error_reaches_the_client_as_it_is(harness: Harness) -> None:
    with pytest.raises(ApiError) as err:
        await harness.client.call("GET", "/gone")
    assert err.value.code is ErrorCode.UNAVAILABLE
    assert err.value.message == "worker w-9 is not connected"


async def test_an_unreachable_port_is_unavailable(nursery: trio.Nursery) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    for listener in listeners:
        await listener.aclose()  # nothing listens there any more
    proxy = EndpointProxy()

    async def opener(first: bytes) -> trio.abc.HalfCloseableStream:
        return await trio.open_tcp_stream("127.0.0.1", port)

    router = Router()

    async def handler(request: Request) -> StreamResponse | BytesResponse:
        return await proxy.forward(request, key=("w", "t", port), target="/", open_stream=opener)

    router.add("GET", "/x", handler)
    server_side, client_side = trio.testing.memory_stream_pair()
    service = Service(router, program="controlplane", authenticate=bearer_auth(TOKEN))
    nursery.start_soon(Http2Connection(server_side, client_side=False, handler=service).run)
    async with open_api_client(client_side, ApiClient, token=TOKEN, authority=AUTHORITY) as c:
        with pytest.raises(ApiError) as err:
            await c.call("GET", "/x")
    assert err.value.code is ErrorCode.UNAVAILABLE
    assert f"cannot reach the task's port {port}" in err.value.message


# -- the decisions, directly -------------------------------------------------------------------


def test_end_to_end_drops_hop_by_hop_and_connection_listed_headers() -> None:
    headers = [
        ("Connection", "keep-alive, X-Private"),
        ("Keep-Alive", "timeout=5"),
        ("X-Private", "1"),
        ("Transfer-Encoding", "chunked"),
        ("Upgrade", "websocket"),
        ("TE", "trailers"),
        ("Trailer", "x-sum"),
        ("Proxy-Connection", "keep-alive"),
        ("Proxy-Authenticate", "Basic"),
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
        ("Content-Length", "3"),
    ]
    assert end_to_end(headers) == [
        ("set-cookie", "a=1"),
        ("set-cookie", "b=2"),
        ("content-length", "3"),
    ]


def test_plan_request_without_a_body() -> None:
    plan = plan_request(
        "get",
        "/a?b=1",
        {"authorization": "Bearer t", "accept": "*/*", "host": "other", "te": "trailers"},
        authority="app.example:8443",
        body_ended=True,
    )
    assert plan.method == "GET"
    assert plan.framing is Framing.NONE
    assert plan.headers == (
        ("host", "app.example:8443"),
        ("accept", "*/*"),
        ("x-forwarded-host", "app.example:8443"),
        ("x-forwarded-proto", "https"),
        ("forwarded", 'host="app.example:8443";proto=https'),
    )


@pytest.mark.parametrize(
    ("method", "headers", "ended", "framing", "length"),
    [
        ("POST", {"content-length": "12"}, False, Framing.LENGTH, 12),
        ("POST", {}, False, Framing.CHUNKED, None),
        ("POST", {}, True, Framing.LENGTH, 0),
        ("PUT", {}, False, Framing.CHUNKED, None),
        ("GET", {}, False, Framing.NONE, None),
        ("DELETE", {}, True, Framing.NONE, None),
        ("GET", {"content-length": "5"}, False, Framing.LENGTH, 5),
    ],
)
def test_plan_request_frames_the_body(
    method: str, headers: dict[str, str], ended: bool, framing: Framing, length: int | None
) -> None:
    plan = plan_request(method, "/", headers, authority="a", body_ended=ended)
    assert plan.framing is framing
    assert plan.content_length == length
    sent = dict(plan.headers)
    assert sent.get("content-length") == (None if length is None else str(length))
    assert ("transfer-encoding" in sent) == (framing is Framing.CHUNKED)


def test_plan_request_refuses_what_cannot_be_forwarded() -> None:
    with pytest.raises(ApiError) as err:
        plan_request("POST", "/", {"content-length": "ten"}, authority="a", body_ended=False)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert err.value.field == "content-length"
    with pytest.raises(ApiError) as err:
        plan_request("GET", "/", {}, authority="", body_ended=True)
    assert err.value.field == ":authority"
    # Without :authority, a Host header will do.
    plan = plan_request("GET", "/", {"host": "h.example"}, authority="", body_ended=True)
    assert dict(plan.headers)["host"] == "h.example"


def test_plan_response() -> None:
    response = plan_response(
        200,
        [("Content-Type", "text/html"), ("Content-Length", "5"), ("Connection", "close")],
    )
    assert response.content_type == "text/html"
    assert response.headers == (("content-length", "5"),)
    assert plan_response(200, []).content_type == DEFAULT_CONTENT_TYPE
    for status in (204, 304):
        assert plan_response(status, [("content-length", "5"), ("etag", "x")]).headers == (
            ("etag", "x"),
        )


def test_may_retry_only_what_is_safe_to_send_again() -> None:
    def retry(
        method: str,
        *,
        reused: bool = True,
        answered: bool = False,
        body_bytes_sent: int = 0,
        replayable: bool = True,
    ) -> bool:
        return may_retry(
            method,
            reused=reused,
            answered=answered,
            body_bytes_sent=body_bytes_sent,
            replayable=replayable,
        )

    assert retry("GET")
    assert retry("POST")  # nothing of its body reached the upstream
    assert retry("PUT", body_bytes_sent=10)
    assert not retry("POST", body_bytes_sent=10)
    assert not retry("GET", reused=False)  # a fresh connection failing is not routine
    assert not retry("GET", answered=True)
    assert not retry("PUT", replayable=False)


def test_upstream_target_keeps_the_rest_of_the_path_and_the_query() -> None:
    assert upstream_target("/v1/tasks/t/ports/80/a/b?x=1&x=2", strip_segments=5) == "/a/b?x=1&x=2"
    assert upstream_target("/v1/tasks/t/ports/80", strip_segments=5) == "/"
    assert upstream_target("/v1/tasks/t/ports/80/", strip_segments=5) == "/"
    assert upstream_target("/v1/tasks/t/ports/80?q", strip_segments=5) == "/?q"


def test_forwarded_value_quotes_what_is_not_a_token() -> None:
    assert forwarded_value("example.com") == "host=example.com;proto=https"
    assert forwarded_value("[::1]:8443") == 'host="[::1]:8443";proto=https'


async def test_closing_upstreams_end_their_streams_without_resets(
    harness: Harness, nursery: trio.Nursery
) -> None:
    """Each answer of an upstream that closes its connection ends its CONNECT stream as the
    upstream ends it, never with RST_STREAM: a worker takes a stream of resets for a flood and
    ends the whole connection (here after 5 in its window; 2000 by default)."""
    strict = Http2Settings(max_resets_per_window=5)
    worker_side, controlplane_side = trio.testing.memory_stream_pair()
    worker = Http2Connection(
        worker_side,
        client_side=False,
        settings=strict,
        handler=Service(
            Router(),
            program="worker",
            authenticate=bearer_auth(TOKEN),
            connect_policy=ConnectPolicy(loopback=True),
        ),
    )
    nursery.start_soon(worker.run)
    async with open_api_client(
        controlplane_side, ApiClient, token=TOKEN, authority="w-strict"
    ) as to_worker:
        proxy = EndpointProxy()
        router = Router()

        async def to_port(request: Request) -> StreamResponse | BytesResponse:
            return await proxy.forward(
                request,
                key=("w-strict", "t-1", harness.upstream.port),
                target="/last",
                open_stream=lambda first: to_worker.connect(
                    f"127.0.0.1:{harness.upstream.port}", first=first
                ),
            )

        router.add("GET", "/bye", to_port)
        front_side, client_side = trio.testing.memory_stream_pair()
        front = Http2Connection(
            front_side,
            client_side=False,
            handler=Service(router, program="controlplane", authenticate=bearer_auth(TOKEN)),
        )
        nursery.start_soon(front.run)
        async with open_api_client(
            client_side, ApiClient, token=TOKEN, authority=AUTHORITY
        ) as client:
            for _ in range(20):
                await _get_json(client, "/bye")
        await proxy.aclose()
    assert worker.close_reason is None or "RST_STREAM" not in worker.close_reason
    assert harness.upstream.connections == 20
