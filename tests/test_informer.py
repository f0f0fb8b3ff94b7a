"""The sans-IO parts of a cache: a watch stream's bytes decoded into events, the store those
events, lists and narrower lists change, the decisions on watches that do not stream
(`WatchHealth`, time passed in), and the informer's loop over a scripted cluster, on trio's
mock clock where time matters. No sockets."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from control.kube.adapter import Collection, KubeError, KubeExpired, Page
from control.kube.informer import (
    EMPTY_WATCHES,
    SILENT,
    Change,
    Informer,
    Store,
    Verdict,
    WatchDecoder,
    WatchEvent,
    WatchHealth,
)
from wire.errors import ErrorCode


def pod(name: str, node: str, version: int, phase: str = "Running") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default", "resourceVersion": str(version)},
        "spec": {"nodeName": node},
        "status": {"phase": phase},
    }


def node_of(obj: dict[str, Any]) -> str:
    return str(obj["spec"]["nodeName"])


def line(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


def test_events_are_decoded_whatever_the_chunks() -> None:
    stream = line("ADDED", pod("a", "n1", 5)) + line("MODIFIED", pod("a", "n2", 6))
    stream += line("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": "9"}})
    whole = WatchDecoder(node_of, "pods").feed(stream)
    decoder = WatchDecoder(node_of, "pods")
    bytewise = [event for i in range(len(stream)) for event in decoder.feed(stream[i : i + 1])]
    assert (
        whole
        == bytewise
        == [
            WatchEvent("ADDED", "default/a", "5", "n1"),
            WatchEvent("MODIFIED", "default/a", "6", "n2"),
            WatchEvent("BOOKMARK", "", "9", None),
        ]
    )


def test_an_expired_version_ends_the_stream_with_kube_expired() -> None:
    status = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old: 3"}
    with pytest.raises(KubeExpired, match="too old"):
        WatchDecoder(node_of, "pods").feed(line("ERROR", status))
    status = {"kind": "Status", "code": 500, "message": "etcd is sad"}
    with pytest.raises(KubeError, match="500: etcd is sad") as failed:
        WatchDecoder(node_of, "pods").feed(line("ERROR", status))
    assert not isinstance(failed.value, KubeExpired)
    with pytest.raises(KubeError, match="not a watch event"):
        WatchDecoder(node_of, "pods").feed(b"<html>proxy error</html>\n")


def test_a_list_replaces_the_store_and_tells_only_what_differs() -> None:
    store: Store[str] = Store()
    assert store.replace({"a": "n1", "b": "n2"}, "10") == [
        Change("a", None, "n1"),
        Change("b", None, "n2"),
    ]
    changes = store.replace({"a": "n1", "b": "n3", "c": "n1"}, "20")
    assert sorted(changes, key=lambda c: c.key) == [
        Change("b", "n2", "n3"),
        Change("c", None, "n1"),
    ]
    assert store.replace({"c": "n1"}, "30") == [Change("a", "n1", None), Change("b", "n3", None)]
    assert store.resource_version == "30"


def test_watch_events_change_the_store_and_equal_facts_are_no_change() -> None:
    store: Store[str] = Store()
    store.replace({}, "1")
    assert store.apply(WatchEvent("ADDED", "a", "2", "n1")) == Change("a", None, "n1")
    assert store.apply(WatchEvent("MODIFIED", "a", "3", "n1")) is None
    assert store.apply(WatchEvent("BOOKMARK", "", "7", None)) is None
    assert store.resource_version == "7"
    assert store.apply(WatchEvent("DELETED", "a", "8", "n1")) == Change("a", "n1", None)
    assert store.apply(WatchEvent("DELETED", "a", "9", "n1")) is None
    assert store.items == {} and store.resource_version == "9"


def test_a_store_keeps_only_its_subset_and_drops_what_leaves_it() -> None:
    wanted = {"n1"}
    store: Store[str] = Store(keep=lambda node: node in wanted)
    store.replace({"a": "n1", "b": "n2"}, "1")
    assert store.items == {"a": "n1"}
    # An object moving out of the subset is gone from the store.
    assert store.apply(WatchEvent("MODIFIED", "a", "2", "n2")) == Change("a", "n1", None)
    assert store.apply(WatchEvent("ADDED", "c", "3", "n1")) == Change("c", None, "n1")
    wanted.discard("n1")
    assert store.drop(lambda node: node not in wanted) == [Change("c", "n1", None)]


def test_a_fill_never_brings_back_what_the_watch_deleted_meanwhile() -> None:
    wanted = {"n1"}
    store: Store[str] = Store(keep=lambda node: node in wanted)
    store.replace({}, "1")
    wanted.add("n2")
    store.begin_fill()
    # While the narrower list runs, the watch deletes one pod and updates another.
    store.apply(WatchEvent("ADDED", "x", "2", "n2"))
    store.apply(WatchEvent("DELETED", "x", "3", "n2"))
    store.apply(WatchEvent("MODIFIED", "y", "4", "n2"))
    listed = {"x": "n2", "y": "n2", "z": "n2", "elsewhere": "n9"}
    assert store.end_fill(listed) == [Change("z", None, "n2")]
    assert store.items == {"y": "n2", "z": "n2"}
    # Once no fill runs, a deletion is remembered no longer.
    store.begin_fill()
    assert store.end_fill({"x": "n2"}) == [Change("x", None, "n2")]


class FakeWatch:
    """A watch response whose bytes are given up front; `read` ends it after them.
    `on_read` is called at each read (in the reader's thread)."""

    def __init__(self, chunks: list[bytes], on_read: Callable[[], None] | None = None) -> None:
        self.chunks = chunks
        self.on_read = on_read
        self.closed = False

    def read(self) -> bytes:
        if self.on_read is not None:
            self.on_read()
        return self.chunks.pop(0) if self.chunks else b""

    def shutdown(self) -> None:
        self.closed = True

    def close(self) -> None:
        self.closed = True


class SilentWatch(FakeWatch):
    """A watch that stays open and sends nothing (a proxy holding the stream back): `read`
    waits until the connection is shut down."""

    def __init__(self) -> None:
        super().__init__([])
        self._shut = threading.Event()

    def read(self) -> bytes:
        # Bounded in real time, so a broken informer cannot leave the thread behind.
        assert self._shut.wait(timeout=30), "the silent watch was never shut down"
        return b""

    def shutdown(self) -> None:
        self.closed = True
        self._shut.set()


class BookmarkWatch(FakeWatch):
    """A healthy watch of a quiet collection: a BOOKMARK every `period_s` (trio's clock, so
    the mock clock's), then the server's normal end after `count` of them."""

    def __init__(self, period_s: float, count: int) -> None:
        super().__init__([])
        self.period_s = period_s
        self.count = count

    def read(self) -> bytes:
        if not self.count:
            return b""
        self.count -= 1
        trio.from_thread.run(trio.sleep, self.period_s)
        return bookmark_line(100 - self.count)


def bookmark_line(version: int) -> bytes:
    return line("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": str(version)}})


