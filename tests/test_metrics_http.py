"""The `/metrics` server both programs use: answers parsed with prometheus-client's own parser,
first without sockets (the pure answer, then one connection over memory streams), then over
loopback as Prometheus reaches it."""

from __future__ import annotations

import functools
from typing import Any

import h11
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import parser as openmetrics_parser
from prometheus_client.parser import text_string_to_metric_families

from wire.metrics import (
    MAX_CONNECTIONS_PER_SOURCE,
    MAX_HEAD_BYTES,
    answer,
    handle_scrape,
    render,
    serve_metrics,
)


def registry_with_values() -> CollectorRegistry:
    registry = CollectorRegistry()
    scrapes = Counter("demo_scrapes", "Scrapes seen.", registry=registry)
    scrapes.inc(3)
    depth = Gauge("demo_depth", "A labelled gauge.", ["queue"], registry=registry)
    depth.labels(queue='with "quotes" and \\ backslash').set(7)
    return registry


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def openmetrics(text: str) -> list[Metric]:
    """The families in an OpenMetrics exposition, by prometheus-client's OpenMetrics parser."""
    # That parser has no type annotations; what it yields is Metric families.
    return list(openmetrics_parser.text_string_to_metric_families(text))  # type: ignore[no-untyped-call]


# -- without sockets ---------------------------------------------------------------------------


