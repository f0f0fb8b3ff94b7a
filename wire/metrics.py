"""Prometheus scrapes: a small HTTP/1.1 server answering `GET /metrics` from a registry.

Why a listener of its own, used by the agent and the controlplane alike: Prometheus scrapes
plain HTTP/1.1 and holds none of our tokens, while the worker API is HTTP/2 behind TLS and a
bearer token (and in tunnel mode has no listener at all) and the controlplane's API wants an
operator token. So `/metrics` gets a listener of its own, off unless configured, on loopback
unless configured otherwise. It is plain HTTP on purpose: it is meant for a scrape from the
same host or from inside the cluster's network, and the numbers it serves name no secret; do
not put it on an address the internet reaches.

The exposition is `prometheus_client`'s own (`render`), never written here, in whichever of
its formats the scrape's `Accept` asks for; `render` is separate so an HTTPS route can answer
with the same bytes. Requests are parsed by h11 (python-hyper's sans-IO HTTP/1.1). Each
connection gets one answer and is closed (`Connection: close`): a scrape every few seconds
gains nothing from keep-alive, and a closed connection holds nothing. A connection has
`read_timeout_s` to send its request head (h11 refuses one still unfinished after
`MAX_HEAD_BYTES`, with 431) and as long again to take the answer, and one that sends nothing
for `idle_timeout_s` is closed sooner, so a slow or silent client cannot hold the server. Beyond
`max_connections` open at once (`MAX_CONNECTIONS`), or `max_per_source` from one address
(`MAX_CONNECTIONS_PER_SOURCE`), new ones are closed on arrival (`wire.admission`
decides): idle connections from one address cannot take every place and starve the scrape that
comes from another, and each holds its place only seconds.

`refresh` (optional) runs before each `/metrics` answer: where reading the numbers blocks
(NVML), a collector cannot do it inside `generate_latest`, which runs on the event loop, so
the caller refreshes what the collector reports here instead. It must bound its own time.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import attrs
import h11
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from wire.admission import (
    Admissions,
    ConnectionLimits,
    ConnectionLog,
    Refusal,
    source_address,
)

log = logging.getLogger("levers9.metrics")

METRICS_PATH = "/metrics"
MAX_HEAD_BYTES = 8 * 1024
"""A request's line and headers; a scrape's are a few hundred bytes."""
READ_TIMEOUT_S = 10.0
"""For the request head, and again for the answer to be taken."""
MAX_CONNECTIONS = 64
"""Connections open at once; more are closed on arrival."""
MAX_CONNECTIONS_PER_SOURCE = 8
"""Connections open at once from one address: Prometheus scrapes over one at a time."""
IDLE_TIMEOUT_S = 5.0
"""How long a connection may send nothing before its request head is in."""
_RECEIVE_BYTES = 4096
_ALLOWED = "GET, HEAD"

Refresh = Callable[[], Awaitable[None]]


@attrs.frozen
class Answer:
    """An HTTP answer to send: status, headers (content-length is added when sending), body."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


def render(registry: CollectorRegistry, accept: str) -> tuple[bytes, str]:
    """The registry's metrics in the format `accept` (an HTTP Accept value) asks for, with the
    content type to send them with: OpenMetrics when asked, else Prometheus' text format."""
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


def wants_metrics(method: str, target: str) -> bool:
    """Whether a request is a scrape (so `refresh` is worth running before the answer)."""
    return method in ("GET", "HEAD") and _path(target) == METRICS_PATH


def answer(method: str, target: str, accept: str, registry: CollectorRegistry) -> Answer:
    """The answer to one request. Pure but for the registry's collectors."""
    path = _path(target)
    if path != METRICS_PATH:
        return _text(404, f"nothing at {path}; scrape {METRICS_PATH}\n")
    if method not in ("GET", "HEAD"):
        return _text(405, f"{METRICS_PATH} answers GET and HEAD, not {method}\n", allow=True)
    try:
        body, content_type = render(registry, accept)
    except Exception:  # a collector's bug must cost a scrape, never the listener
        log.exception("rendering the metrics failed")
        return _text(500, "the metrics could not be rendered; the server's log says why\n")
    return Answer(200, (("content-type", content_type),), body)


