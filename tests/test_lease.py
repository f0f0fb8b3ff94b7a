"""Which controlplane replica reconciles a pool: the pure decisions of `control.kube.lease`, then
`LeaderElector`s on one Lease of the Kubernetes stand-in over TLS through the official client
(one leads; a graceful stop hands over at once; a leader that cannot renew stops before another
takes over, a lease duration after its last renewal; a stale update is a conflict, never a
second leader), and two controlplanes sharing one pool: one reconciles it, then the other,
and no worker is started twice.

Lease timings are 2 s / 1 s / 0.2 s: tests wait for what the electors do, never for a time."""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from kubernetes.client.exceptions import ApiException

from control.api.server import Controlplane
from control.cli.main import main as cli_main
from control.config import ConfigError, LeaderElectionSettings, parse
from control.kube.adapter import (
    KubeAlreadyExists,
    KubeClient,
    KubeConflict,
    KubeUnreachable,
    Operation,
    open_kube_client,
    translate_api_exception,
)
from control.kube.lease import (
    ElectionSettings,
    LeaderElector,
    LeaseRecord,
    Observation,
    Verdict,
    decide,
    format_micro_time,
    lease_name,
    observe,
    parse_micro_time,
)
from control.kube.pools import load_pools
from sim.cluster import OWN_NAMESPACE, controlplane_pod, grant_leases
from sim.configs import API_TOKEN, control_config, make_pki
from sim.controlplane import run_controlplane
from sim.kubeapi.store import KubeStandin
from sim.pools import gpu_node, jobs_created, pool_block
from tests.test_pool_reconcile import run_pods_of_jobs, until

pytest_plugins = ["tests.kube_fixtures"]

NS = "levers9-control"
LEASE = "levers9-pool-gpu"
LEASE_S = 2
WALL = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


# --- the pure part ---------------------------------------------------------------------------


def test_micro_times_keep_six_digits_and_read_back() -> None:
    assert format_micro_time(WALL) == "2030-01-02T03:04:05.000000Z"
    later = WALL.replace(microsecond=42).astimezone(UTC)
    assert parse_micro_time(format_micro_time(later)) == later
    assert parse_micro_time("2030-01-02T05:04:05.000001+02:00") == WALL.replace(microsecond=1)
    assert parse_micro_time("yesterday") is None
    assert parse_micro_time(None) is None


def test_a_record_reads_and_writes_the_lease_spec() -> None:
    record = LeaseRecord("replica-a", 15, WALL, WALL + timedelta(seconds=3), 4)
    spec = record.spec()
    assert spec == {
        "holderIdentity": "replica-a",
        "leaseDurationSeconds": 15,
        "acquireTime": "2030-01-02T03:04:05.000000Z",
        "renewTime": "2030-01-02T03:04:08.000000Z",
        "leaseTransitions": 4,
    }
    assert LeaseRecord.of_lease({"spec": spec}) == record
    # A released Lease, or one another program wrote badly, is free and readable.
    assert LeaseRecord.of_lease({"spec": {"holderIdentity": ""}}) == LeaseRecord()
    odd = {"spec": {"holderIdentity": 7, "leaseDurationSeconds": "15", "renewTime": "soon"}}
    assert LeaseRecord.of_lease(odd) == LeaseRecord()
    assert LeaseRecord.of_lease({}) == LeaseRecord()


def seen(record: LeaseRecord, at: float) -> Observation:
    return Observation(record, "7", at)


def test_no_lease_is_created_with_us_holding_it() -> None:
    decision = decide(None, "me", 100.0, WALL, 15)
    assert decision.verdict is Verdict.ACQUIRE
    assert decision.record == LeaseRecord("me", 15, WALL, WALL, 0)


def test_our_lease_is_renewed_keeping_when_we_took_it() -> None:
    taken = WALL - timedelta(minutes=5)
    ours = LeaseRecord("me", 15, taken, taken, 3)
    decision = decide(seen(ours, 0.0), "me", 1000.0, WALL, 15)
    assert decision.verdict is Verdict.RENEW
    assert decision.record == LeaseRecord("me", 15, taken, WALL, 3)


