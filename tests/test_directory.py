"""Who owns which worker, in the task database (`control.workers.directory`): one suite run on
both backends, SQLite and a real PostgreSQL 15. Two replicas never both hold a worker; a lapsed
claim is taken, a forced one (a tunnel that landed) always; tokens are kept only as hashes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from control.config import DatabaseSettings
from control.tasks.store import open_task_store
from control.workers.directory import Directory, OwnerAddress, token_hash
from control.workers.registry import Replication, open_worker_registry

pytest_plugins = ["tests.postgres_fixtures"]

Where = Path | DatabaseSettings
FP_A, FP_B = "a" * 64, "b" * 64


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Where:
    if request.param == "sqlite":
        return tmp_path / "tasks.db"
    settings: DatabaseSettings = request.getfixturevalue("postgres_database")
    return settings


@pytest.fixture
async def directory(database: Where) -> AsyncIterator[Directory]:
    async with open_task_store(database) as store:
        yield Directory(store.database)


async def test_a_free_worker_is_taken_and_another_replica_is_refused(directory: Directory) -> None:
    assert await directory.claim("w-1", "a", now=100.0, until=115.0, force=False)
    assert not await directory.claim("w-1", "b", now=101.0, until=116.0, force=False)
    assert await directory.claim("w-1", "a", now=102.0, until=117.0, force=False)  # its own
    rows = {r.worker_id: r for r in await directory.workers()}
    assert rows["w-1"].owner == "a" and rows["w-1"].owner_expires == 117.0


async def test_a_lapsed_claim_is_taken_and_a_forced_one_always(directory: Directory) -> None:
    await directory.claim("w-1", "a", now=100.0, until=115.0, force=False)
    assert await directory.claim("w-1", "b", now=115.0, until=130.0, force=False)
    assert await directory.claim("w-1", "a", now=116.0, until=131.0, force=True)
    assert (await directory.workers())[0].owner == "a"


async def test_renewal_tells_a_replica_which_claims_it_still_holds(directory: Directory) -> None:
    for worker in ("w-1", "w-2"):
        await directory.claim(worker, "a", now=100.0, until=115.0, force=False)
    await directory.claim("w-2", "b", now=101.0, until=116.0, force=True)  # its tunnel moved
    assert await directory.renew("a", ["w-1", "w-2"], until=120.0) == {"w-1"}
    rows = {r.worker_id: r for r in await directory.workers()}
    assert rows["w-1"].owner_expires == 120.0
    assert rows["w-2"].owner == "b" and rows["w-2"].owner_expires == 116.0


async def test_the_owner_is_found_only_while_both_claim_and_replica_live(
    directory: Directory,
) -> None:
    await directory.heartbeat("a", "10.0.0.1:8443", FP_A, until=130.0)
    await directory.heartbeat("b", "10.0.0.2:8443", FP_B, until=110.0)
    await directory.claim("w-1", "a", now=100.0, until=115.0, force=False)
    await directory.claim("w-2", "b", now=100.0, until=125.0, force=False)
    assert await directory.owner("w-1", 101.0) == OwnerAddress("a", "10.0.0.1:8443", FP_A)
    assert await directory.owner("w-1", 116.0) is None  # the claim lapsed
    assert await directory.owner("w-2", 111.0) is None  # the replica stopped beating
    assert await directory.owner("w-9", 101.0) is None
    assert [r.replica for r in await directory.live_replicas(105.0)] == ["a", "b"]
    assert [r.replica for r in await directory.live_replicas(111.0)] == ["a"]


async def test_a_replica_that_leaves_frees_its_workers_at_once(directory: Directory) -> None:
    await directory.heartbeat("a", "10.0.0.1:8443", FP_A, until=130.0)
    await directory.claim("w-1", "a", now=100.0, until=115.0, force=False)
    await directory.leave("a")
    assert await directory.live_replicas(101.0) == []
    assert await directory.claim("w-1", "b", now=101.0, until=116.0, force=False)


async def test_tokens_are_kept_as_hashes_and_registrations_as_facts(
    directory: Directory,
) -> None:
    await directory.add_worker("w-1", token_hash("tok-secret-0123456789"))
    await directory.save_facts("w-1", {"mode": "direct", "node": "n-1", "registeredAt": 5.0})
    await directory.save_facts("w-2", {"mode": "tunnel"})
    rows = {r.worker_id: r for r in await directory.workers()}
    assert rows["w-1"].token_hash == token_hash("tok-secret-0123456789") != "tok-secret-0123456789"
    assert rows["w-1"].facts == {"mode": "direct", "node": "n-1", "registeredAt": 5.0}
    assert rows["w-2"].token_hash is None
    await directory.remove_worker("w-1")
    assert [r.worker_id for r in await directory.workers()] == ["w-2"]


async def test_racing_replicas_take_a_worker_exactly_once(directory: Directory) -> None:
    taken: list[str] = []

    async def race(replica: str) -> None:
        if await directory.claim("w-1", replica, now=100.0, until=115.0, force=False):
            taken.append(replica)

    async with trio.open_nursery() as nursery:
        for replica in "abcdefgh":
            nursery.start_soon(race, replica)
    assert len(taken) == 1
    assert (await directory.workers())[0].owner == taken[0]


class _Tunnel:
    """What the registry reads of a worker's tunnel: whether new streams may open on it."""

    def __init__(self) -> None:
        self.conn = self
        self.usable = True

    async def aclose(self) -> None:
        self.usable = False


async def test_a_late_renewal_does_not_lose_a_worker_to_a_replica_without_its_tunnel(
    directory: Directory,
) -> None:
    """The replica holding a worker's tunnel renews late (a loaded machine): another replica,
    with the worker's tasks but no tunnel, waits a lease more before it takes the worker, and
    the tunnel's replica takes it back at once; only a newer tunnel elsewhere moves it."""
    now = [100.0]
    a_opened, b_opened = (
        open_worker_registry(
            {"w-1": "tok-w-1-0123456789"},
            replication=Replication(directory, name, lease_s=3.0),
            clock=lambda: now[0],
        )
        for name in ("a", "b")
    )
    async with a_opened as a, b_opened as b:
        tunnel = _Tunnel()
        await a.attach_tunnel("w-1", tunnel)  # type: ignore[arg-type]
        assert a.owns("w-1")
        now[0] = 104.0  # A's claim lapsed at 103 without a renewal
        await b.sync(claim={"w-1"})
        assert not b.owns("w-1")  # A may be renewing late: it holds the tunnel
        now[0] = 106.5
        await b.sync(claim={"w-1"})
        assert b.owns("w-1")  # a lease past the lapse: A is taken for gone
        await a.sync()
        assert a.owns("w-1")  # the tunnel is on A: A takes it back
        await b.sync(claim={"w-1"})
        assert not b.owns("w-1")
        # The worker's next tunnel lands on B: A's old one no longer counts.
        await b.attach_tunnel("w-1", _Tunnel())  # type: ignore[arg-type]
        await a.sync()
        assert b.owns("w-1") and not a.owns("w-1")