class FakeCluster:
    """Pages and watches scripted per call, so the informer's loop runs without a server.
    `calls` is the order of lists and watches with trio's time at each; when `informer` is set,
    `errors_at_watch` is its error as each watch was asked for."""

    def __init__(self, pages: list[Any], watches: list[Any]) -> None:
        self.pages = pages
        self.watches = watches
        self.watched_from: list[str] = []
        self.calls: list[tuple[str, float]] = []
        self.informer: Informer[str] | None = None
        self.errors_at_watch: list[KubeError | None] = []
        self.idle = trio.Event()
        """Set once the script is played: the informer waits on its last watch."""

    async def list_page(self, collection: Any, facts: Any, *, continue_token: Any = None) -> Any:
        self.calls.append(("list", trio.current_time()))
        page = self.pages.pop(0)
        if isinstance(page, Exception):
            raise page
        return page

    async def watch(self, collection: Any, resource_version: str, *, timeout_s: int) -> Any:
        self.calls.append(("watch", trio.current_time()))
        self.watched_from.append(resource_version)
        if self.informer is not None:
            self.errors_at_watch.append(self.informer.error)
        watch = self.watches.pop(0)
        if isinstance(watch, Exception):
            raise watch
        if watch is None:
            self.idle.set()
            await trio.sleep_forever()
        return watch

    def order(self) -> str:
        """The calls as letters: L a list, W a watch."""
        return "".join("L" if kind == "list" else "W" for kind, _ in self.calls)


