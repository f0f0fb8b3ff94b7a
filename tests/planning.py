"""The controlplane's pool planner over Kubernetes objects as the API returns them, for tests
that hold a stand-in's or a hand-written list of objects. The product plans from the facts its
watch caches keep (`control.kube.caches`), never from whole objects, so this lives here."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from control.kube.manifests import PoolSettings
from control.kube.planner import Plan, WorkerRecord, job_facts, node_facts, plan_pool, pod_facts


def plan_objects(
    settings: PoolSettings,
    nodes: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    jobs: Iterable[Mapping[str, Any]],
    records: Iterable[WorkerRecord],
    now: float,
    **kw: Any,
) -> Plan:
    """`plan_pool` over whole objects, through the facts a cache would keep of them."""
    return plan_pool(
        settings,
        [node_facts(n) for n in nodes],
        [f for f in map(pod_facts, pods) if f is not None],
        [f for f in map(job_facts, jobs) if f is not None],
        records,
        now,
        **kw,
    )
