"""What a client sends stays bounded where it is kept: as metric labels (a fixed set of methods,
route patterns, status codes) and in log lines (each value clipped). First the pure mapping,
then a controlplane on loopback taking anonymous requests with made-up methods and paths, and
60 kB paths and header values."""

from __future__ import annotations

import logging
import random
import string
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from control.api.server import Controlplane
from control.cli.client import ControlClient, open_control_client
from control.config import MetricsSettings
from control.metrics import ControlMetrics
from control.workers.forward import WORKER_HEADER
from sim.configs import Pki, control_config, make_pki
from sim.controlplane import run_controlplane
from wire.untrusted import CLIP_CHARS, METHODS, OTHER, clip, method_label, status_label

# -- pure --------------------------------------------------------------------------------------


def test_a_method_label_is_one_of_a_fixed_set() -> None:
    for method in METHODS:
        assert method_label(method) == method
    for method in ("get", "BREW", "PROPFIND", "X" * 30_000, "", "GET "):
        assert method_label(method) == OTHER


def test_a_status_label_is_a_number_up_to_599() -> None:
    assert [status_label(s) for s in (0, 200, 401, 499, 599)] == ["0", "200", "401", "499", "599"]
    assert status_label(600) == OTHER
    assert status_label(99_999) == OTHER
    assert status_label(-1) == OTHER


def test_clip_keeps_a_short_value_and_marks_what_it_cut() -> None:
    assert clip("/v1/tasks") == "/v1/tasks"
    assert clip("x" * CLIP_CHARS) == "x" * CLIP_CHARS
    long = "/" + "a" * 59_999
    clipped = clip(long)
    assert clipped == long[:CLIP_CHARS] + f"…({60_000 - CLIP_CHARS} more)"
    assert clip(12345, limit=2) == "12…(3 more)"


def series(metrics: ControlMetrics) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in metrics.registry.collect()
        for sample in family.samples
        if family.name.startswith("levers9_api_request")
    }


def test_request_labels_come_from_a_fixed_set() -> None:
    metrics = ControlMetrics("r1")
    for method in ("GET", "BREW", "X" * 30_000, "brew"):
        metrics.request(method, "unmatched", 401, 0.001)
    metrics.request("GET", "/v1/tasks", 99_999, 0.001)
    methods = {dict(labels)["method"] for _, labels in series(metrics)}
    codes = {dict(labels).get("code") for _, labels in series(metrics)} - {None}
    assert methods == {"GET", OTHER}
    assert codes == {"401", OTHER}


# -- served ------------------------------------------------------------------------------------


@attrs.frozen
class Served:
    control: Controlplane
    pki: Pki

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.control.port}"


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    pki = make_pki(tmp_path)
    config = attrs.evolve(control_config(pki), metrics=MetricsSettings(listen="127.0.0.1:0"))
    async with trio.open_nursery() as nursery:
        control: Controlplane = await nursery.start(run_controlplane, config)
        yield Served(control, pki)
        nursery.cancel_scope.cancel()


def random_request(rng: random.Random) -> tuple[str, str]:
    """A method (a real one half the time, else made up) and a path nobody routes."""
    if rng.random() < 0.5:
        # Not plain CONNECT (a tunnel, not a request).
        method = rng.choice([m for m in METHODS if m != "CONNECT"])
    else:
        method = "".join(rng.choices(string.ascii_uppercase, k=rng.randint(1, 40)))
    path = "/" + "/".join(
        "".join(rng.choices(string.ascii_lowercase + string.digits, k=rng.randint(1, 12)))
        for _ in range(rng.randint(1, 4))
    )
    return method, path


async def send_anonymous(client: ControlClient, requests: list[tuple[str, str]]) -> None:
    async def one(method: str, path: str) -> None:
        response = await client.open(method, path)
        await response.read()
        assert response.status in (400, 401, 404), (method, path, response.status)

    for start in range(0, len(requests), 50):
        async with trio.open_nursery() as nursery:
            for method, path in requests[start : start + 50]:
                nursery.start_soon(one, method, path)


async def scrape(served: Served) -> str:
    port = served.control.metrics_port
    assert port is not None
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := await stream.receive_some(1 << 20):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:100]
    return body.decode()


def request_series(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in text_string_to_metric_families(text)
        if family.name.startswith("levers9_api_request")
        for sample in family.samples
    }


async def test_metrics_stay_bounded_under_random_anonymous_requests(served: Served) -> None:
    rng = random.Random(20261207)
    async with open_control_client(served.url, "not-a-token", str(served.pki.ca_file)) as client:
        with trio.fail_after(60):
            await send_anonymous(client, [random_request(rng) for _ in range(100)])
            after_100 = await scrape(served)
            await send_anonymous(client, [random_request(rng) for _ in range(900)])
            after_1000 = await scrape(served)
    assert request_series(after_1000) == request_series(after_100)
    labels = {dict(labels)["method"] for _, labels in request_series(after_1000)}
    assert labels <= {*METHODS, OTHER}
    routes = {dict(labels)["route"] for _, labels in request_series(after_1000)}
    assert routes == {"unmatched"}
    # Counts grow a digit or so; the series do not.
    assert len(after_1000) - len(after_100) < 2_000


async def test_log_lines_of_refused_requests_stay_short(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    long_path = "/" + "p" * 60_000
    long_value = "w" * 60_000
    async with open_control_client(served.url, "not-a-token", str(served.pki.ca_file)) as client:
        response = await client.open("GET", long_path)
        await response.read()
        assert response.status == 401
        response = await client.open("X" * 30_000, "/v1/tasks")
        await response.read()
        # A forwarded request (for a worker another replica holds) with the wrong secret.
        stream = await client.conn.open_stream(
            [
                (b":method", b"GET"),
                (b":scheme", b"https"),
                (b":authority", b"127.0.0.1"),
                (b":path", b"/v1/health"),
                (WORKER_HEADER, long_value.encode()),
                (b"authorization", b"Bearer wrong"),
            ],
            end_stream=True,
        )
        await stream.wait_headers()
    records = [r for r in caplog.records if r.name.startswith("levers9")]
    said = [r.getMessage() for r in records]
    assert any(long_path[:CLIP_CHARS] in line and "more)" in line for line in said), said
    assert any("forwarded request" in line and "more)" in line for line in said), said
    for record in records:
        assert len(record.getMessage()) < 2_000, record.getMessage()[:300]
        for value in vars(record).values():
            assert len(str(value)) < 2_000 or value is record.args, str(value)[:300]


async def test_an_error_answer_to_head_has_no_body_and_the_connection_goes_on(
    served: Served,
) -> None:
    async with open_control_client(served.url, "not-a-token", str(served.pki.ca_file)) as client:
        for _ in range(3):
            response = await client.open("HEAD", "/no/such/route")
            assert response.status in (401, 404)
            assert await response.read() == b""
        response = await client.open("GET", "/no/such/route")
        assert response.status in (401, 404)
        assert b"message" in await response.read()