def test_render_is_prometheus_text_unless_openmetrics_is_asked_for() -> None:
    registry = registry_with_values()
    body, content_type = render(registry, "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
    assert content_type.startswith("text/plain; version=")
    found = samples(body.decode())
    assert found[("demo_scrapes_total", ())] == 3
    # Escaping is the library's: the label value comes back as it was set.
    assert found[("demo_depth", (("queue", 'with "quotes" and \\ backslash'),))] == 7

    body, content_type = render(registry, "application/openmetrics-text;version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    [scrapes] = [f for f in openmetrics(body.decode()) if f.name == "demo_scrapes"]
    assert scrapes.type == "counter" and scrapes.samples[0].value == 3


def test_answers_by_path_and_method() -> None:
    registry = registry_with_values()
    ok = answer("GET", "/metrics?debug=1", "", registry)
    assert ok.status == 200
    assert dict(ok.headers)["content-type"].startswith("text/plain; version=")
    assert samples(ok.body.decode())[("demo_scrapes_total", ())] == 3
    missing = answer("GET", "/", "", registry)
    assert missing.status == 404 and b"/metrics" in missing.body
    refused = answer("POST", "/metrics", "", registry)
    assert refused.status == 405
    assert dict(refused.headers)["allow"] == "GET, HEAD"


def test_a_collector_that_fails_costs_a_500_not_the_server() -> None:
    class Broken:
        def collect(self) -> list[object]:
            raise RuntimeError("collector bug")

    registry = CollectorRegistry()
    registry.register(Broken())  # type: ignore[arg-type]
    assert answer("GET", "/metrics", "", registry).status == 500


async def exchange(raw: bytes, registry: CollectorRegistry, **options: Any) -> bytes:
    """Sends `raw` to one connection's handler over memory streams; returns all the server sent
    before it closed the connection (it returns only once the server has closed it)."""
    client, server = trio.testing.memory_stream_pair()
    received = b""
    with trio.fail_after(30):  # a safety net: a server that never closes fails, not hangs
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(handle_scrape, server, registry, **options))
            await client.send_all(raw)
            while data := await client.receive_some(65536):
                received += data
    await client.aclose()
    return received


def parse(raw: bytes, method: str = "GET") -> tuple[h11.Response, bytes]:
    """The response in `raw`, read as a client that sent `method` reads it, and its body."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method=method, target="/metrics", headers=[("host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(raw)
    conn.receive_data(b"")
    response: h11.Response | None = None
    body = b""
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            break
        else:
            raise AssertionError(f"unexpected {event!r} in {raw!r}")
    assert response is not None
    return response, body


async def test_one_scrape_over_a_stream_then_the_connection_closes() -> None:
    raw = await exchange(
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: text/plain\r\n\r\n", registry_with_values()
    )
    response, body = parse(raw)
    assert response.status_code == 200
    headers = dict(response.headers)
    assert headers[b"connection"] == b"close"
    assert int(headers[b"content-length"]) == len(body)
    assert samples(body.decode())[("demo_scrapes_total", ())] == 3


async def test_head_has_the_length_but_no_body() -> None:
    raw = await exchange(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n", registry_with_values())
    response, body = parse(raw, "HEAD")
    assert response.status_code == 200
    assert int(dict(response.headers)[b"content-length"]) > 0
    assert raw.endswith(b"\r\n\r\n") and body == b""  # nothing after the head


async def test_openmetrics_when_the_scrape_asks_for_it() -> None:
    raw = await exchange(
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
        b"Accept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n\r\n",
        registry_with_values(),
    )
    response, body = parse(raw)
    assert response.status_code == 200
    assert dict(response.headers)[b"content-type"].startswith(b"application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    [scrapes] = [f for f in openmetrics(body.decode()) if f.name == "demo_scrapes"]
    assert scrapes.samples[0].value == 3


HUGE = b"a" * 2 * MAX_HEAD_BYTES


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n", 404),
        (b"DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 405),
        (b"this is not http\r\n\r\n", 400),
        (
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: "
            + b"a" * 2 * MAX_HEAD_BYTES
            + b"\r\n\r\n",
            431,
        ),
    ],
)
async def test_what_is_not_a_scrape_gets_an_error(raw: bytes, status: int) -> None:
    response, _ = parse(await exchange(raw, registry_with_values()))
    assert response.status_code == status


async def test_a_silent_client_is_closed_after_the_read_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            functools.partial(handle_scrape, server, registry_with_values(), read_timeout_s=5)
        )
        await client.send_all(b"GET /metr")  # and then nothing more
        assert await client.receive_some(100) == b""  # closed without an answer


async def test_refresh_runs_before_each_scrape_and_only_for_scrapes() -> None:
    registry = CollectorRegistry()
    gauge = Gauge("demo_refreshed", "Set by the refresh.", registry=registry)
    calls = 0

    async def refresh() -> None:
        nonlocal calls
        calls += 1
        gauge.set(calls * 10)

    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    _, body = parse(await exchange(request, registry, refresh=refresh))
    assert samples(body.decode())[("demo_refreshed", ())] == 10
    _, body = parse(await exchange(request, registry, refresh=refresh))
    assert samples(body.decode())[("demo_refreshed", ())] == 20
    await exchange(b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n", registry, refresh=refresh)
    assert calls == 2


# -- over loopback ------------------------------------------------------------------------------


async def http_get(port: int, target: str = "/metrics") -> tuple[int, bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        conn = h11.Connection(h11.CLIENT)
        status, body = 0, b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return status, body
            else:
                raise AssertionError(f"unexpected {event!r}")


async def test_scrapes_over_loopback(nursery: trio.Nursery) -> None:
    registry = registry_with_values()
    port = await nursery.start(serve_metrics, "127.0.0.1", 0, registry)
    assert port > 0
    status, body = await http_get(port)
    assert status == 200
    assert samples(body.decode())[("demo_scrapes_total", ())] == 3
    assert (await http_get(port, "/nope"))[0] == 404
    # A client that goes away mid-request does not stop the server.
    broken = await trio.open_tcp_stream("127.0.0.1", port)
    await broken.send_all(b"GET /met")
    await broken.aclose()
    assert (await http_get(port))[0] == 200


async def test_connections_over_the_limit_are_closed_on_arrival(nursery: trio.Nursery) -> None:
    registry = registry_with_values()
    entered, release = trio.Event(), trio.Event()

    async def refresh() -> None:
        entered.set()
        await release.wait()

    port = await nursery.start(
        functools.partial(
            serve_metrics, "127.0.0.1", 0, registry, refresh=refresh, max_connections=1
        )
    )
    first: list[tuple[int, bytes]] = []

    async def scrape() -> None:
        first.append(await http_get(port))

    with trio.fail_after(30):  # a safety net: answering the extra one would wait forever
        async with trio.open_nursery() as clients:
            clients.start_soon(scrape)
            await entered.wait()  # the first connection is being answered: one is open
            extra = await trio.open_tcp_stream("127.0.0.1", port)
            async with extra:
                # Closed on arrival (nothing is sent, so the close is a FIN and never a reset).
                assert await extra.receive_some(100) == b""
            release.set()
    assert first[0][0] == 200


async def test_a_client_silent_for_the_idle_timeout_is_closed_before_the_read_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            functools.partial(
                handle_scrape,
                server,
                registry_with_values(),
                read_timeout_s=100,
                idle_timeout_s=2,
            )
        )
        started = trio.current_time()
        await client.send_all(b"GET /metr")  # and then nothing more
        assert await client.receive_some(100) == b""
        assert trio.current_time() - started < 10


async def open_from(source: str, port: int) -> trio.SocketStream:
    """A connection to the loopback listener from `source` (another loopback address)."""
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    try:
        await sock.bind((source, 0))
        await sock.connect(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def test_idle_connections_from_one_source_do_not_starve_a_scrape(
    nursery: trio.Nursery,
) -> None:
    port = await nursery.start(serve_metrics, "127.0.0.1", 0, registry_with_values())
    idle = [await open_from("127.0.0.2", port) for _ in range(70)]
    try:
        # Ask from another address, well within the idle connections' timeouts.
        with trio.fail_after(3):
            status, body = await http_get(port)
        assert status == 200
        assert samples(body.decode())[("demo_scrapes_total", ())] == 3
        # Those over the per-source limit were closed on arrival (a FIN, nothing sent).
        closed = 0
        for stream in idle:
            with trio.move_on_after(0.05):  # closed long ago, or still open
                if await stream.receive_some(100) == b"":
                    closed += 1
        assert closed >= 70 - MAX_CONNECTIONS_PER_SOURCE
    finally:
        for stream in idle:
            await stream.aclose()