def test_anothers_lease_is_waited_for_by_our_clock_not_its_renew_time() -> None:
    # Its renewTime is a day behind our wall clock (its clock, or ours, is off): we saw it
    # change 14 s ago by our own clock, so it still holds.
    old = WALL - timedelta(days=1)
    theirs = LeaseRecord("them", 15, old, old, 2)
    assert decide(seen(theirs, 100.0), "me", 114.0, WALL, 15).verdict is Verdict.WAIT
    # Its renewTime is a day ahead: unchanged for 15 s by our clock, it has expired.
    ahead = WALL + timedelta(days=1)
    stale = LeaseRecord("them", 15, ahead, ahead, 2)
    decision = decide(seen(stale, 100.0), "me", 115.0, WALL, 15)
    assert decision.verdict is Verdict.ACQUIRE
    assert decision.record == LeaseRecord("me", 15, WALL, WALL, 3)


def test_a_free_lease_is_taken_at_once_and_the_records_duration_counts() -> None:
    free = LeaseRecord(None, 1, WALL, WALL, 5)
    decision = decide(seen(free, 100.0), "me", 100.0, WALL, 15)
    assert decision.verdict is Verdict.ACQUIRE
    assert decision.record is not None and decision.record.transitions == 6
    # A leader that set a short duration expires by it, whatever ours is.
    short = LeaseRecord("them", 1, WALL, WALL, 0)
    assert decide(seen(short, 100.0), "me", 100.5, WALL, 15).verdict is Verdict.WAIT
    assert decide(seen(short, 100.0), "me", 101.0, WALL, 15).verdict is Verdict.ACQUIRE
    # One that names none expires by ours.
    unnamed = LeaseRecord("them", 0, None, None, 0)
    assert decide(seen(unnamed, 100.0), "me", 114.0, WALL, 15).verdict is Verdict.WAIT


def test_an_unchanged_record_keeps_the_time_it_was_first_seen() -> None:
    record = LeaseRecord("them", 15, WALL, WALL, 0)
    first = observe(None, record, "1", 10.0)
    again = observe(first, record, "1", 20.0)
    assert again == Observation(record, "1", 10.0)
    renewed = attrs.evolve(record, renew_time=WALL + timedelta(seconds=2))
    assert observe(again, renewed, "2", 21.0) == Observation(renewed, "2", 21.0)


def test_lease_names_are_dns_labels() -> None:
    assert lease_name("gpu") == "levers9-pool-gpu"
    long = "a" * 63
    name = lease_name(long)
    assert len(name) <= 63 and name.startswith("levers9-pool-aaa")
    assert name != lease_name("a" * 62 + "b")
    assert lease_name("GPU_x") != lease_name("gpu-x")
    assert all(c.islower() or c.isdigit() or c == "-" for c in lease_name("GPU_x"))


def test_election_settings_keep_client_gos_order() -> None:
    ElectionSettings("me", NS, LEASE, lease_duration_s=2, renew_deadline_s=1, retry_period_s=0.2)
    with pytest.raises(ValueError, match="retry_period_s < renew_deadline_s < lease_duration_s"):
        ElectionSettings("me", NS, LEASE, lease_duration_s=2, renew_deadline_s=2)


def config_with(election: Mapping[str, Any]) -> Any:
    return parse(
        {
            "config": {
                "publicUrl": "https://levers9.example.test",
                "tls": {"certFile": "c", "keyFile": "k"},
                "leaderElection": dict(election),
            }
        }
    )


