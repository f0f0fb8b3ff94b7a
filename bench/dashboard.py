"""The dashboard at size: Apps with 10,000 tasks in the workspace, and `/metrics` with 1,000
workers registered.

One controlplane on loopback (SQLite records, TLS, HTTP/2), its workspace seeded through the
task store with tasks that ran and ended. Measured in one run:

- `figures.apps_first_paint_ms`: Debian's Chromium (Playwright) signs in and opens Apps;
  the browser's own first-contentful-paint of the page, and `figures.apps_rows_ms`, from the
  navigation's start until the first page's 50 rows are on screen;
- `figures.page_ms` / `figures.page_deep_ms`: one page of 50 through the API (the newest, and
  one 9,000 tasks deep with `before`), median over a keep-alive HTTP/2 connection, as the
  dashboard asks for it;
- the anchors, the same pages through the CLI, measured two ways so that each ratio compares
  like with like: `anchors.cli_request_ms` / `cli_request_deep_ms`, the CLI's own client
  (`open_control_client`, `tasks`) asking over its one kept connection, warm, against which
  `ratios.page_vs_cli_request` sets the dashboard's warm request; and `anchors.cli_process_ms` /
  `cli_process_deep_ms`, a whole `levers9 task list --json --limit 50` process as a user runs
  it (start, TLS, request, output), against which `ratios.apps_rows_vs_cli_process` sets a
  user's whole wait in the browser (navigation to rows on screen). A warm request is never set
  against a whole process;
- `figures.metrics_scrape_ms`: `GET /metrics` (operator token) with 1,000 workers registered
  and the 10,000 tasks counted, median and p99 of 30 scrapes (target <= 100 ms).
"""

from __future__ import annotations

import secrets
import ssl
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import httpx
import trio

from bench.report import Results, ratios_of, run_planned
from control.api.server import Controlplane
from control.cli.client import open_control_client
from control.config import ControlConfig, parse
from control.tasks.store import Exited, Running, Start, TaskSpec, open_task_store
from sim.browser import CHROMIUM, spki_pin
from sim.cluster import cli_environment, free_port, run_cli
from sim.configs import Pki, make_pki
from sim.controlplane import run_controlplane
from workerapi.models import CardInfo, CardState, Registration

PAGE = 50
TARGET = (
    "target: metrics_scrape_ms <= 100 with 1,000 workers; Apps renders a page of 50 of "
    "10,000 tasks (paged, never all rows)"
)


COMPARED = (
    "compared like with like: page_*_vs_cli_request set a warm HTTP/2 request against the "
    "CLI's client's warm request; apps_rows_vs_cli_process sets the browser's navigation to "
    "rows on screen against a whole `levers9 task list` process"
)


@attrs.frozen
class Plan:
    tasks: int
    workers: int
    page_calls: int
    cli_calls: int
    scrapes: int


FULL = Plan(tasks=10_000, workers=1_000, page_calls=50, cli_calls=5, scrapes=30)
QUICK = Plan(tasks=1_000, workers=100, page_calls=10, cli_calls=2, scrapes=5)


def config_for(
    root: Path, pki: Pki, plan: Plan, workspace_token: str, operator: str
) -> ControlConfig:
    port = free_port()
    return parse(
        {
            "config": {
                "publicUrl": f"https://127.0.0.1:{port}",
                "listen": f"127.0.0.1:{port}",
                "tls": {"certFile": str(pki.cert_file), "keyFile": str(pki.key_file)},
                "apiTokens": [{"name": "ops", "token": operator}],
                "database": {"path": str(root / "tasks.db")},
                "workspaces": [
                    {"name": "bench", "tokens": [{"name": "u", "token": workspace_token}]}
                ],
                "worker": {
                    "tokens": [
                        {"workerId": f"w-{i:04d}", "token": secrets.token_urlsafe(16)}
                        for i in range(plan.workers)
                    ]
                },
            }
        }
    )


async def seed(config: ControlConfig, plan: Plan) -> list[str]:
    """The workspace's tasks, each placed, run and ended (as a workspace's history is); their
    ids, oldest first."""
    ids = []
    async with open_task_store(config.database) as store:
        for i in range(plan.tasks):
            record = await store.create(
                "bench", TaskSpec(image="registry.example/team/trainer:v3", cards=1 + i % 4)
            )
            worker = f"w-{i % plan.workers:04d}"
            await store.apply("bench", record.id, Start(worker=worker, node=f"node-{i % 97}"))
            await store.apply("bench", record.id, Running(cards=(f"GPU-{i:08d}",)))
            await store.apply("bench", record.id, Exited(code=0 if i % 9 else 1))
            ids.append(record.id)
    return ids


async def register_workers(control: Controlplane, plan: Plan) -> None:
    """Registered as tunnel workers whose tunnels are not up: the registry, the directory and
    what a scrape reads hold all of them, and no one dials addresses that do not exist."""
    for i in range(plan.workers):
        await control.registry.register(
            Registration(
                worker_id=f"w-{i:04d}",
                version="bench",
                mode="tunnel",
                node=f"node-{i}",
                cards=(
                    CardInfo(
                        uuid=f"GPU-{i:08d}",
                        index=0,
                        model="NVIDIA H100 80GB HBM3",
                        memory_total_bytes=80 << 30,
                        state=CardState.SERVING,
                        reason="",
                    ),
                ),
            )
        )


def median_ms(samples: Sequence[float]) -> float:
    return statistics.median(samples) * 1000


