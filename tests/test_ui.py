"""The dashboard's session and routes without a browser: what a cookie may do, CSRF, the pages'
headers, paging and the watch streams. The browser itself is in tests/test_dashboard.py."""

from __future__ import annotations

import json
import re
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from control.api.server import Controlplane
from control.config import parse
from control.tasks.store import TaskSpec
from control.ui.session import (
    COOKIE,
    CSRF_HEADER,
    cookie_allowed,
    cookie_session,
    csrf_refusal,
    csrf_token,
    new_session_id,
    same_origin,
)
from sim.configs import Pki, make_pki
from sim.controlplane import run_controlplane

TOKEN_A = "team-a-token-0123456789"
TOKEN_B = "team-b-token-0123456789"
OPERATOR = "operator-token-0123456789"


# -- the pure rules ----------------------------------------------------------------------------


def test_the_session_id_is_read_from_the_cookie_header_only_by_its_name() -> None:
    sid = new_session_id()
    assert cookie_session({"cookie": f"a=1; {COOKIE}={sid}; b=2"}) == sid
    assert cookie_session({"cookie": f"levers9-session={sid}"}) is None
    assert cookie_session({"cookie": f"{COOKIE}={TOKEN_A}"}) is None  # not an id of ours
    assert cookie_session({}) is None


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
    sid = new_session_id()
    ours = {":method": "POST", ":authority": "cp:8443", "sec-fetch-site": "same-origin"}
    assert csrf_refusal({**ours, ":method": "GET"}, sid) is None
    assert CSRF_HEADER in (csrf_refusal(ours, sid) or "")
    assert csrf_refusal({**ours, CSRF_HEADER: csrf_token(sid)}, sid) is None
    assert csrf_refusal({**ours, CSRF_HEADER: csrf_token(new_session_id())}, sid) is not None
    cross = {**ours, "sec-fetch-site": "cross-site", CSRF_HEADER: csrf_token(sid)}
    assert "another site" in (csrf_refusal(cross, sid) or "")
    no_fetch_site = {":method": "POST", ":authority": "cp:8443", CSRF_HEADER: csrf_token(sid)}
    assert csrf_refusal({**no_fetch_site, "origin": "https://cp:8443"}, sid) is None
    assert csrf_refusal({**no_fetch_site, "origin": "https://evil:8443"}, sid) is not None
    assert sid not in csrf_token(sid)


@pytest.mark.parametrize(
    ("origin", "ours"),
    [
        ("https://cp:8443", True),
        ("https://CP:8443", True),
        ("http://cp:8443", False),  # same host, another scheme: another origin
        ("https://cp:8444", False),
        ("https://evil.example", False),
        ("null", False),
        ("https://cp:8443.evil.example", False),
    ],
)
def test_the_origin_check_compares_scheme_host_and_port(origin: str, ours: bool) -> None:
    headers = {":method": "POST", ":scheme": "https", ":authority": "cp:8443", "origin": origin}
    assert same_origin(headers) is ours
    # Sec-Fetch-Site does not excuse a wrong Origin.
    assert same_origin({**headers, "sec-fetch-site": "same-origin"}) is ours


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
        running: Controlplane = await nursery.start(run_controlplane, config)
        yield running, pki
        nursery.cancel_scope.cancel()


def browser(
    control: tuple[Controlplane, Pki], session: str | None = None, *, same_site: bool = True
) -> httpx.AsyncClient:
    """A client as a browser of ours would be: with the session cookie `session` (an id from
    `sign_in`) and Sec-Fetch-Site: same-origin, unless `same_site` is False (no such header)."""
    running, pki = control
    context = ssl.create_default_context(cafile=str(pki.ca_file))
    return httpx.AsyncClient(
        http2=True,
        verify=context,
        base_url=f"https://127.0.0.1:{running.port}",
        cookies={COOKIE: session} if session else None,
        headers={"sec-fetch-site": "same-origin"} if same_site else None,
    )