def test_config_defaults_and_refusals_name_the_field() -> None:
    assert config_with({}).leader_election == LeaderElectionSettings()
    assert LeaderElectionSettings() == LeaderElectionSettings(
        enabled=False, lease_duration_s=15, renew_deadline_s=10, retry_period_s=2
    )
    on = config_with({"enabled": True, "leaseDurationS": 3, "renewDeadlineS": 2.5})
    assert on.leader_election.enabled and on.leader_election.renew_deadline_s == 2.5
    for election, message in (
        ({"renewDeadlineS": 15}, "config.leaderElection.renewDeadlineS must be less than "),
        ({"retryPeriodS": 10}, "config.leaderElection.retryPeriodS must be less than "),
        ({"leaseDurationS": 12.5}, "config.leaderElection.leaseDurationS must be a whole"),
        ({"retryPeriodS": 0}, "config.leaderElection.retryPeriodS must be a number of seconds"),
        ({"identity": " "}, "config.leaderElection.identity is empty"),
        ({"leaseSeconds": 3}, "config.leaderElection: extra fields found (leaseSeconds)"),
    ):
        with pytest.raises(ConfigError) as refused:
            config_with(election)
        assert message in str(refused.value)


def test_a_409_on_an_update_is_a_conflict_and_on_a_create_already_exists() -> None:
    exc = ApiException(status=409, reason="Conflict")
    update = Operation("update", "leases", "coordination.k8s.io", NS, LEASE)
    conflict = translate_api_exception(exc, update, pool="gpu")
    assert isinstance(conflict, KubeConflict) and conflict.status == 409
    assert "cannot update leases.coordination.k8s.io 'levers9-pool-gpu'" in conflict.message
    create = attrs.evolve(update, verb="create")
    assert isinstance(translate_api_exception(exc, create, pool="gpu"), KubeAlreadyExists)


# --- electors on the stand-in ----------------------------------------------------------------


@asynccontextmanager
async def lease_client(kube: KubeStandin) -> AsyncIterator[KubeClient]:
    """The stand-in's API with the admin token, its namespace for Leases made."""
    kube.add_namespace(NS)
    pool = load_pools([pool_block(kube)]).pools[0]
    async with open_kube_client(pool) as client:
        yield client


def settings(identity: str) -> ElectionSettings:
    return ElectionSettings(
        identity, NS, LEASE, lease_duration_s=LEASE_S, renew_deadline_s=1.0, retry_period_s=0.2
    )


@attrs.define
class Leaders:
    """What the electors' `lead()` saw: who leads now, and every start and stop in order."""

    now: list[str] = attrs.Factory(list)
    log: list[tuple[str, str]] = attrs.Factory(list)
    most: int = 0

    def lead(self, who: str) -> Callable[[], Awaitable[None]]:
        async def lead() -> None:
            self.now.append(who)
            self.most = max(self.most, len(self.now))
            self.log.append(("start", who))
            try:
                await trio.sleep_forever()
            finally:
                self.now.remove(who)
                self.log.append(("stop", who))

        return lead


