"""The dashboard's session and routes without a browser: what a cookie may do, CSRF, the pages'
headers, paging and the watch streams. The browser itself is in tests/test_dashboard.py."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from control.api.server import Controlplane, serve_controlplane
from control.config import parse
from control.tasks.store import TaskSpec
from control.ui.session import (
    COOKIE,
    CSRF_HEADER,
    cookie_allowed,
    cookie_token,
    csrf_refusal,
    csrf_token,
)
from sim.configs import Pki, make_pki

TOKEN_A = "team-a-token-0123456789"
TOKEN_B = "team-b-token-0123456789"
OPERATOR = "operator-token-0123456789"


# -- the pure rules ----------------------------------------------------------------------------


def test_the_session_token_is_read_from_the_cookie_header_only_by_its_name() -> None:
    assert cookie_token({"cookie": f"a=1; {COOKIE}=tok; b=2"}) == "tok"
    assert cookie_token({"cookie": "levers9-session=tok"}) is None
    assert cookie_token({}) is None


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/tasks", True),
        ("POST", "/v1/tasks/t-1/cancel", True),
        ("GET", "/v1/tasks/t-1/ports/8080/", False),
        ("POST", "/v1/workers/w-1/register", False),
        ("GET", "/v1/workers", True),
        ("CONNECT", "/", False),
        ("GET", "/metrics", True),
        ("GET", "/ui/", True),
        ("POST", "/ui/signin", False),
    ],
)
def test_a_cookie_counts_for_the_api_and_dashboard_but_never_an_endpoint(
    method: str, path: str, allowed: bool
) -> None:
    assert cookie_allowed(method, path) is allowed


def test_a_state_change_by_cookie_needs_our_csrf_value_and_our_origin() -> None:
    ours = {":method": "POST", ":authority": "cp:8443", "sec-fetch-site": "same-origin"}
    assert csrf_refusal({**ours, ":method": "GET"}, "tok") is None
    assert CSRF_HEADER in (csrf_refusal(ours, "tok") or "")
    assert csrf_refusal({**ours, CSRF_HEADER: csrf_token("tok")}, "tok") is None
    assert csrf_refusal({**ours, CSRF_HEADER: csrf_token("other")}, "tok") is not None
    cross = {**ours, "sec-fetch-site": "cross-site", CSRF_HEADER: csrf_token("tok")}
    assert "another site" in (csrf_refusal(cross, "tok") or "")
    no_fetch_site = {":method": "POST", ":authority": "cp:8443", CSRF_HEADER: csrf_token("tok")}
    assert csrf_refusal({**no_fetch_site, "origin": "https://cp:8443"}, "tok") is None
    assert csrf_refusal({**no_fetch_site, "origin": "https://evil:8443"}, "tok") is not None
    assert TOKEN_A not in csrf_token(TOKEN_A)


# -- against a controlplane ---------------------------------------------------------------------


@pytest.fixture
async def control(tmp_path: Path) -> AsyncIterator[tuple[Controlplane, Pki]]:
    pki = make_pki(tmp_path)
    config = parse(
        {
            "config": {
                "publicUrl": "https://127.0.0.1:0",
                "listen": "127.0.0.1:0",
                "tls": {"certFile": str(pki.cert_file), "keyFile": str(pki.key_file)},
                "apiTokens": [{"name": "ops", "token": OPERATOR}],
                "database": {"path": str(tmp_path / "tasks.db")},
                "workspaces": [
                    {"name": "team-a", "tokens": [{"name": "a", "token": TOKEN_A}]},
                    {"name": "team-b", "tokens": [{"name": "b", "token": TOKEN_B}]},
                ],
            }
        }
    )
    async with trio.open_nursery() as nursery:
        running: Controlplane = await nursery.start(serve_controlplane, config)
        yield running, pki
        nursery.cancel_scope.cancel()


def browser(control: tuple[Controlplane, Pki], token: str | None = None) -> httpx.AsyncClient:
    running, pki = control
    context = ssl.create_default_context(cafile=str(pki.ca_file))
    return httpx.AsyncClient(
        http2=True,
        verify=context,
        base_url=f"https://127.0.0.1:{running.port}",
        cookies={COOKIE: token} if token else None,
        headers={"sec-fetch-site": "same-origin"},
    )


async def test_signing_in_sets_a_strict_host_only_cookie_and_a_wrong_token_is_told(
    control: tuple[Controlplane, Pki],
) -> None:
    async with browser(control) as client:
        page = await client.get("/ui/")
        assert (page.status_code, page.headers["location"]) == (303, "/ui/signin")
        wrong = await client.post("/ui/signin", data={"token": "nope"})
        assert wrong.status_code == 401
        assert "not a workspace or operator token" in wrong.text
        assert "nope" not in wrong.text
        right = await client.post("/ui/signin", data={"token": TOKEN_A})
        assert right.status_code == 303 and right.headers["location"] == "/ui/"
        cookie = right.headers["set-cookie"]
        for part in (f"{COOKIE}={TOKEN_A}", "Secure", "HttpOnly", "SameSite=Strict", "Path=/"):
            assert part in cookie
        assert "Domain" not in cookie and "Max-Age" not in cookie
        cross = await client.post(
            "/ui/signin", data={"token": TOKEN_A}, headers={"sec-fetch-site": "cross-site"}
        )
        assert cross.status_code == 403 and "set-cookie" not in cross.headers


async def test_the_shell_carries_who_and_the_csrf_value_never_the_token(
    control: tuple[Controlplane, Pki],
) -> None:
    async with browser(control, TOKEN_A) as client:
        page = await client.get("/ui/")
        assert page.status_code == 200
        assert csrf_token(TOKEN_A) in page.text and "team-a" in page.text
        assert TOKEN_A not in page.text
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "'unsafe-inline'" not in csp
        assert page.headers["x-frame-options"] == "DENY"
        assert page.headers["cache-control"] == "no-store"
        script = await client.get("/ui/static/app.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith(
            "text/javascript"
        )
        again = await client.get(
            "/ui/static/app.js", headers={"if-none-match": script.headers["etag"]}
        )
        assert again.status_code == 304 and again.content == b""
        missing = await client.get("/ui/nothing/here")
        assert missing.status_code == 404 and "/ui/nothing/here" in missing.text
        assert "content-security-policy" in missing.headers
        template = await client.get("/ui/static/app.html")
        assert template.status_code == 404


async def test_a_cookie_state_change_without_the_csrf_header_is_refused(
    control: tuple[Controlplane, Pki],
) -> None:
    running, _ = control
    record = await running.dispatcher.store.create("team-a", TaskSpec(image="busybox"))
    async with browser(control, TOKEN_A) as client:
        refused = await client.post(f"/v1/tasks/{record.id}/cancel")
        assert refused.status_code == 403 and CSRF_HEADER in refused.json()["message"]
        assert (await client.get(f"/v1/tasks/{record.id}")).json()["state"] == "pending"
        done = await client.post(
            f"/v1/tasks/{record.id}/cancel", headers={CSRF_HEADER: csrf_token(TOKEN_A)}
        )
        assert done.status_code == 200 and done.json()["state"] == "cancelled"
        endpoint = await client.get(f"/v1/tasks/{record.id}/ports/8080/")
        assert endpoint.status_code == 401
    async with browser(control, "stale-token") as client:
        assert (await client.get("/v1/tasks")).status_code == 401
        assert (await client.get("/ui/")).headers["location"] == "/ui/signin"
    async with browser(control, TOKEN_B) as client:
        other = await client.get(f"/v1/tasks/{record.id}")
        assert other.status_code == 404


async def test_pages_of_tasks_follow_each_other_without_gaps_or_repeats(
    control: tuple[Controlplane, Pki],
) -> None:
    running, _ = control
    made = [
        await running.dispatcher.store.create("team-a", TaskSpec(image="busybox")) for _ in range(5)
    ]
    await running.dispatcher.store.create("team-b", TaskSpec(image="busybox"))
    async with browser(control, TOKEN_A) as client:
        seen: list[str] = []
        before = ""
        while True:
            page = (await client.get(f"/v1/tasks?limit=2&before={before}")).json()
            seen += [t["id"] for t in page["tasks"]]
            if page["next"] is None:
                break
            before = page["next"]
        assert seen == [r.id for r in reversed(made)]
        wrong = await client.get("/v1/tasks?before=t-000000000000")
        assert wrong.status_code == 400 and "'before'" in wrong.json()["message"]


async def test_a_watched_list_sends_the_page_again_when_a_task_arrives(
    control: tuple[Controlplane, Pki],
) -> None:
    running, _ = control
    first = await running.dispatcher.store.create("team-a", TaskSpec(image="busybox"))
    async with browser(control, TOKEN_A) as client:
        async with client.stream("GET", "/v1/tasks?watch=true") as response:
            lines = response.aiter_lines()
            page = json.loads(await anext(lines))
            assert [t["id"] for t in page["tasks"]] == [first.id]
            second = await running.dispatcher.store.create("team-a", TaskSpec(image="busybox"))
            running.dispatcher.changed()
            with trio.fail_after(10):
                page = json.loads(await anext(lines))
            assert [t["id"] for t in page["tasks"]] == [second.id, first.id]
