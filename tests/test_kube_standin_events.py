"""core/v1 Events in the Kubernetes stand-in, through the official client and kubectl: levers9
records Events on the Jobs it creates and deletes, and `kubectl describe job` must find them by
the field selectors a real apiserver supports, with RBAC enforced on them as on the rest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from sim.kubeapi.store import KubeStandin
from tests.kubectl import kubectl
from tests.test_kube_standin_rbac import _binding, _join, _refusal, _role, _rule
from tests.test_kube_standin_watch import _seen, _stream

pytest_plugins = ["tests.kube_fixtures"]

NS = "levers9"
SA_USER = "system:serviceaccount:levers9:controlplane"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


def _job(kube: KubeStandin, name: str) -> dict[str, Any]:
    return kube.create(
        "jobs",
        {
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [{"name": "worker", "image": "worker:latest"}],
                    }
                }
            },
        },
    )


def _event(job: dict[str, Any], name: str, reason: str, type: str = "Normal") -> dict[str, Any]:
    """An Event in the legacy shape (no eventTime), as client-go's record package writes."""
    meta = job["metadata"]
    return {
        "metadata": {"name": name, "namespace": meta["namespace"]},
        "involvedObject": {
            "kind": "Job",
            "apiVersion": "batch/v1",
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
        },
        "reason": reason,
        "message": f"{reason.lower()} by the test",
        "type": type,
        "source": {"component": "levers9"},
        "firstTimestamp": "2024-05-01T10:00:00Z",
        "lastTimestamp": "2024-05-01T10:00:00Z",
        "count": 1,
    }


def _names(listed: Any) -> list[str]:
    return sorted(e["metadata"]["name"] for e in listed["items"])


def _list(core: Any, field_selector: str) -> Any:
    response = core.list_namespaced_event(NS, field_selector=field_selector, _preload_content=False)
    return json.loads(response.data)


def test_events_crud_and_field_selectors(kube: KubeStandin) -> None:
    kube.add_namespace(NS)
    w1, w2 = _job(kube, "w-1"), _job(kube, "w-2")
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        created = core.create_namespaced_event(NS, _event(w1, "w-1.a", "Created"))
        assert created.metadata.uid and created.metadata.namespace == NS
        core.create_namespaced_event(NS, _event(w1, "w-1.b", "Deleted", "Warning"))
        core.create_namespaced_event(NS, _event(w2, "w-2.a", "Created"))
        read = core.read_namespaced_event("w-1.a", NS)
        assert (read.involved_object.kind, read.reason, read.count) == ("Job", "Created", 1)

        uid = w1["metadata"]["uid"]
        # What `kubectl describe job w-1` asks for.
        describe = f"involvedObject.name=w-1,involvedObject.namespace={NS},"
        describe += f"involvedObject.kind=Job,involvedObject.uid={uid}"
        assert _names(_list(core, describe)) == ["w-1.a", "w-1.b"]
        assert _names(_list(core, "reason=Created")) == ["w-1.a", "w-2.a"]
        assert _names(_list(core, "type=Warning")) == ["w-1.b"]
        assert _names(_list(core, "involvedObject.name!=w-1")) == ["w-2.a"]
        assert _names(_list(core, "source=levers9,reason=Deleted")) == ["w-1.b"]
        everywhere = core.list_event_for_all_namespaces(field_selector="involvedObject.name=w-2")
        assert [e.metadata.name for e in everywhere.items] == ["w-2.a"]

        # Events have their own field labels, pods theirs, as the apiserver has them.
        with pytest.raises(ApiException) as pods_field:
            core.list_namespaced_pod(NS, field_selector="involvedObject.name=w-1")
        assert pods_field.value.status == 400
        assert "field label not supported" in json.loads(pods_field.value.body)["message"]
        with pytest.raises(ApiException) as events_field:
            core.list_namespaced_event(NS, field_selector="spec.nodeName=n1")
        assert events_field.value.status == 400

        # A repeat, as client-go's correlator sends it: count and lastTimestamp only.
        repeat = {"count": 2, "lastTimestamp": "2024-05-01T10:05:00Z"}
        for name, content_type in (("w-1.a", STRATEGIC), ("w-2.a", MERGE)):
            core.patch_namespaced_event(name, NS, repeat, _content_type=content_type)
            patched = core.read_namespaced_event(name, NS)
            assert patched.count == 2 and patched.reason == "Created"
            assert patched.first_timestamp.minute == 0 and patched.last_timestamp.minute == 5

        core.delete_namespaced_event("w-1.b", NS)
        assert _names(_list(core, f"involvedObject.uid={uid}")) == ["w-1.a"]
        with pytest.raises(ApiException) as gone:
            core.read_namespaced_event("w-1.b", NS)
        assert gone.value.status == 404


def test_patches_the_stand_in_does_not_apply_are_refused(kube: KubeStandin) -> None:
    kube.add_namespace(NS)
    job = _job(kube, "w-1")
    kube.create("events", _event(job, "w-1.a", "Created"))
    headers = {"Authorization": f"Bearer {kube.token}"}
    url = f"{kube.url}/api/v1/namespaces/{NS}/events/w-1.a"
    with httpx.Client(verify=kube.ssl_context(), headers=headers) as http:
        ops = [{"op": "replace", "path": "/count", "value": 3}]
        as_json_patch = http.patch(
            url, json=ops, headers={"Content-Type": "application/json-patch+json"}
        )
        assert as_json_patch.status_code == 415
        assert as_json_patch.json()["reason"] == "UnsupportedMediaType"
        unknown = http.patch(url, json={"count": 3}, headers={"Content-Type": "text/plain"})
        assert unknown.status_code == 415
        merged = http.patch(url, json={"count": 3}, headers={"Content-Type": MERGE})
        assert merged.status_code == 200 and merged.json()["count"] == 3