async def sign_in(control: tuple[Controlplane, Pki], token: str) -> str:
    """Sign in with `token` as the form does: the session id the cookie was set to."""
    async with browser(control) as client:
        answer = await client.post("/ui/signin", data={"token": token})
    assert answer.status_code == 303, answer.text
    found = re.match(f"{re.escape(COOKIE)}=([^;]+);", answer.headers["set-cookie"])
    assert found is not None
    return found.group(1)


async def csrf_of(client: httpx.AsyncClient) -> str:
    """The CSRF value the shell gives the signed-in browser."""
    page = await client.get("/ui/")
    found = re.search(r'name="levers9-csrf" content="([0-9a-f]+)"', page.text)
    assert found is not None, page.text
    return found.group(1)


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
        for part in (f"{COOKIE}=", "Secure", "HttpOnly", "SameSite=Strict", "Path=/"):
            assert part in cookie
        assert "Domain" not in cookie and "Max-Age" not in cookie
        # The cookie holds a session of its own, not the token.
        assert TOKEN_A not in cookie
        cross = await client.post(
            "/ui/signin", data={"token": TOKEN_A}, headers={"sec-fetch-site": "cross-site"}
        )
        assert cross.status_code == 403 and "set-cookie" not in cross.headers


async def test_the_shell_carries_who_and_the_csrf_value_never_the_token(
    control: tuple[Controlplane, Pki],
) -> None:
    session = await sign_in(control, TOKEN_A)
    async with browser(control, session) as client:
        page = await client.get("/ui/")
        assert page.status_code == 200
        assert csrf_token(session) in page.text and "team-a" in page.text
        assert TOKEN_A not in page.text and session not in page.text
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
    async with browser(control, await sign_in(control, TOKEN_A)) as client:
        refused = await client.post(f"/v1/tasks/{record.id}/cancel")
        assert refused.status_code == 403 and CSRF_HEADER in refused.json()["message"]
        assert (await client.get(f"/v1/tasks/{record.id}")).json()["state"] == "pending"
        done = await client.post(
            f"/v1/tasks/{record.id}/cancel", headers={CSRF_HEADER: await csrf_of(client)}
        )
        assert done.status_code == 200 and done.json()["state"] == "cancelled"
        endpoint = await client.get(f"/v1/tasks/{record.id}/ports/8080/")
        assert endpoint.status_code == 401
    for stale in (TOKEN_A, new_session_id()):  # a token is no session; nor is a made-up id
        async with browser(control, stale) as client:
            assert (await client.get("/v1/tasks")).status_code == 401
            assert (await client.get("/ui/")).headers["location"] == "/ui/signin"
    async with browser(control, await sign_in(control, TOKEN_B)) as client:
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
    async with browser(control, await sign_in(control, TOKEN_A)) as client:
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


async def test_a_watched_list_sends_the_task_that_arrived(
    control: tuple[Controlplane, Pki],
) -> None:
    running, _ = control
    first = await running.dispatcher.store.create("team-a", TaskSpec(image="busybox"))
    async with browser(control, await sign_in(control, TOKEN_A)) as client:
        async with client.stream("GET", "/v1/tasks?watch=true") as response:
            lines = response.aiter_lines()
            page = json.loads(await anext(lines))
            assert [t["id"] for t in page["tasks"]] == [first.id]
            second = await running.dispatcher.store.create("team-a", TaskSpec(image="busybox"))
            running.dispatcher.changed()
            with trio.fail_after(10):
                changes = json.loads(await anext(lines))
            # Only the task that arrived, with its place in the page (control.api.watch).
            assert [(c["index"], c["task"]["id"]) for c in changes["changed"]] == [(0, second.id)]


# -- sessions -----------------------------------------------------------------------------------


async def test_signing_out_ends_the_session_for_a_copied_cookie_too(
    control: tuple[Controlplane, Pki],
) -> None:
    session = await sign_in(control, TOKEN_A)
    async with browser(control, session) as client, browser(control, session) as copy:
        assert (await copy.get("/v1/tasks")).status_code == 200
        out = await client.post("/ui/signout", headers={CSRF_HEADER: await csrf_of(client)})
        assert out.status_code == 303 and "Max-Age=0" in out.headers["set-cookie"]
        assert (await copy.get("/v1/tasks")).status_code == 401
        assert (await copy.get("/ui/")).headers["location"] == "/ui/signin"


