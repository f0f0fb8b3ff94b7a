"""The dashboard in a real browser, and `/metrics`, against the loopback installation.

Debian's Chromium is driven by Playwright (never a downloaded browser) over HTTPS to the
controlplane, which it trusts by the public key of the simulated installation's certificate.
Playwright's synchronous API runs in one worker thread for the whole scenario while trio keeps
serving the controlplane and the workers; screenshots of Apps and Machines are kept under
`test-artifacts/dashboard/` (or `$LEVERS9_ARTIFACTS/dashboard/`).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from control.models import TaskRequest, TaskState
from sim.browser import open_browser_network, spki_pin
from sim.cluster import Cluster, free_port, open_node_cluster
from sim.configs import API_TOKEN
from sim.kubeapi.store import KubeStandin
from sim.pools import gpu_node
from tests.test_card_health_control import SQUATTER, XID_79
from tests.test_pool_reconcile import serve_pool
from tests.test_reconcile_faults import JOBS, refuse_creates
from workerapi.models import CardInfo, CardState, Registration

if TYPE_CHECKING:  # a plugin pytest loads itself: importing it first stops its asserts
    # from being rewritten
    from tests.registry_fixtures import SharedRegistry

pytest_plugins = ["tests.kube_fixtures", "tests.registry_fixtures"]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="containers need root (CI runs as root)")

TICKS = "i=0; while true; do i=$((i+1)); echo tick $i; echo warn $i >&2; sleep 0.2; done"


def artifacts() -> Path:
    where = Path(os.environ.get("LEVERS9_ARTIFACTS", "test-artifacts")) / "dashboard"
    where.mkdir(parents=True, exist_ok=True)
    return where


@attrs.frozen
class Seen:
    """What the browser saw, for the assertions made back in trio."""

    csp: str
    console_errors: tuple[str, ...]
    signin_error: str
    b_rows: int
    b_saw_a: bool


@pytest.fixture
async def cluster(tmp_path: Path, kube: KubeStandin) -> AsyncIterator[Cluster]:
    metrics = free_port()
    async with open_node_cluster(
        tmp_path / "cluster",
        kube,
        2,
        extra_config={"metrics": {"listen": f"127.0.0.1:{metrics}"}},
    ) as running:
        yield running


def drive(cluster: Cluster, chromium: str, finished: str, ticking: str) -> Seen:
    """The whole browser scenario, in this (worker) thread."""
    from playwright.sync_api import expect, sync_playwright

    base = cluster.url
    errors: list[str] = []
    # Generous waits: on a loaded 2-core machine Chromium's first page takes seconds.
    expect.set_options(timeout=20_000)

    # Failures the scenario causes on purpose: a view's streams are aborted when the view
    # changes, and the browser is taken offline once. (The browser has a network of its own,
    # so the containers' veths on this host never fail its loads.)
    expected = ["ERR_ABORTED"]

    def note_failure(url: str, why: str) -> None:
        if not any(e in why for e in expected):
            errors.append(f"{url}: {why}")

    def note_console(message: Any) -> None:
        # Chromium also logs each as "Failed to load resource: net::ERR_...".
        text = message.text
        if message.type == "error" and not (
            text.startswith("Failed to load resource") and any(e in text for e in expected)
        ):
            errors.append(text)

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium,
            args=[
                "--no-sandbox",
                f"--ignore-certificate-errors-spki-list={spki_pin(cluster.pki.cert_file)}",
            ],
        )
        try:
            # Workspace A: a wrong token first, then the right one.
            alice = browser.new_context(viewport={"width": 1400, "height": 900})
            page = alice.new_page()
            page.goto(f"{base}/ui/")
            expect(page).to_have_url(f"{base}/ui/signin")
            page.fill("#token", "not-a-token")
            page.click("button[type=submit]")
            signin_error = page.inner_text("[role=alert]")
            page.on("console", note_console)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("requestfailed", lambda r: note_failure(r.url, r.failure or ""))
            page.fill("#token", cluster.tokens["team-a"])
            with page.expect_navigation() as signed_in:
                page.click("button[type=submit]")
            expect(page).to_have_url(f"{base}/ui/")
            csp = (
                signed_in.value.headers.get("content-security-policy", "")
                if signed_in.value
                else ""
            )
            expect(page.locator(f"tr[data-task='{finished}']")).to_contain_text("succeeded")
            expect(page.locator(f"tr[data-task='{ticking}']")).to_contain_text("running")
            page.screenshot(path=str(artifacts() / "apps.png"), full_page=True)
            # The controlplane goes away a moment (a restart; for a browser, a network change
            # is the same): the list says it lost the controlplane, and says nothing once it
            # streams again.
            expected.append("ERR_")
            trio.from_thread.run(cluster.stop_controlplane)
            expect(page.locator(".notice.error")).to_contain_text("lost the controlplane")
            trio.from_thread.run(cluster.start_controlplane)
            expect(page.locator(".notice")).to_have_count(0)
            expected.remove("ERR_")
            expect(page.locator(f"tr[data-task='{ticking}']")).to_contain_text("running")

            # The running task's page: its log arrives line by line, without a reload.
            page.evaluate("window.levers9Marker = 'same page'")
            page.click(f"tr[data-task='{ticking}'] a")
            log = page.locator("pre.log")
            expect(log).to_contain_text("tick 3")
            expect(log.locator(".line.stderr").first).to_contain_text("warn")
            seen_first = log.locator(".line").count()
            expect(log).to_contain_text(f"tick {seen_first + 5}", timeout=15_000)
            assert page.evaluate("window.levers9Marker") == "same page"
            # A part of the page not shown (no reason yet, no snapshot button) leaves nothing,
            # never the text "null".
            assert "null" not in page.inner_text("main"), page.inner_text("main")

            # Cancel, confirmed in the dialog: the state changes on the same page.
            page.click("#cancel")
            expect(page.locator("#confirm")).to_be_visible()
            page.click("#confirm-ok")
            expect(page.locator("h1 .state")).to_have_text("cancelled", timeout=30_000)
            assert page.evaluate("window.levers9Marker") == "same page"
            assert "null" not in page.inner_text("main"), page.inner_text("main")
            page.goto(f"{base}/ui/#/apps")
            expect(page.locator(f"tr[data-task='{ticking}']")).to_contain_text("cancelled")
            alice.close()

            # Workspace B sees none of A's tasks.
            bob = browser.new_context()
            page = bob.new_page()
            page.goto(f"{base}/ui/signin")
            page.fill("#token", cluster.tokens["team-b"])
            with page.expect_navigation():
                page.click("button[type=submit]")
            expect(page.locator("table.tasks tbody")).to_contain_text("No tasks yet")
            b_rows = page.locator("tr[data-task]").count()
            b_saw_a = finished in page.content() or ticking in page.content()
            bob.close()

            # The operator: machines with their cards, and the workers.
            operator = browser.new_context(viewport={"width": 1400, "height": 700})
            page = operator.new_page()

            page.on("console", note_console)
            page.goto(f"{base}/ui/signin")
            page.fill("#token", cluster.operator_token)
            with page.expect_navigation():
                page.click("button[type=submit]")
            page.goto(f"{base}/ui/#/machines")
            node = page.locator("tr[data-node='gpu-node-1']")
            expect(node).to_contain_text("ready")
            # The worker holds both cards: one for the sleeping task, one idle.
            expect(node.locator(".bar .busy")).to_have_text("1")
            expect(node.locator(".bar .idle")).to_have_text("1")
            page.screenshot(path=str(artifacts() / "machines.png"), full_page=True)
            page.goto(f"{base}/ui/#/workers")
            expect(page.locator("tr[data-worker]")).to_contain_text("direct")
            # Apps is not the operator's: the API's 403 (which the browser logs) in words.
            page.remove_listener("console", note_console)
            page.goto(f"{base}/ui/#/apps")
            expect(page.locator(".notice")).to_contain_text("workspace token")
            operator.close()
        finally:
            browser.close()
    return Seen(
        csp=csp,
        console_errors=tuple(errors),
        signin_error=signin_error,
        b_rows=b_rows,
        b_saw_a=b_saw_a,
    )


async def test_the_dashboard_shows_a_workspace_its_tasks_live_and_cancels_one(
    cluster: Cluster, registry: SharedRegistry
) -> None:
    async with cluster.client() as client:
        done = await client.create_task(
            TaskRequest(image=registry.busybox, command=("echo", "hello from the demo"), cards=1)
        )
        assert (await client.wait_task(done.id)).state is TaskState.SUCCEEDED
        ticking = await client.create_task(
            TaskRequest(image=registry.busybox, command=("sh", "-c", TICKS), cards=1)
        )
        sleeping = await client.create_task(
            TaskRequest(image=registry.busybox, command=("sleep", "600"), cards=1)
        )
        with trio.fail_after(60):
            for task in (ticking, sleeping):
                while (await client.task(task.id)).state is not TaskState.RUNNING:  # noqa: ASYNC110
                    await trio.sleep(0.1)

    async with open_browser_network(cluster.url) as chromium:
        seen = await trio.to_thread.run_sync(drive, cluster, chromium, done.id, ticking.id)
    async with cluster.client() as client:  # the controlplane was restarted meanwhile
        assert (await client.task(ticking.id)).state is TaskState.CANCELLED
        await client.cancel_task(sleeping.id)
    assert "script-src 'self'" in seen.csp and "frame-ancestors 'none'" in seen.csp
    assert "not a workspace or operator token" in seen.signin_error
    assert seen.b_rows == 0 and not seen.b_saw_a
    assert seen.console_errors == ()
    assert (artifacts() / "apps.png").stat().st_size > 0
    assert (artifacts() / "machines.png").stat().st_size > 0


def samples(
    text: str, family_name: str, sample: str = ""
) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of one metric family (`sample`: a suffix such as `_count`): labels
    (sorted) → value."""
    for family in text_string_to_metric_families(text):
        if family.name == family_name:
            wanted = {family_name + sample} if sample else {family_name, f"{family_name}_total"}
            return {
                tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name in wanted
            }
    raise AssertionError(f"no metric {family_name} in the scrape")


