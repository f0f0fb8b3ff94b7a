"""The Kubernetes stand-in misbehaving on command, as real apiservers do under load: watches that
lag behind the store, end at once or stall (`set_watch_faults`), and requests answered with a
chosen Status per object name until cleared (`inject_fault(kind="status")`, `clear_faults`).
The controlplane's caches and writers are tested against these; here each fault is checked for
what a client of the stand-in sees."""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from sim.kubeapi.objects import make_node
from sim.kubeapi.store import KubeStandin, WatchFaults
from tests.test_kube_standin import _job
from tests.test_kube_standin_watch import READ_TIMEOUT_S, _seen, _stream

pytest_plugins = ["tests.kube_fixtures"]

QUIET_S = 0.4
"""How long a test listens to a stream that must stay silent."""

Line = tuple[float, dict[str, Any]]
"""A watch line as it arrived: when (`time.monotonic()`) and its JSON."""


@contextlib.contextmanager
def _watch_lines(
    kube: KubeStandin, query: str = ""
) -> Iterator[tuple[httpx.Response, queue.Queue[Line | None]]]:
    """A raw watch of nodes: its response, and a queue a thread fills with its lines as they
    arrive, then None when it ends cleanly (a cut stream ends the queue without None)."""
    headers = {"Authorization": f"Bearer {kube.token}"}
    lines: queue.Queue[Line | None] = queue.Queue()
    url = f"{kube.url}/api/v1/nodes?watch=true&{query}"
    with (
        httpx.Client(verify=kube.ssl_context(), headers=headers, timeout=READ_TIMEOUT_S) as http,
        http.stream("GET", url) as resp,
    ):

        def read() -> None:
            with contextlib.suppress(httpx.HTTPError):
                for line in resp.iter_lines():
                    lines.put((time.monotonic(), json.loads(line)))
                lines.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            yield resp, lines
        finally:
            kube.drop_watches()
            reader.join(timeout=READ_TIMEOUT_S)


def _next(lines: queue.Queue[Line | None]) -> Line:
    line = lines.get(timeout=READ_TIMEOUT_S)
    assert line is not None, "the watch ended"
    return line


def _added(line: Line) -> str:
    event = line[1]
    assert event["type"] == "ADDED", event
    return str(event["object"]["metadata"]["name"])


def _assert_quiet(lines: queue.Queue[Line | None], seconds: float = QUIET_S) -> None:
    with pytest.raises(queue.Empty):
        got = lines.get(timeout=seconds)
        pytest.fail(f"the watch sent {got!r}")


def test_a_lagged_watch_sends_a_change_only_after_the_lag_while_a_list_sees_it_at_once(
    kube: KubeStandin,
) -> None:
    kube.set_watch_faults(WatchFaults(lag_s=0.5))
    assert kube.watch_faults == WatchFaults(lag_s=0.5)
    rv = kube.resource_version
    with kube.api_client() as api, _watch_lines(kube, f"resourceVersion={rv}") as (_, lines):
        core = client.CoreV1Api(api)
        created = time.monotonic()
        kube.add_node(make_node("n1"))
        kube.add_node(make_node("n2"))
        # Lists and GETs read the current state.
        assert [n.metadata.name for n in core.list_node().items] == ["n1", "n2"]
        assert core.read_node("n2").metadata.name == "n2"
        listed = time.monotonic()
        first, second = _next(lines), _next(lines)
    assert (_added(first), _added(second)) == ("n1", "n2")
    assert listed < created + 0.5 <= first[0] <= second[0] < created + 3.0


def test_clearing_the_lag_sends_what_was_held_back(kube: KubeStandin) -> None:
    kube.add_node(make_node("old"))
    kube.set_watch_faults(WatchFaults(lag_s=30.0))
    with _watch_lines(kube) as (_, lines):
        # Even the first events of a watch without a version wait for the newest change.
        _assert_quiet(lines)
        kube.set_watch_faults(WatchFaults())
        assert _added(_next(lines)) == "old"
        kube.set_watch_faults(WatchFaults(lag_s=30.0))
        kube.add_node(make_node("new"))
        _assert_quiet(lines)
        cleared = time.monotonic()
        kube.set_watch_faults(WatchFaults())
        held = _next(lines)
    assert _added(held) == "new"
    assert held[0] < cleared + 3.0


