"""WATCH in the Kubernetes stand-in, through the official client, raw HTTP and `kubectl -w`: the
controlplane's list+watch caches will trust these streams to miss nothing after a list's
resourceVersion, to filter as a real apiserver's cacher does, and to fail the ways real ones fail
(410 Expired, a dropped connection) so their recovery can be tested."""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException
from urllib3.exceptions import ProtocolError

from sim.kubeapi.model import RESOURCES
from sim.kubeapi.objects import make_node, make_pod
from sim.kubeapi.store import KubeStandin
from tests.kubectl import kubectl_binary
from tests.test_kube_standin_rbac import _binding, _join, _role, _rule

pytest_plugins = ["tests.kube_fixtures"]

READ_TIMEOUT_S = 10
"""A stream that has gone quiet when the test expects an event fails instead of hanging."""


def _seen(event: dict[str, Any]) -> tuple[str, str]:
    return event["type"], event["raw_object"]["metadata"]["name"]


def _rv(event: dict[str, Any]) -> int:
    return int(event["raw_object"]["metadata"]["resourceVersion"])


@contextlib.contextmanager
def _stream(fn: Any, *args: Any, **kw: Any) -> Iterator[Iterator[dict[str, Any]]]:
    """The official client's `Watch.stream`, closed when the block ends."""
    w = watch.Watch()
    events = w.stream(fn, *args, _request_timeout=READ_TIMEOUT_S, **kw)
    try:
        yield events
    finally:
        w.stop()
        events.close()


def test_watch_from_a_list_sees_exactly_the_later_changes_in_order(kube: KubeStandin) -> None:
    kube.add_node(make_node("n1"))
    kube.add_pod(make_pod("old", "n1"))
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        listed = core.list_pod_for_all_namespaces()
        rv = listed.metadata.resource_version
        assert int(rv) == kube.resource_version
        kube.add_pod(make_pod("a", "n1"))
        kube.set_pod_phase("a", "Succeeded")
        kube.add_node(make_node("n2"))  # another resource: not this watch's
        kube.remove_pod("a")
        kube.add_pod(make_pod("b", "n1"))
        with _stream(core.list_pod_for_all_namespaces, resource_version=rv) as events:
            got = [next(events) for _ in range(4)]
            assert [_seen(e) for e in got] == [
                ("ADDED", "a"),
                ("MODIFIED", "a"),
                ("DELETED", "a"),
                ("ADDED", "b"),
            ]
            # A DELETED event carries the last state at a resourceVersion of its own.
            assert got[2]["object"].status.phase == "Succeeded"
            versions = [_rv(e) for e in got]
            assert int(rv) < versions[0] < versions[1] < versions[2] < versions[3]
            assert all(e["raw_object"]["kind"] == "Pod" for e in got)
            assert all(e["raw_object"]["apiVersion"] == "v1" for e in got)
            # Live changes follow the replayed ones.
            kube.add_pod(make_pod("c", "n1"))
            live = next(events)
            assert _seen(live) == ("ADDED", "c")
            assert _rv(live) == kube.resource_version


def test_watch_without_a_version_starts_with_the_current_objects(kube: KubeStandin) -> None:
    kube.add_namespace("other")
    kube.add_node(make_node("n1"))
    kube.add_pods([make_pod("here", "n1", namespace="other"), make_pod("there", "n1")])
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        with _stream(core.list_namespaced_pod, "other") as events:
            assert _seen(next(events)) == ("ADDED", "here")
            kube.add_pod(make_pod("elsewhere", "n1"))
            kube.add_pod(make_pod("later", "n1", namespace="other"))
            assert _seen(next(events)) == ("ADDED", "later")
        with _stream(core.list_node, resource_version="0") as events:
            assert _seen(next(events)) == ("ADDED", "n1")
            kube.remove_node("n1")
            deleted = next(events)
            assert _seen(deleted) == ("DELETED", "n1")
            assert _rv(deleted) == kube.resource_version


