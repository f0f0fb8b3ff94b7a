"""Events on the worker Jobs levers9 makes, recorded through the real adapter against the
Kubernetes stand-in: one Event per decision, repeats counted on it, a flood dropped, and a
cluster that refuses Events never troubling the reconcile pass."""

from __future__ import annotations

import base64
import logging
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from kubernetes import client

from control.kube.adapter import KubeClient, KubeUnavailable, open_kube_client
from control.kube.events import EventRecorder, event_manifest
from control.kube.join import NAMESPACE_RULES
from control.kube.pools import load_pools
from sim.kubeapi.store import KubeStandin
from tests.test_kube_standin_rbac import _binding, _join, _role

pytest_plugins = ["tests.kube_fixtures"]

NS = "levers9"
CREATED = "created worker for 2 free cards on node-1"
DELETED = "deleted: node is cordoned (unschedulable)"


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.25

    def __call__(self) -> float:
        return self.now


def _pool_block(kube: KubeStandin, token: str) -> dict[str, Any]:
    return {
        "name": "gpu",
        "provider": "kubernetes",
        "kubernetes": {
            "flavor": "generic",
            "endpoint": kube.url,
            "caData": base64.b64encode(kube.ca_pem).decode(),
            "credentials": {"token": token},
            "image": "registry.example.test/levers9/worker:1",
            "selector": {"levers9.dev/test-pool": "gpu"},
        },
    }


@asynccontextmanager
async def _client(kube: KubeStandin, token: str | None = None) -> AsyncIterator[KubeClient]:
    pool = load_pools([_pool_block(kube, token or kube.token)]).pools[0]
    async with open_kube_client(pool) as kube_client:
        yield kube_client


def _job_manifest(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "worker", "image": "worker:1"}],
                }
            }
        },
    }


def _grant(kube: KubeStandin, rules: Sequence[Mapping[str, Any]]) -> str:
    """A ServiceAccount token bound to a Role of `rules` in the pool's namespace."""
    token = _join(kube)
    with kube.api_client() as api:
        rbac = client.RbacAuthorizationV1Api(api)
        rbac.create_namespaced_role(NS, _role("levers9", *rules))
        rbac.create_namespaced_role_binding(NS, _binding("levers9", "Role", "levers9"))
    return token


def _events_of(kube: KubeStandin, job: Mapping[str, Any]) -> list[dict[str, Any]]:
    uid = job["metadata"]["uid"]
    return [e for e in kube.objects("events", NS) if e["involvedObject"].get("uid") == uid]


async def test_a_job_gets_an_event_and_a_repeat_counts_on_it(kube: KubeStandin) -> None:
    # The Role `levers9 cluster join` creates is enough to create and patch Events.
    token = _grant(kube, [dict(r) for r in NAMESPACE_RULES])
    clock = Clock()
    async with _client(kube, token) as kube_client:
        job = await kube_client.create_job(NS, _job_manifest("gpu-node-1-0"))
        other = await kube_client.create_job(NS, _job_manifest("gpu-node-2-0"))
        recorder = EventRecorder(kube_client, pool="gpu", instance="cp-0", clock=clock)
        await recorder.record(job, "Created", CREATED)

        (event,) = _events_of(kube, job)
        assert re.fullmatch(r"gpu-node-1-0\.[0-9a-f]{16}", event["metadata"]["name"])
        assert event["involvedObject"] == {
            "kind": "Job",
            "apiVersion": "batch/v1",
            "name": "gpu-node-1-0",
            "namespace": NS,
            "uid": job["metadata"]["uid"],
            "resourceVersion": job["metadata"]["resourceVersion"],
        }
        assert (event["reason"], event["message"], event["type"]) == ("Created", CREATED, "Normal")
        assert event["source"] == {"component": "levers9"}
        assert (event["reportingComponent"], event["reportingInstance"]) == ("levers9", "cp-0")
        assert event["count"] == 1
        assert event["firstTimestamp"] == event["lastTimestamp"] == "2027-01-15T08:00:00Z"
        assert event["eventTime"] == "2027-01-15T08:00:00.250000Z"

        clock.now += 60
        await recorder.record(job, "Created", CREATED)
        (repeated,) = _events_of(kube, job)
        assert repeated["metadata"]["name"] == event["metadata"]["name"]
        assert repeated["count"] == 2
        assert repeated["firstTimestamp"] == "2027-01-15T08:00:00Z"
        assert repeated["lastTimestamp"] == "2027-01-15T08:01:00Z"

        # Another reason, or the same words about another Job, is an Event of its own.
        await recorder.record(job, "Deleted", DELETED, "Warning")
        await recorder.record(other, "Created", CREATED)
        assert sorted((e["reason"], e["count"]) for e in _events_of(kube, job)) == [
            ("Created", 2),
            ("Deleted", 1),
        ]
        assert [e["count"] for e in _events_of(kube, other)] == [1]

        # Ten minutes after the last one, the same words start a new Event.
        clock.now += 600
        await recorder.record(job, "Created", CREATED)
        assert sorted(e["count"] for e in _events_of(kube, job) if e["reason"] == "Created") == [
            1,
            2,
        ]
    assert recorder.statistics().created == 4
    assert recorder.statistics().patched == 1