def test_a_lagged_watch_still_ends_at_its_timeout_and_on_a_compacted_version(
    kube: KubeStandin,
) -> None:
    kube.set_watch_faults(WatchFaults(lag_s=30.0))
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        rv = core.list_node().metadata.resource_version
        kube.add_node(make_node("n1"))
        started = time.monotonic()
        held = list(watch.Watch().stream(core.list_node, resource_version=rv, timeout_seconds=1))
        assert held == []
        assert time.monotonic() - started < 5.0
        kube.expire_history()
        with pytest.raises(ApiException) as gone:
            list(watch.Watch().stream(core.list_node, resource_version=rv, timeout_seconds=5))
    assert gone.value.status == 410


def test_bookmarks_under_lag_never_run_ahead_of_the_events_sent(kube: KubeStandin) -> None:
    kube.bookmark_interval_s = 0.05
    kube.set_watch_faults(WatchFaults(lag_s=0.5))
    rv = kube.resource_version
    query = f"resourceVersion={rv}&allowWatchBookmarks=true"
    with _watch_lines(kube, query) as (_, lines):
        kube.add_node(make_node("n1"))
        kube.add_node(make_node("n2"))
        sent = rv
        marks_before = marks_after = 0
        while marks_after < 2:
            event = _next(lines)[1]
            event_rv = int(event["object"]["metadata"]["resourceVersion"])
            if event["type"] == "BOOKMARK":
                assert event_rv <= sent, f"bookmark at {event_rv}, sent up to {sent}"
                marks_before += sent == rv
                marks_after += sent == kube.resource_version
            else:
                sent = event_rv
    # Bookmarks kept coming while the events were held, naming only what had been sent.
    assert marks_before >= 3


def test_end_at_once_answers_every_watch_with_no_event_and_ends_open_ones(
    kube: KubeStandin,
) -> None:
    kube.add_node(make_node("n1"))
    with _watch_lines(kube) as (_, open_lines):
        assert _added(_next(open_lines)) == "n1"
        set_at = time.monotonic()
        kube.set_watch_faults(WatchFaults(end_at_once=True))
        # Ended at once, with the final chunk, not cut.
        assert open_lines.get(timeout=READ_TIMEOUT_S) is None
        assert time.monotonic() - set_at < 0.5
    assert kube.wait_watches(0)
    headers = {"Authorization": f"Bearer {kube.token}"}
    with httpx.Client(verify=kube.ssl_context(), headers=headers, timeout=READ_TIMEOUT_S) as http:
        with http.stream("GET", f"{kube.url}/api/v1/nodes?watch=true") as resp:
            assert resp.status_code == 200
            assert resp.headers["Transfer-Encoding"] == "chunked"
            assert resp.headers["Content-Type"] == "application/json"
            assert list(resp.iter_lines()) == []
        # The final chunk came: the connection is reusable.
        assert http.get(f"{kube.url}/api/v1/nodes").status_code == 200
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        started = time.monotonic()
        assert list(watch.Watch().stream(core.list_node, timeout_seconds=30)) == []
        assert time.monotonic() - started < 5.0
        kube.set_watch_faults(WatchFaults())
        with _stream(core.list_node) as events:
            assert _seen(next(events)) == ("ADDED", "n1")