def p99_ms(samples: Sequence[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000


async def time_calls(client: httpx.AsyncClient, path: str, count: int) -> list[float]:
    out = []
    for _ in range(count):
        started = time.perf_counter()
        response = await client.get(path)
        response.raise_for_status()
        out.append(time.perf_counter() - started)
    return out


async def time_cli_requests(
    base: str, token: str, pki: Pki, before: str | None, count: int
) -> list[float]:
    """The CLI's own request for a page, warm: one connection, one untimed request first."""
    async with open_control_client(base, token, str(pki.ca_file)) as client:
        await client.tasks(limit=PAGE, before=before)
        out = []
        for _ in range(count):
            started = time.perf_counter()
            await client.tasks(limit=PAGE, before=before)
            out.append(time.perf_counter() - started)
    return out


async def time_cli(env: dict[str, str], args: Sequence[str], count: int) -> list[float]:
    """Whole `levers9` processes, from start to exit."""
    out = []
    for _ in range(count):
        started = time.perf_counter()
        await run_cli(env, args, check=True)
        out.append(time.perf_counter() - started)
    return out


def browse(url: str, token: str, cert_file: Path) -> tuple[float, float]:
    """(first contentful paint, rows on screen), in ms from the Apps navigation's start; the
    median of three loads after one to warm the browser's cache and connection."""
    from playwright.sync_api import sync_playwright

    paints, rows = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", f"--ignore-certificate-errors-spki-list={spki_pin(cert_file)}"],
        )
        try:
            page = browser.new_context().new_page()
            page.goto(f"{url}/ui/signin")
            page.fill("#token", token)
            with page.expect_navigation():
                page.click("button[type=submit]")
            for attempt in range(4):
                page.goto(f"{url}/ui/?load={attempt}#/apps")
                page.locator("tr[data-task]").nth(PAGE - 1).wait_for()
                shown = page.evaluate("performance.now()")
                paint = page.evaluate(
                    "performance.getEntriesByName('first-contentful-paint')[0]?.startTime ?? -1"
                )
                if attempt:
                    paints.append(float(paint))
                    rows.append(float(shown))
        finally:
            browser.close()
    return statistics.median(paints), statistics.median(rows)


async def run_benchmark(root: Path, plan: Plan) -> tuple[Results, dict[str, float]]:
    pki = make_pki(root)
    token, operator = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    config = config_for(root, pki, plan, token, operator)
    started = time.perf_counter()
    ids = await seed(config, plan)
    print(f"seeded {plan.tasks} tasks in {time.perf_counter() - started:.1f} s", flush=True)
    deep = ids[plan.tasks - int(plan.tasks * 0.9)]  # about 90% of the way down the list
    async with trio.open_nursery() as nursery:
        control: Controlplane = await nursery.start(run_controlplane, config)
        await register_workers(control, plan)
        context = ssl.create_default_context(cafile=str(pki.ca_file))
        base = config.public_url
        async with httpx.AsyncClient(
            http2=True, verify=context, base_url=base, headers={"authorization": f"Bearer {token}"}
        ) as client:
            await time_calls(client, f"/v1/tasks?limit={PAGE}", 3)  # warm
            page = await time_calls(client, f"/v1/tasks?limit={PAGE}", plan.page_calls)
            page_deep = await time_calls(
                client, f"/v1/tasks?limit={PAGE}&before={deep}", plan.page_calls
            )
        async with httpx.AsyncClient(
            http2=True,
            verify=context,
            base_url=base,
            headers={"authorization": f"Bearer {operator}"},
        ) as ops:
            await time_calls(ops, "/metrics", 2)
            scrapes = await time_calls(ops, "/metrics", plan.scrapes)
            scraped = (await ops.get("/metrics")).text
        cli_request = await time_cli_requests(base, token, pki, None, plan.page_calls)
        cli_request_deep = await time_cli_requests(base, token, pki, deep, plan.page_calls)
        env = cli_environment(base, token, pki)
        cli = await time_cli(env, ("task", "list", "--json", "--limit", str(PAGE)), plan.cli_calls)
        cli_deep = await time_cli(
            env,
            ("task", "list", "--json", "--limit", str(PAGE), "--before", deep),
            plan.cli_calls,
        )
        paint, rows = await trio.to_thread.run_sync(browse, base, token, pki.cert_file)
        nursery.cancel_scope.cancel()
    figures = {
        "apps_first_paint_ms": paint,
        "apps_rows_ms": rows,
        "page_ms": median_ms(page),
        "page_deep_ms": median_ms(page_deep),
        "metrics_scrape_ms": median_ms(scrapes),
        "metrics_scrape_p99_ms": p99_ms(scrapes),
        "metrics_bytes": float(len(scraped)),
    }
    anchors = {
        "cli_request_ms": median_ms(cli_request),
        "cli_request_deep_ms": median_ms(cli_request_deep),
        "cli_process_ms": median_ms(cli),
        "cli_process_deep_ms": median_ms(cli_deep),
    }
    ratios = ratios_of(
        {
            # Warm request against warm request.
            "page_vs_cli_request": ("page_ms", "cli_request_ms"),
            "page_deep_vs_cli_request": ("page_deep_ms", "cli_request_deep_ms"),
            # A user's whole wait against a user's whole wait.
            "apps_rows_vs_cli_process": ("apps_rows_ms", "cli_process_ms"),
        },
        figures,
        anchors,
    )
    inputs = {"tasks": float(plan.tasks), "workers": float(plan.workers), "page": float(PAGE)}
    return Results(figures=figures, anchors=anchors, ratios=ratios), inputs


def main(argv: Sequence[str] | None = None) -> None:
    run_planned(
        argv,
        prog="python -m bench.dashboard",
        description="The dashboard's Apps page over 10,000 tasks against `levers9 task list`, "
        "and /metrics with 1,000 workers.",
        quick_help="1,000 tasks, 100 workers",
        plans=(FULL, QUICK),
        run=run_benchmark,
        target=TARGET,
    )
    print(COMPARED)


if __name__ == "__main__":
    main()