async def test_an_expired_continue_token_lists_from_the_start_again() -> None:
    cluster = FakeCluster(
        pages=[
            Page({"a": "n1"}, "10", "page-2"),
            KubeExpired("pool p: cannot list pods: its version has expired"),
            Page({"a": "n1"}, "20", "page-2"),
            Page({"b": "n2"}, "20", None),
        ],
        watches=[None],
    )
    informer: Informer[str] = Informer(cluster, Collection("pods"), node_of, label="p")
    async with trio.open_nursery() as nursery:
        await nursery.start(informer.run)
        with trio.fail_after(5):
            await informer.synced.wait()
        nursery.cancel_scope.cancel()
    assert informer.items == {"a": "n1", "b": "n2"}
    assert (informer.lists, informer.store.resource_version) == (1, "20")
    assert cluster.watched_from == ["20"]


async def test_a_watch_resumes_from_its_last_version_and_lists_again_only_on_410() -> None:
    expired = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
    bookmark = {"kind": "Pod", "metadata": {"resourceVersion": "15"}}
    cluster = FakeCluster(
        pages=[Page({"a": "n1"}, "10", None), Page({"b": "n2"}, "30", None)],
        watches=[
            FakeWatch([line("ADDED", pod("c", "n1", 12)), line("BOOKMARK", bookmark)]),
            FakeWatch([line("ERROR", expired)]),
            None,
        ],
    )
    informer: Informer[str] = Informer(cluster, Collection("pods"), node_of, label="p")
    seen: list[Change[str]] = []
    informer.subscribe(seen.extend)
    async with trio.open_nursery() as nursery:
        await nursery.start(informer.run)
        with trio.fail_after(5):
            await cluster.idle.wait()
        nursery.cancel_scope.cancel()
    # The first watch ended: the next one resumed from the bookmark's version, no list; its
    # 410 made the one new list, and the watch after it starts from that list's version.
    assert cluster.watched_from == ["10", "15", "30"]
    assert informer.lists == 2
    assert informer.items == {"b": "n2"}
    assert seen == [
        Change("a", None, "n1"),
        Change("default/c", None, "n1"),
        Change("b", None, "n2"),
        Change("a", "n1", None),
        Change("default/c", "n1", None),
    ]


# -- watches that do not stream: the decisions (time passed in) ---------------------------------

PERIOD_S = 60.0


def test_a_watch_is_silent_two_bookmark_periods_after_it_last_heard_something() -> None:
    health = WatchHealth(PERIOD_S)
    health.opened(1000.0)
    assert health.deadline() == 1000.0 + 2 * PERIOD_S
    # Each event or bookmark puts it off; a healthy watch (a bookmark a period) never gets there.
    for heard_at in (1060.0, 1120.0, 1180.0):
        health.heard(heard_at)
        assert health.deadline() == heard_at + 2 * PERIOD_S
    assert health.ended(1200.0, heard=True) == Verdict(reset_backoff=True)
    assert not health.unusable and health.stale_relists == 0