def test_every_listed_resource_serves_watch(kube: KubeStandin) -> None:
    headers = {"Authorization": f"Bearer {kube.token}"}
    paths = []
    for res in RESOURCES:
        base = "/api/v1" if not res.group else f"/apis/{res.group}/v1"
        paths.append(f"{base}/{res.plural}")
        if res.namespaced:
            paths.append(f"{base}/namespaces/default/{res.plural}")
    with (
        httpx.Client(verify=kube.ssl_context(), headers=headers, timeout=READ_TIMEOUT_S) as http,
        contextlib.ExitStack() as streams,
    ):
        for path in paths:
            resp = streams.enter_context(http.stream("GET", f"{kube.url}{path}?watch=1"))
            assert resp.status_code == 200, path
            assert resp.headers["Transfer-Encoding"] == "chunked"
            assert resp.headers["Content-Type"] == "application/json"
        assert kube.wait_watches(len(paths))
        namespaces = streams.enter_context(
            http.stream("GET", f"{kube.url}/api/v1/namespaces?watch=1")
        )
        first = json.loads(next(namespaces.iter_lines()))
        assert (first["type"], first["object"]["kind"]) == ("ADDED", "Namespace")


def test_label_selector_watch_adds_and_deletes_as_objects_come_and_go(kube: KubeStandin) -> None:
    kube.add_node(make_node("a1", labels={"pool": "a"}))
    kube.add_node(make_node("b1", labels={"pool": "b"}))
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        with _stream(core.list_node, label_selector="pool=a") as events:
            assert _seen(next(events)) == ("ADDED", "a1")
            kube.add_node(make_node("a1", labels={"pool": "b"}))
            left = next(events)
            assert _seen(left) == ("DELETED", "a1")
            # As it last matched, at the change's version.
            assert left["raw_object"]["metadata"]["labels"]["pool"] == "a"
            assert _rv(left) == kube.resource_version
            kube.add_node(make_node("b2", labels={"pool": "b"}))
            kube.add_node(make_node("b1", labels={"pool": "a"}))
            assert _seen(next(events)) == ("ADDED", "b1")
            kube.add_node(make_node("b1", labels={"pool": "a", "more": "yes"}))
            assert _seen(next(events)) == ("MODIFIED", "b1")


def test_field_selector_watch_drops_a_pod_that_succeeds(kube: KubeStandin) -> None:
    kube.add_namespace("other")
    kube.add_node(make_node("n1"))
    kube.add_node(make_node("n2"))
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        rv = core.list_pod_for_all_namespaces().metadata.resource_version
        live = "spec.nodeName=n1,status.phase!=Succeeded,metadata.namespace!=other"
        with _stream(
            core.list_pod_for_all_namespaces, resource_version=rv, field_selector=live
        ) as events:
            kube.add_pod(make_pod("p", "n1"))
            kube.add_pod(make_pod("q", "n2"))
            kube.add_pod(make_pod("o", "n1", namespace="other"))
            kube.set_pod_phase("p", "Succeeded")
            kube.add_pod(make_pod("r", "n1", phase="Succeeded"))
            kube.add_pod(make_pod("s", "n1"))
            got = [next(events) for _ in range(3)]
            assert [_seen(e) for e in got] == [("ADDED", "p"), ("DELETED", "p"), ("ADDED", "s")]
            assert got[1]["object"].status.phase == "Running"
        with _stream(core.list_pod_for_all_namespaces, field_selector="metadata.name=q") as events:
            assert _seen(next(events)) == ("ADDED", "q")
        with pytest.raises(ApiException) as bad:
            core.list_pod_for_all_namespaces(watch=True, field_selector="spec.schedulerName=x")
        assert bad.value.status == 400