async def test_a_repeat_of_a_vanished_event_makes_a_new_one(kube: KubeStandin) -> None:
    kube.add_namespace(NS)
    clock = Clock()
    async with _client(kube) as kube_client:
        job = await kube_client.create_job(NS, _job_manifest("gpu-node-1-0"))
        recorder = EventRecorder(kube_client, pool="gpu", clock=clock)
        await recorder.record(job, "Created", CREATED)
        (first,) = _events_of(kube, job)
        # The apiserver drops Events after their TTL (an hour by default).
        with kube.api_client() as api:
            client.CoreV1Api(api).delete_namespaced_event(first["metadata"]["name"], NS)
        clock.now += 1
        await recorder.record(job, "Created", CREATED)
    (second,) = _events_of(kube, job)
    assert second["count"] == 1 and second["metadata"]["name"] != first["metadata"]["name"]


async def test_a_role_without_events_leaves_recording_harmless(
    kube: KubeStandin, caplog: pytest.LogCaptureFixture
) -> None:
    # A Role from before Events were recorded: Jobs yes, Events no.
    rules = [dict(r) for r in NAMESPACE_RULES if "events" not in r["resources"]]
    token = _grant(kube, rules)
    caplog.set_level(logging.DEBUG, logger="levers9.kube.events")
    async with _client(kube, token) as kube_client:
        job = await kube_client.create_job(NS, _job_manifest("gpu-node-1-0"))
        recorder = EventRecorder(kube_client, pool="gpu", clock=Clock())
        await recorder.record(job, "Created", CREATED)
        await recorder.record(job, "Deleted", DELETED)
    assert kube.objects("events") == []
    assert recorder.statistics().failed == 2
    warnings = [
        r
        for r in caplog.records
        if r.name == "levers9.kube.events" and r.levelno >= logging.WARNING
    ]
    assert len(warnings) == 1  # once per recorder, the rest at debug
    assert warnings[0].pool == "gpu" and warnings[0].namespace == NS  # type: ignore[attr-defined]
    assert "events create and patch" in warnings[0].getMessage()
    assert token not in caplog.text


async def test_the_spam_filter_drops_beyond_the_burst(kube: KubeStandin) -> None:
    kube.add_namespace(NS)
    clock = Clock()
    async with _client(kube) as kube_client:
        job = await kube_client.create_job(NS, _job_manifest("gpu-node-1-0"))
        recorder = EventRecorder(kube_client, pool="gpu", clock=clock)
        for i in range(30):
            await recorder.record(job, "Created", f"{CREATED} (pass {i})")
        assert len(_events_of(kube, job)) == 25
        assert recorder.statistics().dropped == 5
        # One token back every 5 seconds.
        clock.now += 5
        await recorder.record(job, "Created", f"{CREATED} (pass 30)")
        await recorder.record(job, "Created", f"{CREATED} (pass 31)")
    assert len(_events_of(kube, job)) == 26
    assert recorder.statistics().dropped == 6


async def test_kubectl_describe_job_shows_what_levers9_did(
    kube: KubeStandin, kubeconfig: Path
) -> None:
    kube.add_namespace(NS)
    async with _client(kube) as kube_client:
        job = await kube_client.create_job(NS, _job_manifest("gpu-node-1-0"))
        recorder = EventRecorder(kube_client, pool="gpu")
        await recorder.record(job, "Created", CREATED)
        await recorder.record(job, "Deleted", DELETED, "Warning")
    describe = ["describe", "job", "gpu-node-1-0", "-n", NS]
    with trio.fail_after(60):
        done = await trio.run_process(
            ["/usr/bin/kubectl", "--kubeconfig", str(kubeconfig), *describe],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert done.returncode == 0, done.stderr.decode()
    events = done.stdout.decode().split("Events:", 1)[1]
    assert re.search(rf"Normal\s+Created\s+.*levers9\s+{re.escape(CREATED)}", events)
    assert re.search(rf"Warning\s+Deleted\s+.*levers9\s+{re.escape(DELETED)}", events)


class _DownApi:
    """An API server that answers nothing."""

    def __init__(self) -> None:
        self.calls = 0

    async def create_event(self, namespace: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
        self.calls += 1
        raise KubeUnavailable("pool gpu: cannot create events: the API server did not answer")

    async def patch_event(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        raise AssertionError("nothing was created, so nothing is patched")


async def test_an_unavailable_api_server_is_swallowed(caplog: pytest.LogCaptureFixture) -> None:
    api = _DownApi()
    recorder = EventRecorder(api, pool="gpu", clock=Clock())
    job = {"metadata": {"name": "gpu-node-1-0", "namespace": NS, "uid": "u-1"}}
    with caplog.at_level(logging.DEBUG, logger="levers9.kube.events"):
        await recorder.record(job, "Created", CREATED)
        await recorder.record(job, "Created", CREATED)
    assert api.calls == 2  # a failed create is not remembered as made
    ours = [r.levelno for r in caplog.records if r.name == "levers9.kube.events"]
    assert ours == [logging.DEBUG, logging.DEBUG]


def test_event_manifest_checks_and_cuts() -> None:
    job = {"metadata": {"name": "w", "namespace": NS, "uid": "u-1"}}
    long = event_manifest(job, "Deleted", "x" * 2000, now_s=0.0, instance="i" * 200)
    assert len(long["message"]) == 1024 and len(long["reportingInstance"]) == 128
    assert long["metadata"]["name"] == "w.0000000000000000"
    assert long["action"] == "Deleted" and long["eventTime"] == "1970-01-01T00:00:00.000000Z"
    with pytest.raises(ValueError, match="CamelCase"):
        event_manifest(job, "node cordoned", "m", now_s=0.0, instance="i")
    with pytest.raises(ValueError, match="Normal"):
        event_manifest(job, "Created", "m", "Error", now_s=0.0, instance="i")
    with pytest.raises(ValueError, match=r"metadata\.name"):
        event_manifest({"metadata": {"name": "w"}}, "Created", "m", now_s=0.0, instance="i")