async def handle_scrape(
    stream: trio.abc.Stream,
    registry: CollectorRegistry,
    *,
    refresh: Refresh | None = None,
    read_timeout_s: float = READ_TIMEOUT_S,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
) -> None:
    """Answers the one request `stream` carries and closes it (however the client behaves)."""
    async with stream:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        try:
            request: h11.Request | None = None
            with trio.move_on_after(read_timeout_s):
                try:
                    request = await _read_request(stream, conn, idle_timeout_s)
                except h11.RemoteProtocolError as exc:
                    await _send(stream, conn, _text(exc.error_status_hint, f"{exc}\n"), head=False)
                    return
            if request is None:  # gone, or too slow to ask
                return
            method = request.method.decode("ascii", "replace")
            target = request.target.decode("ascii", "replace")
            accept = ", ".join(
                value.decode("latin-1") for name, value in request.headers if name == b"accept"
            )
            if refresh is not None and wants_metrics(method, target):
                await refresh()
            reply = answer(method, target, accept, registry)
            with trio.move_on_after(read_timeout_s):
                await _send(stream, conn, reply, head=method == "HEAD")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the client went away; nothing to tell it


async def serve_metrics(
    host: str,
    port: int,
    registry: CollectorRegistry,
    *,
    refresh: Refresh | None = None,
    read_timeout_s: float = READ_TIMEOUT_S,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
    max_per_source: int = MAX_CONNECTIONS_PER_SOURCE,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `registry` at `http://host:port/metrics` until cancelled; `started()` gives the
    port listened on (the one chosen when `port` is 0; the first listener's when `host` names
    several addresses). Plain HTTP: see the module docstring for where it belongs."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    actual = int(listeners[0].socket.getsockname()[1])
    admissions = Admissions(
        ConnectionLimits(
            max_per_source=min(max_per_source, max_connections), max_total=max_connections
        )
    )
    refusals = ConnectionLog(fields={"listener": "metrics"})

    async def handle(stream: trio.SocketStream) -> None:
        try:
            source = source_address(stream.socket.getpeername())
        except OSError:
            source = "unknown"
        admission = admissions.admit(source)
        if isinstance(admission, Refusal):
            refusals.refused(admission, trio.current_time())
            await stream.aclose()
            return
        try:
            await handle_scrape(
                stream,
                registry,
                refresh=refresh,
                read_timeout_s=read_timeout_s,
                idle_timeout_s=idle_timeout_s,
            )
        finally:
            admissions.release(admission)

    async with trio.open_nursery() as nursery:
        # serve_listeners runs each connection in a task of its own in this nursery.
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(actual)


async def _read_request(
    stream: trio.abc.Stream, conn: h11.Connection, idle_timeout_s: float
) -> h11.Request | None:
    """The request head, or None when the client closed before sending one, or sent nothing
    for `idle_timeout_s`."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = b""
            with trio.move_on_after(idle_timeout_s) as idle:
                data = bytes(await stream.receive_some(_RECEIVE_BYTES))
            if idle.cancelled_caught:
                return None
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Request):
            return event
        return None


async def _send(
    stream: trio.abc.Stream, conn: h11.Connection, reply: Answer, *, head: bool
) -> None:
    """Sends `reply` and ends the connection's use; without its body for a HEAD request."""
    if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
        return
    headers = [
        *reply.headers,
        ("content-length", str(len(reply.body))),
        ("connection", "close"),
    ]
    try:
        data = conn.send(h11.Response(status_code=reply.status, headers=headers)) or b""
        if not head and reply.body:
            data += conn.send(h11.Data(data=reply.body)) or b""
        data += conn.send(h11.EndOfMessage()) or b""
    except h11.LocalProtocolError:  # after a request h11 could not parse, it may refuse
        return
    await stream.send_all(data)


def _text(status: int, message: str, *, allow: bool = False) -> Answer:
    headers = [("content-type", "text/plain; charset=utf-8")]
    if allow:
        headers.append(("allow", _ALLOWED))
    return Answer(status, tuple(headers), message.encode())


def _path(target: str) -> str:
    return target.split("?", 1)[0]