def test_bookmarks_arrive_only_when_allowed(kube: KubeStandin) -> None:
    kube.bookmark_interval_s = 0.05
    kube.add_node(make_node("n1"))
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        rv = str(kube.resource_version)
        with _stream(core.list_node, resource_version=rv, allow_watch_bookmarks=True) as events:
            mark = next(events)
            assert mark["type"] == "BOOKMARK"
            assert mark["raw_object"]["metadata"] == {"resourceVersion": rv}
            kube.add_node(make_node("n2"))
            assert _seen(next(events)) == ("ADDED", "n2")
            later = next(events)
            assert later["type"] == "BOOKMARK"
            assert later["raw_object"]["metadata"]["resourceVersion"] == str(kube.resource_version)
        # Without allowWatchBookmarks a quiet watch sends nothing until its timeoutSeconds.
        now = str(kube.resource_version)
        quiet = list(watch.Watch().stream(core.list_node, resource_version=now, timeout_seconds=1))
        assert quiet == []


def test_timeout_seconds_ends_the_stream_cleanly(kube: KubeStandin) -> None:
    kube.add_node(make_node("n1"))
    headers = {"Authorization": f"Bearer {kube.token}"}
    url = f"{kube.url}/api/v1/nodes?watch=true&timeoutSeconds=1"
    with httpx.Client(verify=kube.ssl_context(), headers=headers, timeout=READ_TIMEOUT_S) as http:
        with http.stream("GET", url) as resp:
            lines = [json.loads(line) for line in resp.iter_lines()]
        # The final chunk came: the connection is reusable.
        assert http.get(f"{kube.url}/api/v1/nodes").status_code == 200
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in lines] == [("ADDED", "n1")]
    assert kube.watch_count() == 0


def test_watch_from_an_expired_version_gets_410(kube: KubeStandin) -> None:
    kube.add_nodes([make_node("n1"), make_node("n2")])
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        first_page = core.list_node(limit=1)
        rv = first_page.metadata.resource_version
        kube.add_node(make_node("n3"))
        kube.expire_history()
        compacted = kube.resource_version
        # With timeoutSeconds the official client does not retry: the ERROR event raises.
        with pytest.raises(ApiException) as gone:
            list(watch.Watch().stream(core.list_node, resource_version=rv, timeout_seconds=5))
        assert gone.value.status == 410
        assert gone.value.reason == f"Expired: too old resource version: {rv} ({compacted})"
        # Without, it retries once from the same version, then raises the same.
        before = kube.request_count("watch")
        with pytest.raises(ApiException) as again:
            for _ in watch.Watch().stream(core.list_node, resource_version=rv):
                pass
        assert again.value.status == 410
        assert kube.request_count("watch") == before + 2
        # A paged list continued from before the compaction is expired too, with a plain 410.
        with pytest.raises(ApiException) as stale:
            core.list_node(limit=1, _continue=first_page.metadata._continue)
        assert stale.value.status == 410
        assert json.loads(stale.value.body)["reason"] == "Expired"
        # The current version still watches.
        with _stream(core.list_node, resource_version=str(kube.resource_version)) as events:
            kube.add_node(make_node("n4"))
            assert _seen(next(events)) == ("ADDED", "n4")
    headers = {"Authorization": f"Bearer {kube.token}"}
    with httpx.Client(verify=kube.ssl_context(), headers=headers, timeout=READ_TIMEOUT_S) as http:
        with http.stream("GET", f"{kube.url}/api/v1/nodes?watch=true&resourceVersion={rv}") as resp:
            assert resp.status_code == 200
            lines = [json.loads(line) for line in resp.iter_lines()]
    assert lines == [
        {
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": f"too old resource version: {rv} ({compacted})",
                "reason": "Expired",
                "code": 410,
            },
        }
    ]