def test_three_watches_ending_at_once_empty_list_again_and_six_make_it_unusable() -> None:
    health = WatchHealth(PERIOD_S)
    now = 0.0
    verdicts = []
    for _ in range(7):
        health.opened(now)
        verdicts.append(health.ended(now + 0.01, heard=False))
        now += 5.0
    failure = Verdict(back_off=True)
    assert verdicts[0] == verdicts[1] == failure
    assert verdicts[2] == Verdict(
        relist=EMPTY_WATCHES,
        back_off=True,
        reset_backoff=True,
        seen="every watch ended at once with nothing in it, 3 in a row",
        warn=True,
    )
    assert verdicts[3] == verdicts[4] == failure
    # The second list made again with no watch streaming in between: unusable, warned already,
    # and from now on backed off to the cap.
    assert verdicts[5] == Verdict(
        relist=EMPTY_WATCHES,
        back_off=True,
        seen="every watch ended at once with nothing in it, 6 in a row",
        unusable=True,
    )
    assert verdicts[6] == failure and health.unusable
    # Only a watch that streams ends it (and says so).
    health.opened(now)
    assert health.heard(now + 0.5) is True
    assert not health.unusable and health.heard(now + 1.0) is False
    assert (health.stale_relists, health.empty_in_row) == (0, 0)


def test_silent_watches_list_again_and_the_second_makes_it_unusable() -> None:
    health = WatchHealth(PERIOD_S)
    health.opened(0.0)
    health.heard(10.0)
    health.opened(300.0)  # a new watch after a normal end: its silence counts from its opening
    assert health.deadline() == 300.0 + 2 * PERIOD_S
    first = health.silent(420.0)
    assert first == Verdict(
        relist=SILENT, reset_backoff=True, seen="no event or bookmark for 410 s", warn=True
    )
    health.opened(421.0)
    second = health.silent(541.0)
    assert (second.relist, second.unusable, second.warn) == (SILENT, True, False)
    assert second.seen == "no event or bookmark for 531 s"
    # Unusable already: a third is no new episode.
    health.opened(542.0)
    assert health.silent(662.0) == Verdict(relist=SILENT, seen="no event or bookmark for 652 s")


def test_either_cause_counts_towards_unusable_and_a_normal_end_breaks_a_row() -> None:
    health = WatchHealth(PERIOD_S)
    for start in (0.0, 1.0):
        health.opened(start)
        health.ended(start + 0.1, heard=False)
    # A watch the server ended after a while, quiet: a normal end, the row starts again.
    health.opened(2.0)
    assert health.ended(200.0, heard=False) == Verdict(reset_backoff=True)
    assert health.empty_in_row == 0
    health.opened(201.0)
    assert health.silent(321.0).relist == SILENT
    for start in (322.0, 323.0, 324.0):
        health.opened(start)
        verdict = health.ended(start + 0.1, heard=False)
    assert (verdict.relist, verdict.unusable) == (EMPTY_WATCHES, True)


# -- watches that do not stream: the informer's loop on the mock clock -------------------------


@pytest.fixture
def clock(mock_clock: trio.testing.MockClock) -> trio.testing.MockClock:
    """trio's clock jumps to the next deadline once every task has waited a moment of real
    time: the informer's reads run in a thread, and a jump while one is running would make a
    quick read look slow."""
    mock_clock.autojump_threshold = 0.1
    return mock_clock


async def run_until_idle(informer: Informer[str], cluster: FakeCluster) -> None:
    cluster.informer = informer
    async with trio.open_nursery() as nursery:
        await nursery.start(informer.run)
        with trio.fail_after(3600):
            await cluster.idle.wait()
        nursery.cancel_scope.cancel()


def unusable_message(what: str) -> str:
    return (
        "pool p: the pods cache is out of step, its watches do not stream "
        f"({what}); a proxy or load balancer in front of the API server may end long "
        "requests; let watches through for at least 10 minutes"
    )