def test_an_event_with_event_time_needs_its_reporter_and_action(kube: KubeStandin) -> None:
    kube.add_namespace(NS)
    job = _job(kube, "w-1")
    newer = {**_event(job, "w-1.a", "Created"), "eventTime": "2024-05-01T10:00:00.000000Z"}
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        with pytest.raises(ApiException) as invalid:
            core.create_namespaced_event(NS, newer)
        assert invalid.value.status == 422
        message = json.loads(invalid.value.body)["message"]
        assert message == (
            'Event "w-1.a" is invalid: [reportingComponent: Required value, '
            "reportingInstance: Required value, action: Required value]"
        )
        complete = {
            **newer,
            "reportingComponent": "levers9",
            "reportingInstance": "controlplane-0",
            "action": "Created",
        }
        assert core.create_namespaced_event(NS, complete).event_time is not None
        # Without eventTime the Event must live in its object's namespace.
        elsewhere = {**_event(job, "w-1.b", "Created"), "metadata": {"name": "w-1.b"}}
        with pytest.raises(ApiException) as misplaced:
            core.create_namespaced_event("default", elsewhere)
        assert misplaced.value.status == 422
        assert "does not match event.namespace" in json.loads(misplaced.value.body)["message"]


def test_events_watch_by_field_selector(kube: KubeStandin) -> None:
    kube.add_namespace(NS)
    w1, w2 = _job(kube, "w-1"), _job(kube, "w-2")
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_event(NS, _event(w1, "w-1.a", "Created"))
        with _stream(
            core.list_namespaced_event, NS, field_selector="involvedObject.name=w-1"
        ) as events:
            assert _seen(next(events)) == ("ADDED", "w-1.a")
            core.create_namespaced_event(NS, _event(w2, "w-2.a", "Created"))
            core.create_namespaced_event(NS, _event(w1, "w-1.b", "Deleted"))
            assert _seen(next(events)) == ("ADDED", "w-1.b")
            core.patch_namespaced_event("w-1.a", NS, {"count": 2}, _content_type=STRATEGIC)
            modified = next(events)
            assert _seen(modified) == ("MODIFIED", "w-1.a")
            assert modified["raw_object"]["count"] == 2
            core.delete_namespaced_event("w-1.b", NS)
            assert _seen(next(events)) == ("DELETED", "w-1.b")


def test_rbac_enforces_verbs_on_events(kube: KubeStandin) -> None:
    token = _join(kube)
    job = _job(kube, "w-1")
    with kube.api_client() as api:
        rbac = client.RbacAuthorizationV1Api(api)
        rbac.create_namespaced_role(NS, _role("events", _rule(["events"], ["create"])))
        rbac.create_namespaced_role_binding(NS, _binding("events", "Role", "events"))
    with kube.api_client(token=token) as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_event(NS, _event(job, "w-1.a", "Created"))
        with pytest.raises(ApiException) as patch:
            core.patch_namespaced_event("w-1.a", NS, {"count": 2}, _content_type=STRATEGIC)
        assert _refusal(patch) == (
            f'events "w-1.a" is forbidden: User "{SA_USER}" cannot patch resource "events" in '
            f'API group "" in the namespace "{NS}"'
        )
        with pytest.raises(ApiException) as listing:
            core.list_namespaced_event(NS)
        assert _refusal(listing)
        with pytest.raises(ApiException) as elsewhere:
            core.create_namespaced_event(
                "default", {**_event(job, "w-1.b", "Created"), "metadata": {"name": "w-1.b"}}
            )
        assert _refusal(elsewhere)
    assert kube.get("events", "w-1.a", NS)["count"] == 1  # type: ignore[index]
    assert kube.authorized(token, "create", "events", NS)
    assert not kube.authorized(token, "patch", "events", NS)


def test_kubectl_describe_job_shows_its_events(kube: KubeStandin, kubeconfig: Path) -> None:
    kube.add_namespace(NS)
    job, other = _job(kube, "w-1"), _job(kube, "w-2")
    kube.create("events", _event(job, "w-1.a", "Created"))
    kube.create("events", _event(other, "w-2.a", "Deleted"))
    kubectl(kubeconfig, "patch", "ev", "w-1.a", "-n", NS, "-p", '{"count": 3}')
    kubectl(kubeconfig, "patch", "events", "w-1.a", "-n", NS, "--type", "merge", "-p", "{}")
    described = kubectl(kubeconfig, "describe", "job", "w-1", "-n", NS)
    events = described.split("Events:", 1)[1]
    assert "Created" in events and "created by the test" in events and "(x3 over" in events
    assert "levers9" in events and "Deleted" not in events

    listed = kubectl(kubeconfig, "get", "ev", "-n", NS)
    assert listed.split()[:5] == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT"]
    assert "job/w-1" in listed and "job/w-2" in listed
    picked = kubectl(
        kubeconfig, "get", "events", "-n", NS, "--field-selector", "reason=Deleted", "-o", "name"
    )
    assert picked.split() == ["event/w-2.a"]
