"""Anonymous requests with made-up methods and paths, and what they do to `/metrics`.

Anyone who reaches the controlplane's port can send a request, and every request is counted
in `levers9_api_requests_total` and its latency histogram. If a label took the request's own
method or path, each new one would be a series for ever: the exposition (and every scrape)
would grow with what strangers send. So labels come from fixed sets (`wire.untrusted`).

This sends N requests (100,000 by default) without credentials, half with a real method and
half with a made-up one, each to a random path nobody routes, over a few HTTP/2 connections to
a controlplane on loopback (TLS, in this process), and scrapes its plain `/metrics` listener
fresh, after the first `WARM_UP` requests ("before") and after all N ("after"). Bounded means
the series after are the series before, but for a route pattern a random path happened to match
(a GET under `/ui/` reaches the dashboard's public catch-all, `/ui/{rest...}`), and the size
grows by digits only.

The anchor is what the same requests would have made of the request counter alone had its
`method` label been the method as sent (as it was before labels were bounded), measured on a
registry of its own in the same run: ``ratios.metrics_bytes_vs_raw_method_labels`` far below 1
is the point.

``python -m bench.cardinality [--quick] [--requests N] [--json FILE]``
"""

from __future__ import annotations

import argparse
import random
import string
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.report import Results, publish, ratios_of
from control.api.server import Controlplane
from control.cli.client import ControlClient, open_control_client
from control.config import MetricsSettings
from sim.configs import control_config, make_pki
from sim.controlplane import run_controlplane
from wire.untrusted import METHODS

CONNECTIONS = 4
IN_FLIGHT = 64
"""Requests open at once on each connection."""
SEED = 20261207
WARM_UP = 1_000
"""Requests sent before the "before" scrape: by then every label value there is has been seen."""


def random_requests(count: int, seed: int = SEED) -> list[tuple[str, str]]:
    """(method, path) pairs: half a real method (not CONNECT, a tunnel, nor HEAD, whose error
    answers the client refuses), half 1 to 40 random capitals; paths of 1 to 4 segments."""
    rng = random.Random(seed)
    real = [m for m in METHODS if m not in ("CONNECT", "HEAD")]
    letters = string.ascii_lowercase + string.digits
    out = []
    for _ in range(count):
        if rng.random() < 0.5:
            method = rng.choice(real)
        else:
            method = "".join(rng.choices(string.ascii_uppercase, k=rng.randint(1, 40)))
        path = "/" + "/".join(
            "".join(rng.choices(letters, k=rng.randint(1, 12))) for _ in range(rng.randint(1, 4))
        )
        out.append((method, path))
    return out


@attrs.frozen
class Scraped:
    size_bytes: int
    series: int
    seconds: float


async def scrape(port: int) -> Scraped:
    """One plain scrape: its body's size, its request series, how long it took."""
    started = time.perf_counter()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n")
        chunks = []
        while chunk := await stream.receive_some(1 << 20):
            chunks.append(chunk)
    seconds = time.perf_counter() - started
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the scrape was answered {head[:40]!r}")
    series = sum(
        len(family.samples)
        for family in text_string_to_metric_families(body.decode())
        if family.name.startswith("levers9_api_request")
    )
    return Scraped(len(body), series, seconds)


async def send_all(url: str, ca_file: str, requests: Sequence[tuple[str, str]]) -> None:
    """`requests` shared among `CONNECTIONS` clients without credentials."""
    async with trio.open_nursery() as nursery:
        for i in range(CONNECTIONS):
            nursery.start_soon(_send_on_one, url, ca_file, requests[i::CONNECTIONS])


async def _send_on_one(url: str, ca_file: str, requests: Sequence[tuple[str, str]]) -> None:
    async with open_control_client(url, "not-a-token", ca_file) as client:
        await send(client, requests)


async def send(client: ControlClient, requests: Sequence[tuple[str, str]]) -> None:
    """Each request in turn, `IN_FLIGHT` at a time; its answer is read and dropped."""
    pending = iter(requests)

    async def worker() -> None:
        for method, path in pending:
            response = await client.open(method, path)
            await response.read()

    async with trio.open_nursery() as nursery:
        for _ in range(IN_FLIGHT):
            nursery.start_soon(worker)


def raw_method_counter_bytes(requests: Sequence[tuple[str, str]]) -> int:
    """The anchor: the request counter alone, labelled by the method as it was sent."""
    registry = CollectorRegistry()
    counter = Counter(
        "levers9_api_requests",
        "API requests by route pattern, method and status code.",
        ["route", "method", "code"],
        registry=registry,
    )
    for method, _ in requests:
        counter.labels("unmatched", method, "401").inc()
    return len(generate_latest(registry))


async def run_benchmark(directory: Path, count: int) -> Results:
    pki = make_pki(directory)
    config = attrs.evolve(control_config(pki), metrics=MetricsSettings(listen="127.0.0.1:0"))
    requests = random_requests(count)
    async with trio.open_nursery() as nursery:
        control: Controlplane = await nursery.start(run_controlplane, config)
        assert control.metrics_port is not None
        url = f"https://127.0.0.1:{control.port}"
        fresh = await scrape(control.metrics_port)
        warm, rest = requests[:WARM_UP], requests[WARM_UP:]
        await send_all(url, str(pki.ca_file), warm)
        before = await scrape(control.metrics_port)
        started = time.perf_counter()
        await send_all(url, str(pki.ca_file), rest)
        sent_s = time.perf_counter() - started
        after = await scrape(control.metrics_port)
        print(
            f"/metrics: {fresh.size_bytes} B fresh; {before.size_bytes} B ({before.series} "
            f"request series) after {len(warm)} requests; {after.size_bytes} B ({after.series}) "
            f"after {count} ({len(rest)} more in {sent_s:.1f} s), scraped in "
            f"{after.seconds * 1000:.1f} ms",
            flush=True,
        )
        nursery.cancel_scope.cancel()
    figures = {
        "metrics_bytes_fresh": float(fresh.size_bytes),
        "metrics_bytes_before": float(before.size_bytes),
        "metrics_bytes_after": float(after.size_bytes),
        "request_series_before": float(before.series),
        "request_series_after": float(after.series),
        "scrape_after_s": after.seconds,
        "requests_per_s": len(rest) / sent_s,
    }
    anchors = {"raw_method_counter_bytes": float(raw_method_counter_bytes(requests))}
    ratios = ratios_of(
        {"metrics_bytes_vs_raw_method_labels": ("metrics_bytes_after", "raw_method_counter_bytes")},
        figures,
        anchors,
    )
    ratios["metrics_bytes_after_vs_before"] = after.size_bytes / before.size_bytes
    return Results(figures=figures, anchors=anchors, ratios=ratios)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cardinality",
        description="Anonymous requests with random methods and paths against /metrics' size.",
    )
    parser.add_argument("--quick", action="store_true", help="3,000 requests, for tests")
    parser.add_argument("--requests", type=int, default=100_000, metavar="N")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here")
    args = parser.parse_args(argv)
    count = 3_000 if args.quick else args.requests
    with tempfile.TemporaryDirectory(prefix="levers9-bench-cardinality-") as tmp:
        results = trio.run(run_benchmark, Path(tmp), count)
    publish(
        results,
        {"requests": float(count), "connections": float(CONNECTIONS)},
        args.json,
        target=(
            f"target: request series after {count} requests = after the first {WARM_UP} "
            "(a fixed set), but for a route pattern a random path matched; bytes grow by "
            "digits only"
        ),
    )


if __name__ == "__main__":
    main()