async def test_watches_ending_at_once_list_again_then_make_the_cache_unusable(
    clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    errors_at_read: list[KubeError | None] = []

    def note_error() -> None:
        errors_at_read.append(informer.error)

    refused = KubeError(ErrorCode.UNAVAILABLE, "pool p: cannot watch pods: 503")
    cluster = FakeCluster(
        pages=[Page({"a": "n1"}, str(v), None) for v in (10, 20, 30)],
        watches=[
            *[FakeWatch([]) for _ in range(6)],
            refused,
            FakeWatch([], on_read=note_error),
            FakeWatch([bookmark_line(31)], on_read=note_error),
            None,
        ],
    )
    told: list[tuple[str, str]] = []
    informer: Informer[str] = Informer(
        cluster,
        Collection("pods"),
        node_of,
        label="p",
        bookmark_period_s=PERIOD_S,
        on_event=lambda cache, what: told.append((cache, what)),
    )
    with caplog.at_level(logging.INFO, logger="levers9.cache"):
        await run_until_idle(informer, cluster)
    # A list again after each third empty watch, not waiting for the silence bound.
    assert cluster.order() == "LWWWLWWWL" + "WWWW"
    assert informer.lists == 3 and informer.stale_relists == 2
    assert informer.relists == {"expired": 0, "silent": 0, "empty_watches": 2}
    assert informer.unusable_count == 1
    assert told == [("pods", "empty_watches"), ("pods", "empty_watches"), ("pods", "unusable")]
    unusable = unusable_message("every watch ended at once with nothing in it, 6 in a row")
    # An ordinary failure shows while it lasts; a watch opening ends it, not the unusable
    # cache's error (kept while that watch ends empty, and while the next opens); the
    # bookmark ends that.
    assert [e.message if e else None for e in cluster.errors_at_watch[6:]] == [
        unusable,
        refused.message,
        unusable,
        None,
    ]
    assert [e.message if e else None for e in errors_at_read] == [unusable, unusable, None]
    assert informer.error is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "p: the pods cache is not kept by its watch (every watch ended at once with nothing "
        "in it, 3 in a row); listing it again; a proxy or load balancer in front of the API "
        "server may end long requests; let watches through for at least 10 minutes"
    ]
    assert any("back in step" in r.getMessage() for r in caplog.records)


async def test_a_silent_watch_is_ended_and_listed_again_within_two_bookmark_periods(
    clock: trio.testing.MockClock,
) -> None:
    errors_at_read: list[KubeError | None] = []

    def note_error() -> None:
        errors_at_read.append(informer.error)

    silent = [SilentWatch(), SilentWatch()]
    cluster = FakeCluster(
        pages=[Page({"a": "n1"}, str(v), None) for v in (10, 20, 30)],
        watches=[*silent, FakeWatch([bookmark_line(31)], on_read=note_error), None],
    )
    informer: Informer[str] = Informer(
        cluster, Collection("pods"), node_of, label="p", bookmark_period_s=PERIOD_S
    )
    await run_until_idle(informer, cluster)
    assert cluster.order() == "LWLWLW" + "W"
    (_, opened), (_, relisted) = cluster.calls[1:3]
    assert relisted - opened == pytest.approx(2 * PERIOD_S)
    # Each silent read was ended by shutting its connection down.
    assert all(watch.closed for watch in silent)
    assert informer.relists == {"expired": 0, "silent": 2, "empty_watches": 0}
    assert informer.unusable_count == 1
    assert [e.message if e else None for e in errors_at_read] == [
        unusable_message("no event or bookmark for 240 s"),
        None,
    ]
    assert informer.error is None


async def test_a_watch_with_a_bookmark_each_period_never_lists_again(
    clock: trio.testing.MockClock,
) -> None:
    cluster = FakeCluster(
        pages=[Page({"a": "n1"}, "10", None)],
        watches=[BookmarkWatch(PERIOD_S, 6), BookmarkWatch(PERIOD_S, 6), None],
    )
    informer: Informer[str] = Informer(
        cluster, Collection("pods"), node_of, label="p", bookmark_period_s=PERIOD_S
    )
    await run_until_idle(informer, cluster)
    assert cluster.order() == "LWWW"
    # Twelve periods of bookmarks, and the server's normal end between them.
    assert trio.current_time() - cluster.calls[1][1] == pytest.approx(12 * PERIOD_S)
    assert cluster.watched_from == ["10", "100", "100"]
    assert (informer.lists, informer.stale_relists, informer.unusable_count) == (1, 0, 0)
    assert informer.error is None