@attrs.define
class Wrapped:
    """A `LeaseApi` in front of the real one: records each write that went through (when it
    began, what it sent), can be cut off (every call fails as if the API server were gone),
    and can hold writes until `reads_before_writes` reads were answered (a race on one
    version)."""

    api: KubeClient
    cut: bool = False
    reads: int = 0
    reads_before_writes: int = 0
    writes: list[tuple[float, dict[str, Any]]] = attrs.Factory(list)
    _read_enough: trio.Event = attrs.Factory(trio.Event)

    def _check(self) -> None:
        if self.cut:
            raise KubeUnreachable("pool gpu: cut off by the test", failure="OSError")

    async def read_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._check()
        found = await self.api.read_lease(namespace, name)
        self.reads += 1
        if self.reads >= self.reads_before_writes:
            self._read_enough.set()
        return found

    async def _write(
        self,
        write: Callable[[str, Mapping[str, Any]], Awaitable[dict[str, Any]]],
        namespace: str,
        manifest: Mapping[str, Any],
    ) -> dict[str, Any]:
        """A write; recorded (when it began, what it sent) once it went through."""
        await self._read_enough.wait()
        self._check()
        began = trio.current_time()
        written = await write(namespace, manifest)
        self.writes.append((began, dict(manifest)))
        return written

    async def create_lease(self, namespace: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
        return await self._write(self.api.create_lease, namespace, manifest)

    async def replace_lease(self, namespace: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
        return await self._write(self.api.replace_lease, namespace, manifest)


@attrs.define
class Running:
    elector: LeaderElector
    scope: trio.CancelScope
    done: trio.Event

    async def stop(self) -> None:
        self.scope.cancel()
        await self.done.wait()


def start(nursery: trio.Nursery, elector: LeaderElector, leaders: Leaders) -> Running:
    running = Running(elector, trio.CancelScope(), trio.Event())

    async def go() -> None:
        try:
            with running.scope:
                await elector.run(leaders.lead(elector.settings.identity))
        finally:
            running.done.set()

    nursery.start_soon(go)
    return running


async def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Until `condition()` holds (the electors' work, and the stand-in's threads, make it)."""
    with trio.fail_after(timeout_s):
        for _ in itertools.count():
            if condition():
                return
            await trio.sleep(0.01)


def holder(kube: KubeStandin) -> str | None:
    lease = kube.get("leases", LEASE, NS)
    return None if lease is None else str(lease["spec"].get("holderIdentity"))


def lease_puts(kube: KubeStandin, status: int | None = None) -> int:
    path = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{LEASE}"
    return sum(
        1
        for r in kube.requests
        if r.verb == "update" and r.path == path and (status is None or r.status == status)
    )


async def test_of_two_electors_exactly_one_leads_and_the_other_knows_who(
    kube: KubeStandin, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="levers9.lease")
    leaders = Leaders()
    async with lease_client(kube) as api, trio.open_nursery() as nursery:
        a = start(nursery, LeaderElector(api, settings("replica-a"), pool="gpu"), leaders)
        b = start(nursery, LeaderElector(api, settings("replica-b"), pool="gpu"), leaders)
        await wait_for(lambda: len(leaders.now) == 1 and a.elector.holder == b.elector.holder)
        (leader,) = leaders.now
        # Several renewals later it still leads alone.
        renewed = lease_puts(kube, 200)
        await wait_for(lambda: lease_puts(kube, 200) >= renewed + 5)
        assert leaders.log == [("start", leader)] and leaders.most == 1
        assert holder(kube) == leader
        assert [e.is_leader for e in (a.elector, b.elector)].count(True) == 1
        nursery.cancel_scope.cancel()
    changes = [r for r in caplog.records if r.name == "levers9.lease" and hasattr(r, "holder")]
    # Each elector logged who leads once, with the pool and holder as fields.
    leads = [(vars(r)["identity"], vars(r)["holder"]) for r in changes if "leads" in r.getMessage()]
    assert sorted(leads) == sorted([("replica-a", leader), ("replica-b", leader)])
    assert all(vars(r)["pool"] == "gpu" for r in changes)


async def test_a_graceful_stop_releases_the_lease_and_the_other_takes_over(
    kube: KubeStandin,
) -> None:
    leaders = Leaders()
    async with lease_client(kube) as api, trio.open_nursery() as nursery:
        first = Wrapped(api)
        a = start(nursery, LeaderElector(first, settings("replica-a"), pool="gpu"), leaders)
        await wait_for(lambda: leaders.now == ["replica-a"])
        b = start(nursery, LeaderElector(api, settings("replica-b"), pool="gpu"), leaders)
        await wait_for(lambda: b.elector.holder == "replica-a")

        await a.stop()
        # Its last write let go: no holder, one second, the transitions kept.
        released = first.writes[-1][1]["spec"]
        assert released["holderIdentity"] == "" and released["leaseDurationSeconds"] == 1
        assert released["leaseTransitions"] == 0
        await wait_for(lambda: leaders.now == ["replica-b"])
        assert leaders.log == [
            ("start", "replica-a"),
            ("stop", "replica-a"),
            ("start", "replica-b"),
        ]
        lease = kube.get("leases", LEASE, NS)
        assert lease is not None
        assert lease["spec"]["holderIdentity"] == "replica-b"
        assert lease["spec"]["leaseTransitions"] == 1
        assert not a.elector.is_leader and b.elector.is_leader
        nursery.cancel_scope.cancel()
    assert holder(kube) == ""  # replica-b let go as well


async def test_a_leader_that_cannot_renew_stops_before_the_other_takes_over(
    kube: KubeStandin,
) -> None:
    leaders = Leaders()
    async with lease_client(kube) as api, trio.open_nursery() as nursery:
        first, second = Wrapped(api), Wrapped(api)
        a = start(nursery, LeaderElector(first, settings("replica-a"), pool="gpu"), leaders)
        await wait_for(lambda: leaders.now == ["replica-a"])
        b = start(nursery, LeaderElector(second, settings("replica-b"), pool="gpu"), leaders)
        await wait_for(lambda: b.elector.holder == "replica-a")

        # replica-a loses the API server: it cannot renew, nor release.
        first.cut = True
        await wait_for(lambda: leaders.now == ["replica-b"])
        assert leaders.log == [
            ("start", "replica-a"),
            ("stop", "replica-a"),  # its renew deadline passed first
            ("start", "replica-b"),
        ]
        assert a.elector.holder is None and not a.elector.is_leader
        # replica-b took the Lease no sooner than a lease duration after the last renewal that
        # went through (when each write began, on this process's clock): a lower bound only.
        last_renewal = first.writes[-1][0]
        (taken, manifest), *_ = second.writes
        assert manifest["spec"]["holderIdentity"] == "replica-b"
        assert taken - last_renewal >= LEASE_S
        nursery.cancel_scope.cancel()
    assert holder(kube) == ""


async def test_a_stale_update_is_a_conflict_and_a_race_makes_one_leader(
    kube: KubeStandin,
) -> None:
    async with lease_client(kube) as api:
        free = LeaseRecord(None, 1, WALL, WALL, 0).spec()
        await api.create_lease(
            NS,
            {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": LEASE},
                "spec": free,
            },
        )
        read = await api.read_lease(NS, LEASE)
        assert read is not None
        mine = {**read, "spec": {**free, "holderIdentity": "replica-a"}}
        theirs = {**read, "spec": {**free, "holderIdentity": "replica-b"}}
        await api.replace_lease(NS, mine)
        with pytest.raises(KubeConflict) as stale:
            await api.replace_lease(NS, theirs)
        assert "was changed meanwhile" in stale.value.message
        assert holder(kube) == "replica-a"
        await api.replace_lease(NS, {**read, "metadata": {"name": LEASE}, "spec": free})

        # Both electors read the free Lease at the same version before either writes.
        leaders = Leaders()
        gated = Wrapped(api, reads_before_writes=2)
        async with trio.open_nursery() as nursery:
            a = start(nursery, LeaderElector(gated, settings("replica-a"), pool="gpu"), leaders)
            b = start(nursery, LeaderElector(gated, settings("replica-b"), pool="gpu"), leaders)
            await wait_for(lambda: len(leaders.now) == 1 and a.elector.holder == b.elector.holder)
            assert lease_puts(kube, 409) == 2  # the test's stale update, and the race's loser
            renewed = lease_puts(kube, 200)
            await wait_for(lambda: lease_puts(kube, 200) >= renewed + 3)
            assert leaders.most == 1 and len(leaders.log) == 1
            nursery.cancel_scope.cancel()


# --- two controlplanes ------------------------------------------------------------------------


@pytest.fixture
def in_pod(kube: KubeStandin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The controlplanes run as if in pods of the stand-in cluster, their ServiceAccount
    allowed what the chart grants for leader election (leases: get, create, update)."""
    directory = tmp_path / "serviceaccount"
    for key, value in controlplane_pod(kube, directory).items():
        monkeypatch.setenv(key, value)
    grant_leases(kube)
    return directory


@attrs.define
class Replica:
    control: Controlplane
    scope: trio.CancelScope
    done: trio.Event
    ca_file: Path

    async def stop(self) -> None:
        self.scope.cancel()
        await self.done.wait()


async def replica(nursery: trio.Nursery, kube: KubeStandin, directory: Path) -> Replica:
    """A controlplane of its own (its own task database), leader election on, pool `gpu`."""
    directory.mkdir()
    pki = make_pki(directory)
    config = control_config(pki)
    config = attrs.evolve(
        config,
        worker=attrs.evolve(config.worker, pools=(pool_block(kube),)),
        leader_election=LeaderElectionSettings(
            enabled=True, lease_duration_s=LEASE_S, renew_deadline_s=1.0, retry_period_s=0.2
        ),
    )
    scope, done = trio.CancelScope(), trio.Event()

    async def serve(*, task_status: trio.TaskStatus[Controlplane]) -> None:
        try:
            with scope:
                await run_controlplane(config, task_status=task_status)
        finally:
            done.set()

    control: Controlplane = await nursery.start(serve)
    return Replica(control, scope, done, pki.ca_file)


async def test_two_controlplanes_share_a_pool_and_hand_it_over(
    kube: KubeStandin,
    tmp_path: Path,
    in_pod: Path,
    nursery: trio.Nursery,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_pods_of_jobs(kube)
    kube.add_node(gpu_node("node-1"))
    kube.add_node(gpu_node("node-2"))
    one = await replica(nursery, kube, tmp_path / "one")
    two = await replica(nursery, kube, tmp_path / "two")
    assert one.control.identity != two.control.identity
    replicas = (one, two)
    await wait_for(lambda: sum(bool(r.control.runner.pools) for r in replicas) == 1)
    leader, other = replicas if one.control.runner.pools else replicas[::-1]
    (reconciling,) = leader.control.runner.pools
    await until(reconciling, lambda: len(kube.jobs()) == 2)
    await reconciling.reconcile_once()
    # Exactly one Job per node, from the one replica that reconciles the pool.
    assert jobs_created(kube) == 2
    assert other.control.runner.pools == []
    # The standby names the leader once its elector has read the Lease (its first try may
    # still be under way when the leader's first pass is done).
    await wait_for(lambda: other.control.runner.pool_views()[0].leader == leader.control.identity)
    (view,) = other.control.runner.pool_views()
    assert view.machines == 0
    lease = kube.get("leases", LEASE, OWN_NAMESPACE)
    assert lease is not None and lease["spec"]["holderIdentity"] == leader.control.identity

    # `levers9 cluster list` on the other replica says who reconciles the pool.
    args = ["--controlplane", f"https://127.0.0.1:{other.control.port}", "--token", API_TOKEN]
    args += ["--ca", str(other.ca_file), "cluster", "list"]
    assert await trio.to_thread.run_sync(cli_main, args) == 0
    header, row = capsys.readouterr().out.splitlines()
    leader_at = header.split().index("LEADER")
    assert row.split()[leader_at] == leader.control.identity

    # The leader stops (a rolling update): the other takes the pool over and starts nothing
    # twice, its workers adopted from the Jobs and their token Secrets.
    await leader.stop()
    await wait_for(lambda: bool(other.control.runner.pools))
    (taken_over,) = other.control.runner.pools
    await until(
        taken_over,
        lambda: (
            len(taken_over.status.machines) == 2
            and all(m.worker is not None for m in taken_over.status.machines)
        ),
    )
    await taken_over.reconcile_once()
    await taken_over.reconcile_once()
    assert jobs_created(kube) == 2 and len(kube.jobs()) == 2
    (view,) = other.control.runner.pool_views()
    assert view.leader == other.control.identity and view.machines == 2

    # A pool removed from the config has its workers removed and its Lease released.
    await other.control.runner.set_pools([])
    assert kube.jobs() == []
    lease = kube.get("leases", LEASE, OWN_NAMESPACE)
    assert lease is not None and lease["spec"]["holderIdentity"] == ""
    await other.stop()


async def test_leader_election_outside_a_pod_is_refused_naming_the_field(
    kube: KubeStandin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    (tmp_path / "one").mkdir()
    config = control_config(make_pki(tmp_path / "one"))
    config = attrs.evolve(
        config,
        worker=attrs.evolve(config.worker, pools=(pool_block(kube),)),
        leader_election=LeaderElectionSettings(enabled=True),
    )
    refused: list[BaseException] = []
    with trio.fail_after(20):
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(run_controlplane, config)
        except* ConfigError as group:
            refused = flatten(group)
    (error,) = refused
    assert str(error).startswith("config.leaderElection: the controlplane is not running in a pod")


def flatten(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    return [
        leaf
        for exc in group.exceptions
        for leaf in (flatten(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    ]
