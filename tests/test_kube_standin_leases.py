"""coordination.k8s.io/v1 Leases in the Kubernetes stand-in, through the official client and
kubectl: the controlplane's replicas decide who reconciles a pool by a Lease, so the stand-in
must refuse a stale update with the apiserver's 409 Conflict (for every resource, as the
apiserver does), decode MicroTimes as strictly, and enforce RBAC on leases as on the rest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from sim.kubeapi.store import KubeStandin
from tests.kubectl import kubectl
from tests.test_kube_standin_rbac import _binding, _join, _refusal, _role, _rule
from tests.test_kube_standin_watch import _seen, _stream

pytest_plugins = ["tests.kube_fixtures"]

NS = "levers9"
GROUP = "coordination.k8s.io"
NOW = "2030-01-02T03:04:05.123456Z"


def _lease(name: str, holder: str | None = "replica-a", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"leaseDurationSeconds": 15, "renewTime": NOW, **spec}
    if holder is not None:
        body["holderIdentity"] = holder
    return {"apiVersion": f"{GROUP}/v1", "kind": "Lease", "metadata": {"name": name}, "spec": body}


def _status(exc: pytest.ExceptionInfo[ApiException]) -> dict[str, Any]:
    body = json.loads(exc.value.body)
    assert isinstance(body, dict)
    return body


def test_lease_crud_and_a_stale_update_is_a_conflict(kube: KubeStandin) -> None:
    kube.add_namespace(NS)
    with kube.api_client() as api:
        leases = client.CoordinationV1Api(api)
        created = leases.create_namespaced_lease(NS, _lease("pool-gpu"))
        assert created.kind == "Lease" and created.metadata.uid
        assert created.spec.holder_identity == "replica-a"
        read = leases.read_namespaced_lease("pool-gpu", NS)
        first_rv = read.metadata.resource_version
        assert [lease.metadata.name for lease in leases.list_namespaced_lease(NS).items] == [
            "pool-gpu"
        ]

        # An update carrying the version it read goes through and gets a new one.
        renewed = _lease("pool-gpu", renewTime="2030-01-02T03:04:07.000000Z")
        renewed["metadata"]["resourceVersion"] = first_rv
        done = leases.replace_namespaced_lease("pool-gpu", NS, renewed)
        assert done.metadata.resource_version != first_rv
        assert done.metadata.uid == created.metadata.uid

        # Another update from the same, now stale, version is refused as the apiserver does.
        taken = _lease("pool-gpu", holder="replica-b")
        taken["metadata"]["resourceVersion"] = first_rv
        with pytest.raises(ApiException) as stale:
            leases.replace_namespaced_lease("pool-gpu", NS, taken)
        assert stale.value.status == 409
        status = _status(stale)
        assert status["reason"] == "Conflict"
        assert status["message"] == (
            'Operation cannot be fulfilled on leases.coordination.k8s.io "pool-gpu": the object '
            "has been modified; please apply your changes to the latest version and try again"
        )
        assert status["details"] == {"name": "pool-gpu", "group": GROUP, "kind": "leases"}
        assert (kube.get("leases", "pool-gpu", NS) or {})["spec"]["holderIdentity"] == "replica-a"

        # Without a resourceVersion an update is unconditional.
        leases.replace_namespaced_lease("pool-gpu", NS, _lease("pool-gpu", holder=""))
        assert (kube.get("leases", "pool-gpu", NS) or {})["spec"]["holderIdentity"] == ""

        with pytest.raises(ApiException) as twice:
            leases.create_namespaced_lease(NS, _lease("pool-gpu"))
        assert twice.value.status == 409 and _status(twice)["reason"] == "AlreadyExists"
        leases.delete_namespaced_lease("pool-gpu", NS)
        with pytest.raises(ApiException) as gone:
            leases.read_namespaced_lease("pool-gpu", NS)
        assert gone.value.status == 404
        assert _status(gone)["message"] == 'leases.coordination.k8s.io "pool-gpu" not found'


def test_a_stale_update_of_any_resource_is_a_conflict(kube: KubeStandin) -> None:
    kube.add_namespace(NS)
    with kube.api_client() as api:
        core = client.CoreV1Api(api)
        secret = core.create_namespaced_secret(NS, {"metadata": {"name": "s"}})
        rv = secret.metadata.resource_version
        core.replace_namespaced_secret(
            "s", NS, {"metadata": {"name": "s", "resourceVersion": rv}, "data": {"a": "YQ=="}}
        )
        with pytest.raises(ApiException) as stale:
            core.replace_namespaced_secret(
                "s", NS, {"metadata": {"name": "s", "resourceVersion": rv}}
            )
    assert stale.value.status == 409
    status = _status(stale)
    assert status["reason"] == "Conflict"
    assert status["message"].startswith('Operation cannot be fulfilled on secrets "s"')
    assert status["details"] == {"name": "s", "kind": "secrets"}


def test_lease_times_must_be_micro_times_and_its_numbers_valid(kube: KubeStandin) -> None:
    kube.add_namespace(NS)
    with kube.api_client() as api:
        leases = client.CoordinationV1Api(api)
        # What Python's isoformat() makes of a whole second: the apiserver cannot decode it.
        with pytest.raises(ApiException) as whole_second:
            leases.create_namespaced_lease(NS, _lease("a", renewTime="2030-01-02T03:04:05Z"))
        assert whole_second.value.status == 400
        assert "2006-01-02T15:04:05.000000Z07:00" in _status(whole_second)["message"]
        with pytest.raises(ApiException) as invalid:
            leases.create_namespaced_lease(
                NS, _lease("a", leaseDurationSeconds=0, leaseTransitions=-1)
            )
        assert invalid.value.status == 422
        message = _status(invalid)["message"]
        assert message.startswith('Lease.coordination.k8s.io "a" is invalid: [')
        assert "spec.leaseDurationSeconds: Invalid value: 0: must be greater than 0" in message
        assert "spec.leaseTransitions: Invalid value: -1" in message
        assert kube.objects("leases") == []
        leases.create_namespaced_lease(
            NS, _lease("a", acquireTime="2030-01-02T03:04:05.000000+02:00")
        )


def test_leases_are_watched_like_every_resource(kube: KubeStandin) -> None:
    kube.add_namespace(NS)
    with kube.api_client() as api:
        leases = client.CoordinationV1Api(api)
        rv = leases.list_namespaced_lease(NS).metadata.resource_version
        created = leases.create_namespaced_lease(NS, _lease("pool-gpu"))
        body = _lease("pool-gpu", holder="replica-b")
        body["metadata"]["resourceVersion"] = created.metadata.resource_version
        leases.replace_namespaced_lease("pool-gpu", NS, body)
        leases.delete_namespaced_lease("pool-gpu", NS)
        with _stream(leases.list_namespaced_lease, NS, resource_version=rv) as events:
            got = [next(events) for _ in range(3)]
    assert [_seen(e) for e in got] == [
        ("ADDED", "pool-gpu"),
        ("MODIFIED", "pool-gpu"),
        ("DELETED", "pool-gpu"),
    ]
    assert got[1]["raw_object"]["spec"]["holderIdentity"] == "replica-b"


def test_rbac_on_leases(kube: KubeStandin) -> None:
    """What the chart grants (get, create, update on leases in its namespace), no more."""
    token = _join(kube)
    kube.add_namespace("other")
    kube.create(
        "roles",
        _role("leases", _rule(["leases"], ["get", "create", "update"], [GROUP]), namespace=NS),
    )
    kube.create(
        "rolebindings",
        {**_binding("leases", "Role", "leases"), "metadata": {"name": "leases", "namespace": NS}},
    )
    with kube.api_client(token) as api:
        leases = client.CoordinationV1Api(api)
        created = leases.create_namespaced_lease(NS, _lease("pool-gpu"))
        body = leases.read_namespaced_lease("pool-gpu", NS).to_dict()
        assert body["metadata"]["resource_version"] == created.metadata.resource_version
        leases.replace_namespaced_lease("pool-gpu", NS, _lease("pool-gpu", holder="replica-b"))
        with pytest.raises(ApiException) as listing:
            leases.list_namespaced_lease(NS)
        assert _refusal(listing) == (
            'leases.coordination.k8s.io is forbidden: User "system:serviceaccount:levers9:'
            'controlplane" cannot list resource "leases" in API group "coordination.k8s.io" in '
            'the namespace "levers9"'
        )
        with pytest.raises(ApiException) as deleting:
            leases.delete_namespaced_lease("pool-gpu", NS)
        assert 'cannot delete resource "leases"' in _refusal(deleting)
        with pytest.raises(ApiException) as elsewhere:
            leases.create_namespaced_lease("other", _lease("pool-gpu"))
        assert 'in the namespace "other"' in _refusal(elsewhere)
    assert kube.authorized(token, "update", "leases", NS, GROUP, name="pool-gpu")
    assert not kube.authorized(token, "update", "leases", NS, "", name="pool-gpu")


def test_kubectl_get_leases_shows_holder_and_age(kube: KubeStandin, kubeconfig: Path) -> None:
    kube.add_namespace(NS)
    kube.create(
        "leases",
        {**_lease("levers9-pool-gpu"), "metadata": {"name": "levers9-pool-gpu", "namespace": NS}},
    )
    kube.create(
        "leases",
        {
            **_lease("levers9-pool-free", holder=""),
            "metadata": {"name": "levers9-pool-free", "namespace": NS},
        },
    )

    header, *rows = kubectl(kubeconfig, "get", "leases", "-n", NS).splitlines()
    assert header.split() == ["NAME", "HOLDER", "AGE"]
    cells = sorted(row.split() for row in rows)
    # A released Lease has no holder: its HOLDER cell is blank.
    assert [c[:-1] for c in cells] == [["levers9-pool-free"], ["levers9-pool-gpu", "replica-a"]]
    assert all(c[-1].endswith("s") for c in cells)  # AGE, seconds old
    listed = json.loads(
        kubectl(kubeconfig, "get", "lease", "levers9-pool-gpu", "-n", NS, "-o", "json")
    )
    assert listed["spec"]["holderIdentity"] == "replica-a"
    assert "leases" in kubectl(kubeconfig, "api-resources", "--api-group", GROUP)