async def test_metrics_agree_with_the_api_after_tasks_ran(
    cluster: Cluster, registry: SharedRegistry
) -> None:
    async with cluster.client() as client:
        ok = await client.create_task(
            TaskRequest(image=registry.busybox, command=("true",), cards=1)
        )
        bad = await client.create_task(
            TaskRequest(image=registry.busybox, command=("sh", "-c", "exit 4"))
        )
        for task in (ok, bad):
            await client.wait_task(task.id)
        tasks = await client.tasks()
    assert cluster.control is not None and cluster.control.metrics_port is not None
    url = f"http://127.0.0.1:{cluster.control.metrics_port}/metrics"
    async with cluster.client("operator") as operator, httpx.AsyncClient() as http:
        # Both scrapes between two listings that agree: a reconcile pass that ends in between
        # (the cards the tasks held coming free) changes what both report, and is waited out.
        with trio.fail_after(30):
            while True:
                machines = await operator.machines()
                response = await operator.open("GET", "/metrics")
                scraped = (await response.read()).decode()
                plain = await http.get(url)
                if await operator.machines() == machines:
                    break
                await trio.sleep(0.1)
    assert plain.status_code == 200

    for text in (scraped, plain.text):
        by_state = samples(text, "levers9_tasks")
        for state in TaskState:
            expected = sum(1 for t in tasks if t.state is state)
            key = (("state", state.value), ("workspace", "team-a"))
            assert by_state[key] == expected, state
        free = samples(text, "levers9_pool_cards")[(("pool", "gpu"), ("use", "free"))]
        assert free == sum(m.cards.free for m in machines.machines)
        placed = samples(text, "levers9_task_placement_seconds", "_count")
        assert placed[()] >= 2
        requests = samples(text, "levers9_api_requests")
        created = (("code", "201"), ("method", "POST"), ("route", "/v1/tasks"))
        assert requests[created] >= 2
        assert not any("t-" in value for labels in requests for _, value in labels)