def test_dropped_watch_resumes_from_its_last_version_without_a_list(kube: KubeStandin) -> None:
    kube.add_node(make_node("n1"))
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        rv = core.list_pod_for_all_namespaces().metadata.resource_version
        lists = kube.list_count("pods")
        w = watch.Watch()
        events = w.stream(
            core.list_pod_for_all_namespaces, resource_version=rv, _request_timeout=READ_TIMEOUT_S
        )
        kube.add_pod(make_pod("a", "n1"))
        assert _seen(next(events)) == ("ADDED", "a")
        assert kube.drop_watches() == 1
        assert kube.watch_count() == 0
        with pytest.raises(ProtocolError):
            next(events)
        # What changes while the client is away comes with the resumed watch.
        kube.add_pod(make_pod("b", "n1"))
        kube.remove_pod("a")
        assert w.resource_version is not None
        with _stream(
            core.list_pod_for_all_namespaces, resource_version=w.resource_version
        ) as again:
            assert [_seen(next(again)) for _ in range(2)] == [("ADDED", "b"), ("DELETED", "a")]
        assert kube.list_count("pods") == lists


def test_fifty_watchers_and_a_list_at_once(kube: KubeStandin) -> None:
    headers = {"Authorization": f"Bearer {kube.token}"}
    limits = httpx.Limits(max_connections=60)
    url = f"{kube.url}/api/v1/nodes?watch=true&resourceVersion={kube.resource_version}"
    with (
        httpx.Client(
            verify=kube.ssl_context(), headers=headers, timeout=READ_TIMEOUT_S, limits=limits
        ) as http,
        contextlib.ExitStack() as streams,
    ):
        responses = [streams.enter_context(http.stream("GET", url)) for _ in range(50)]
        assert kube.wait_watches(50)
        assert http.get(f"{kube.url}/api/v1/nodes").status_code == 200
        kube.add_node(make_node("n1"))
        for resp in responses:
            event = json.loads(next(resp.iter_lines()))
            assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "n1")
    assert kube.wait_watches(0)


def test_watch_is_its_own_verb(kube: KubeStandin) -> None:
    token = _join(kube)
    with kube.api_client() as api:
        rbac = client.RbacAuthorizationV1Api(api)
        rbac.create_namespaced_role("levers9", _role("lister", _rule(["pods"], ["get", "list"])))
        rbac.create_namespaced_role_binding("levers9", _binding("lister", "Role", "lister"))
    with kube.api_client(token=token) as api:
        core = client.CoreV1Api(api)
        core.list_namespaced_pod("levers9")
        with pytest.raises(ApiException) as refused:
            core.list_namespaced_pod("levers9", watch=True)
    assert refused.value.status == 403
    assert json.loads(refused.value.body)["message"] == (
        'pods is forbidden: User "system:serviceaccount:levers9:controlplane" cannot watch '
        'resource "pods" in API group "" in the namespace "levers9"'
    )
    assert not kube.authorized(token, "watch", "pods", "levers9")
    kube.add_token("no-watch", denied_verbs={"watch"})
    with kube.api_client(token="no-watch") as api:
        core = client.CoreV1Api(api)
        core.list_node()
        with pytest.raises(ApiException) as denied:
            core.list_node(watch=True)
    assert denied.value.status == 403


def test_kubectl_get_watch(kube: KubeStandin, kubeconfig: Path) -> None:
    kube.add_node(make_node("gpu-1"))
    proc = subprocess.Popen(
        [kubectl_binary(), "--kubeconfig", str(kubeconfig), "get", "pods", "-A", "-w"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert kube.wait_watches(1), "kubectl did not start watching"
        kube.add_pod(make_pod("app", "gpu-1"))
        kube.set_pod_phase("app", "Succeeded")
        seen: list[list[str]] = []
        while len([row for row in seen if row[:2] == ["default", "app"]]) < 2:
            line = lines.get(timeout=READ_TIMEOUT_S)
            assert line is not None, proc.stderr.read() if proc.stderr else ""
            seen.append(line.split())
        rows = [row for row in seen if row[:2] == ["default", "app"]]
        assert [row[3] for row in rows] == ["Running", "Succeeded"]
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
        reader.join(timeout=30)