async def test_the_cookie_is_not_the_token_and_the_database_keeps_neither(
    control: tuple[Controlplane, Pki], tmp_path: Path
) -> None:
    running, _ = control
    session = await sign_in(control, TOKEN_A)
    assert session != TOKEN_A
    async with browser(control, session) as client:
        assert (await client.get("/v1/tasks")).status_code == 200
    await running.dispatcher.store.create("team-a", TaskSpec(image="busybox"))  # more writes
    stored = b"".join(f.read_bytes() for f in tmp_path.glob("tasks.db*"))
    assert b"ui_sessions" in stored  # the table is there (the check below reads real bytes)
    assert session.encode() not in stored and TOKEN_A.encode() not in stored


async def test_two_sessions_of_one_token_have_their_own_csrf_values(
    control: tuple[Controlplane, Pki],
) -> None:
    first, second = await sign_in(control, TOKEN_A), await sign_in(control, TOKEN_A)
    async with browser(control, first) as one, browser(control, second) as two:
        csrf_one, csrf_two = await csrf_of(one), await csrf_of(two)
        assert csrf_one != csrf_two
        record = await control[0].dispatcher.store.create("team-a", TaskSpec(image="busybox"))
        crossed = await two.post(f"/v1/tasks/{record.id}/cancel", headers={CSRF_HEADER: csrf_one})
        assert crossed.status_code == 403


async def test_an_expired_or_idle_session_is_refused(
    control: tuple[Controlplane, Pki],
) -> None:
    running, _ = control
    sessions = running.sessions
    start = time.time()
    now = [start]
    sessions.clock = lambda: now[0]
    busy = await sign_in(control, TOKEN_A)
    idle = await sign_in(control, TOKEN_A)
    async with browser(control, busy) as client, browser(control, idle) as left:
        # Used every half hour, the busy one outlives the idle limit (an hour) ...
        for _ in range(4):
            now[0] += 1800
            assert (await client.get("/v1/tasks")).status_code == 200
        assert (await left.get("/v1/tasks")).status_code == 401
        # ... but not the absolute one (twelve hours), however busy.
        while now[0] < start + 12 * 3600:
            now[0] += 1800
            await client.get("/v1/tasks")
        assert (await client.get("/v1/tasks")).status_code == 401
    assert await sessions.sweep() == 0  # both rows went when they were met expired


async def test_a_cross_site_post_under_ui_is_refused_even_without_a_cookie(
    control: tuple[Controlplane, Pki],
) -> None:
    running, _ = control
    ours = f"https://127.0.0.1:{running.port}"
    session = await sign_in(control, TOKEN_A)
    async with browser(control, same_site=False) as attacker:
        for origin in ("https://evil.example", f"http://127.0.0.1:{running.port}", "null"):
            refused = await attacker.post("/ui/signout", headers={"origin": origin})
            assert refused.status_code == 403, origin
            assert "set-cookie" not in refused.headers
            # A refusal under /ui/ is as guarded a page as the pages.
            assert refused.headers["content-type"] == "application/json"
            assert "frame-ancestors 'none'" in refused.headers["content-security-policy"]
            assert refused.headers["x-frame-options"] == "DENY"
            assert refused.headers["x-content-type-options"] == "nosniff"
            assert refused.headers["referrer-policy"] == "same-origin"
            assert refused.headers["cache-control"] == "no-store"
        cross = await attacker.post(
            "/ui/signin", data={"token": TOKEN_A}, headers={"origin": "https://evil.example"}
        )
        assert cross.status_code == 403 and "set-cookie" not in cross.headers
        ok = await attacker.post("/ui/signout", headers={"origin": ours})
        assert ok.status_code == 303
    async with browser(control, session) as client:
        assert (await client.get("/v1/tasks")).status_code == 200  # nobody was signed out
    async with browser(control) as client:
        api = await client.get("/v1/nothing")
        assert api.status_code == 401 and "content-security-policy" not in api.headers