async def test_metrics_need_an_operator_token_on_the_api_port(cluster: Cluster) -> None:
    async with cluster.client("team-a") as client:
        response = await client.open("GET", "/metrics")
        body: Any = await response.read()
    assert response.status == 403, body


def machine_row(
    url: str, chromium: str, cert_file: Path, node: str, shown: str = ".node-error"
) -> str:
    """The operator's Machines page, signed in with the operator token: `node`'s row once it
    shows `shown` (a failed write, by default)."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=20_000)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium,
            args=["--no-sandbox", f"--ignore-certificate-errors-spki-list={spki_pin(cert_file)}"],
        )
        try:
            page = browser.new_page()
            page.goto(f"{url}/ui/signin")
            page.fill("#token", API_TOKEN)
            with page.expect_navigation():
                page.click("button[type=submit]")
            page.goto(f"{url}/ui/#/machines")
            row = page.locator(f"tr[data-node='{node}']")
            expect(row.locator(shown).first).to_be_visible()
            return row.inner_text()
        finally:
            browser.close()


async def test_a_nodes_refused_write_shows_on_its_machine(
    tmp_path: Path, kube: KubeStandin, nursery: trio.Nursery
) -> None:
    """A quota refusing the worker Job of one node: the operator sees why on that node's row."""
    kube.add_node(gpu_node("node-q"))
    refuse_creates(kube, JOBS, "exceeded quota: gpu-quota, requested: nvidia.com/gpu=4")
    control, reconciling, pki = await serve_pool(kube, tmp_path, nursery)
    with trio.fail_after(30):
        while "node-q" not in reconciling.status.failed:
            await reconciling.passes.park()
    url = f"https://127.0.0.1:{control.port}"
    async with open_browser_network(url) as chromium:
        row = await trio.to_thread.run_sync(machine_row, url, chromium, pki.cert_file, "node-q")
    assert "Last write failed" in row and "exceeded quota: gpu-quota" in row


