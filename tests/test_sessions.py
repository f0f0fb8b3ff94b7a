"""The dashboard's sessions in the task database, as replicas share them: on a real SQLite file
and a real PostgreSQL server (`tests.postgres_fixtures`), each store its own connection, as two
replicas' are; then two controlplanes over one PostgreSQL database, each with its own config."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from control.api.server import Controlplane
from control.config import DatabaseSettings, parse
from control.db.open import open_database
from control.ui.session import COOKIE, SessionLimits, session_hash
from control.ui.sessions import SessionStore
from sim.configs import Pki, make_pki
from sim.controlplane import run_controlplane
from tests.test_tasks import Where, stored_bytes

pytest_plugins = ["tests.postgres_fixtures"]

LIMITS = SessionLimits(max_s=12 * 3600.0, idle_s=3600.0)
TOKEN_A = "team-a-token-0123456789"
TOKEN_B = "team-b-token-0123456789"


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Where:
    if request.param == "sqlite":
        return tmp_path / "tasks.db"
    settings: DatabaseSettings = request.getfixturevalue("postgres_database")
    return settings


@asynccontextmanager
async def two_replicas(
    where: Where, clock: Callable[[], float]
) -> AsyncIterator[tuple[SessionStore, SessionStore]]:
    """Two session stores over one database, each on its own connection (pool)."""
    async with AsyncExitStack() as stack:
        stores = []
        for _ in range(2):
            db = await open_database(where)
            stack.push_async_callback(db.aclose)
            stores.append(SessionStore(db, LIMITS, clock))
        yield stores[0], stores[1]


async def test_a_session_made_on_one_replica_counts_and_ends_on_another(
    database: Where, request: pytest.FixtureRequest
) -> None:
    now = [1_000_000.0]
    async with two_replicas(database, lambda: now[0]) as (one, two):
        session = await one.create("ws:team-a")
        other = await one.create("api:ops")
        assert await two.principal(session) == "ws:team-a"
        assert await two.principal("x" * 43) is None
        await two.revoke(session)
        assert await one.principal(session) is None
        assert await one.principal(other) == "api:ops"
        # Idle for the idle limit: gone, on either replica.
        now[0] += LIMITS.idle_s
        assert await two.principal(other) is None
        # Only hashes are kept.
        kept = await one.create("ws:team-b")
        raw = stored_bytes(database, request)
        assert kept.encode() not in raw and session.encode() not in raw
        assert session_hash(kept).encode() in raw


async def test_expired_sessions_are_swept(database: Where) -> None:
    now = [1_000_000.0]
    async with two_replicas(database, lambda: now[0]) as (one, two):
        old = [await one.create("ws:team-a") for _ in range(3)]
        for _ in range(int(LIMITS.max_s // 1800) - 1):
            now[0] += 1800
            assert await two.principal(old[0]) == "ws:team-a"  # used: only the others idle
        assert await one.sweep() == 2
        now[0] += 1800
        assert await two.principal(old[0]) is None  # past the absolute limit
        fresh = await two.create("ws:team-a")  # signing in sweeps as well
        assert await one.sweep() == 0
        assert await one.principal(fresh) == "ws:team-a"


# -- two controlplanes -------------------------------------------------------------------------


def replica_config(pki: Pki, settings: DatabaseSettings, workspaces: list[Any]) -> Any:
    return parse(
        {
            "config": {
                "publicUrl": "https://127.0.0.1:0",
                "listen": "127.0.0.1:0",
                "tls": {"certFile": str(pki.cert_file), "keyFile": str(pki.key_file)},
                "database": {"url": settings.url, "password": settings.password},
                "workspaces": workspaces,
            }
        }
    )


def client_of(running: Controlplane, pki: Pki, session: str | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        http2=True,
        verify=ssl.create_default_context(cafile=str(pki.ca_file)),
        base_url=f"https://127.0.0.1:{running.port}",
        cookies={COOKIE: session} if session else None,
        headers={"sec-fetch-site": "same-origin"},
    )


async def test_replicas_honour_each_others_sessions_and_forget_removed_workspaces(
    postgres_database: DatabaseSettings, tmp_path: Path
) -> None:
    pki = make_pki(tmp_path)
    team_a = {"name": "team-a", "tokens": [{"name": "a", "token": TOKEN_A}]}
    team_b = {"name": "team-b", "tokens": [{"name": "b", "token": TOKEN_B}]}
    first_config = replica_config(pki, postgres_database, [team_a, team_b])
    # The second replica's config has team-b's token removed.
    second_config = replica_config(pki, postgres_database, [team_a, {"name": "team-b"}])
    async with trio.open_nursery() as nursery:
        first: Controlplane = await nursery.start(run_controlplane, first_config)
        second: Controlplane = await nursery.start(run_controlplane, second_config)
        sessions = {}
        for name, token in (("a", TOKEN_A), ("b", TOKEN_B)):
            # A client each: signing in again from one browser ends its previous session.
            async with client_of(first, pki) as client:
                answer = await client.post("/ui/signin", data={"token": token})
                assert answer.status_code == 303
                sessions[name] = answer.headers["set-cookie"].split(";")[0].partition("=")[2]
        async with client_of(second, pki, sessions["a"]) as there:
            assert (await there.get("/v1/tasks")).status_code == 200
        async with client_of(second, pki, sessions["b"]) as there:
            assert (await there.get("/v1/tasks")).status_code == 401
        async with client_of(first, pki, sessions["b"]) as here:
            assert (await here.get("/v1/tasks")).status_code == 200
        async with client_of(second, pki, sessions["a"]) as there:
            page = await there.get("/ui/")
            csrf = page.text.split('name="levers9-csrf" content="')[1].split('"')[0]
            out = await there.post("/ui/signout", headers={"x-levers9-csrf": csrf})
            assert out.status_code == 303
        async with client_of(first, pki, sessions["a"]) as here:
            assert (await here.get("/v1/tasks")).status_code == 401
        nursery.cancel_scope.cancel()