def test_a_stalled_watch_sends_nothing_not_even_bookmarks_until_cleared(
    kube: KubeStandin,
) -> None:
    kube.bookmark_interval_s = 0.05
    kube.add_node(make_node("n1"))
    with _watch_lines(kube) as (_, before):
        assert _added(_next(before)) == "n1"
        kube.set_watch_faults(WatchFaults(stall=True))
        rv = kube.resource_version
        kube.add_node(make_node("n2"))
        # Opened within the stall: neither their first events, the change nor a bookmark come.
        with (
            _watch_lines(kube, "allowWatchBookmarks=true") as (_, during),
            _watch_lines(kube, f"resourceVersion={rv}&allowWatchBookmarks=true") as (_, from_rv),
        ):
            _assert_quiet(during)
            _assert_quiet(before, 0.0)
            _assert_quiet(from_rv, 0.0)
            assert kube.watch_count() == 3
            kube.set_watch_faults(WatchFaults())
            assert _added(_next(before)) == "n2"
            assert [_added(_next(during)) for _ in range(2)] == ["n1", "n2"]
            assert _added(_next(from_rv)) == "n2"
            marks = [_next(during)[1], _next(from_rv)[1]]
    for mark in marks:
        assert mark["type"] == "BOOKMARK"
        assert mark["object"]["metadata"]["resourceVersion"] == str(kube.resource_version)


def test_a_status_fault_answers_creates_of_the_named_objects(kube: KubeStandin) -> None:
    kube.add_node(make_node("n1"))
    message = 'Job.batch "bad-1" is invalid: spec.template.spec.containers[0].image: Required value'
    kube.inject_fault(
        "status", verb="create", name_prefix="bad-", status=422, reason="Invalid", message=message
    )
    with kube.api_client() as api:
        batch = client.BatchV1Api(api)
        # Another name is created, and leaves the fault armed.
        batch.create_namespaced_job("default", _job("good-1", "n1"))
        with pytest.raises(ApiException) as invalid:
            batch.create_namespaced_job("default", _job("bad-1", "n1"))
        # Its one answer given, the next create of the same kind goes through.
        batch.create_namespaced_job("default", _job("bad-2", "n1"))
    assert invalid.value.status == 422
    assert json.loads(invalid.value.body) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": "Invalid",
        "details": {"name": "bad-1", "group": "batch", "kind": "Job"},
        "code": 422,
    }
    assert [job["metadata"]["name"] for job in kube.jobs()] == ["bad-2", "good-1"]


def test_faults_without_a_count_answer_until_cleared(kube: KubeStandin) -> None:
    kube.add_nodes([make_node("n1"), make_node("gpu-1")])
    quota = (
        "exceeded quota: gpu-quota, requested: nvidia.com/gpu=2, used: nvidia.com/gpu=8, "
        "limited: nvidia.com/gpu=8"
    )
    kube.inject_fault(
        "status",
        None,
        path_prefix="/apis/batch/v1/",
        verb="create",
        name_prefix="gpu-",
        status=403,
        reason="Forbidden",
        message=quota,
    )
    kube.inject_fault("500", None, name_prefix="gpu-")
    kube.inject_fault("delay", None, verb="get", path_prefix="/api/v1/nodes/n", delay_s=0.3)
    headers = {"Authorization": f"Bearer {kube.token}"}
    with (
        kube.api_client() as api,
        httpx.Client(verify=kube.ssl_context(), headers=headers, timeout=READ_TIMEOUT_S) as http,
    ):
        batch = client.BatchV1Api(api)
        for i in range(3):
            with pytest.raises(ApiException) as refused:
                batch.create_namespaced_job("default", _job(f"gpu-{i}", "gpu-1"))
            assert refused.value.status == 403
            status = json.loads(refused.value.body)
            assert (status["reason"], status["message"]) == ("Forbidden", quota)
            assert status["details"] == {"name": f"gpu-{i}", "group": "batch", "kind": "jobs"}
            # The existing kinds match a name in the path; requests naming none pass.
            assert http.get(f"{kube.url}/api/v1/nodes/gpu-1").status_code == 500
            assert http.get(f"{kube.url}/api/v1/nodes").status_code == 200
            started = time.monotonic()
            assert http.get(f"{kube.url}/api/v1/nodes/n1").status_code == 200
            assert time.monotonic() - started >= 0.3
        assert kube.jobs() == []
        kube.clear_faults()
        batch.create_namespaced_job("default", _job("gpu-3", "gpu-1"))
        assert http.get(f"{kube.url}/api/v1/nodes/gpu-1").status_code == 200
        started = time.monotonic()
        assert http.get(f"{kube.url}/api/v1/nodes/n1").status_code == 200
        assert time.monotonic() - started < 0.3
    assert [job["metadata"]["name"] for job in kube.jobs()] == ["gpu-3"]