async def test_an_unhealthy_card_shows_on_its_machine_with_its_reason(
    tmp_path: Path, kube: KubeStandin, nursery: trio.Nursery
) -> None:
    """A worker reporting one card off the bus and one used by another's process: the
    operator sees both cards named on that node's row, with the worker's words."""
    kube.on_job_created(lambda server, job: server.run_job_pod(job))
    kube.add_node(gpu_node("node-h"))
    control, reconciling, pki = await serve_pool(kube, tmp_path, nursery)
    with trio.fail_after(30):
        while not any(m.worker is not None for m in reconciling.status.machines):
            await reconciling.passes.park()
    (job,) = kube.jobs()
    cards = tuple(
        CardInfo(f"GPU-{i}", i, "A100", 40 << 30, CardState.SERVING, "") for i in range(4)
    )
    sick = CardInfo("GPU-2", 2, "A100", 40 << 30, CardState.UNHEALTHY, XID_79)
    squatted = CardInfo("GPU-1", 1, "A100", 40 << 30, CardState.OCCUPIED, SQUATTER)
    await control.registry.register(
        Registration(
            worker_id=job["metadata"]["name"],
            version="1",
            mode="tunnel",
            node="node-h",
            cards=(cards[0], squatted, sick, cards[3]),
        )
    )
    url = f"https://127.0.0.1:{control.port}"
    async with open_browser_network(url) as chromium:
        row = await trio.to_thread.run_sync(
            machine_row, url, chromium, pki.cert_file, "node-h", ".card-problem"
        )
    assert f"card 2 (GPU-2): unhealthy: {XID_79}" in row
    assert f"card 1 (GPU-1): {SQUATTER}" in row
