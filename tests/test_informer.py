"""The sans-IO parts of a cache: a watch stream's bytes decoded into events, and the store
those events, lists and narrower lists change, and the informer's loop over a scripted
cluster. No sockets."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from control.kube.adapter import Collection, KubeError, KubeExpired, Page
from control.kube.informer import Change, Informer, Store, WatchDecoder, WatchEvent


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
    """A watch response whose bytes are given up front; `read` ends it after them."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.closed = False

    def read(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""

    def shutdown(self) -> None:
        self.closed = True

    def close(self) -> None:
        self.closed = True


class FakeCluster:
    """Pages and watches scripted per call, so the informer's loop runs without a server."""

    def __init__(self, pages: list[Any], watches: list[Any]) -> None:
        self.pages = pages
        self.watches = watches
        self.watched_from: list[str] = []
        self.idle = trio.Event()
        """Set once the script is played: the informer waits on its last watch."""

    async def list_page(self, collection: Any, facts: Any, *, continue_token: Any = None) -> Any:
        page = self.pages.pop(0)
        if isinstance(page, Exception):
            raise page
        return page

    async def watch(self, collection: Any, resource_version: str, *, timeout_s: int) -> Any:
        self.watched_from.append(resource_version)
        watch = self.watches.pop(0)
        if isinstance(watch, Exception):
            raise watch
        if watch is None:
            self.idle.set()
            await trio.sleep_forever()
        return watch


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