def test_faults_are_checked_when_armed(tmp_path: Path) -> None:
    kube = KubeStandin(tmp_path)  # not served: only the arguments are checked
    with pytest.raises(ValueError, match="status="):
        kube.inject_fault("status", reason="Invalid")
    with pytest.raises(ValueError, match="status="):
        kube.inject_fault("status", status=299, reason="OK")
    with pytest.raises(ValueError, match="reason="):
        kube.inject_fault("status", status=422)
    with pytest.raises(ValueError, match='kind="status"'):
        kube.inject_fault("500", reason="Invalid")
    with pytest.raises(ValueError, match="fault kind"):
        kube.inject_fault("503")
    with pytest.raises(ValueError, match="lag_s"):
        WatchFaults(lag_s=-1.0)


def test_a_node_goes_not_ready_and_back_as_its_kubelet_reports_it(kube: KubeStandin) -> None:
    from sim.kubeapi.model import KubeError  # appended test: the module's imports stay as they were

    long_ago = "2024-01-01T00:00:00Z"

    def ready_condition(node: dict[str, Any]) -> dict[str, Any]:
        (ready,) = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        return dict(ready)

    def with_transition(node: dict[str, Any], when: str) -> dict[str, Any]:
        conditions = [
            {**c, "lastTransitionTime": when, "lastHeartbeatTime": when}
            for c in node["status"]["conditions"]
        ]
        return {**node, "status": {**node["status"], "conditions": conditions}}

    kube.add_node(with_transition(make_node("n1"), long_ago))
    rv = kube.resource_version
    with kube.api_client() as api, _watch_lines(kube, f"resourceVersion={rv}") as (_, lines):
        core = client.CoreV1Api(api)
        stored = kube.set_node_ready("n1", False)
        event = _next(lines)[1]
        assert event["type"] == "MODIFIED"
        down = ready_condition(event["object"])
        assert down == ready_condition(stored)
        assert (down["status"], down["reason"]) == ("False", "KubeletNotReady")
        assert down["message"].startswith("PLEG is not healthy")
        assert down["lastTransitionTime"] != long_ago != down["lastHeartbeatTime"]
        (got,) = [c for c in core.read_node("n1").status.conditions if c.type == "Ready"]
        assert (got.status, got.reason) == ("False", "KubeletNotReady")
        # The rest of the node is as it was.
        assert event["object"]["status"]["capacity"] == make_node("n1")["status"]["capacity"]
        # Reported again with the same status: a heartbeat, the transition time kept.
        kube.update("nodes", with_transition(stored, long_ago))
        assert _next(lines)[1]["type"] == "MODIFIED"
        kube.set_node_ready("n1", False)
        again = ready_condition(_next(lines)[1]["object"])
        assert again["status"] == "False"
        assert again["lastTransitionTime"] == long_ago != again["lastHeartbeatTime"]
        kube.set_node_ready("n1", True)
        event = _next(lines)[1]
        assert event["type"] == "MODIFIED"
        up = ready_condition(event["object"])
        assert (up["status"], up["reason"]) == ("True", "KubeletReady")
        assert up["message"] == "kubelet is posting ready status"
        assert up["lastTransitionTime"] != long_ago
        (got,) = [c for c in core.read_node("n1").status.conditions if c.type == "Ready"]
        assert got.status == "True"
    with pytest.raises(KubeError) as missing:
        kube.set_node_ready("nope", True)
    assert missing.value.code == 404
