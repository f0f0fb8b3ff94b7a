"""Clusters that refuse privileged pods: Pod Security Admission and GKE Autopilot, as levers9
meets them.

Why: a worker is a privileged pod (hostNetwork, hostPath volumes, a privileged container). A
namespace labelled `pod-security.kubernetes.io/enforce: baseline` or `restricted` (or a
cluster whose AdmissionConfiguration defaults to one) lets the worker Job be created and then
refuses every pod its Job controller makes; GKE Autopilot's admission refuses them outright.
Without a word from levers9 the pool would show a pending worker forever, so the join checks
the namespace first and labels the one it creates, and the reconciler reads the Job
controller's `FailedCreate` Events about our Jobs and shows their words on the node.

Design: everything here is pure (labels in, a decision and its words out); the Kubernetes
adapter, `cluster join` and the reconcile loop do the I/O. The words always say what to run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from control.kube.planner import JobFacts

__all__ = [
    "AUTOPILOT_ADVICE",
    "ENFORCE_LABEL",
    "EVENTS_SELECTOR",
    "PRIVILEGED_LABELS",
    "enforce_level",
    "label_command",
    "namespace_refusal",
    "pod_refusal",
    "refusal_advice",
    "refused_nodes",
    "worker_refusal",
]

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
PRIVILEGED_LABELS: Mapping[str, str] = {ENFORCE_LABEL: "privileged"}
"""On a namespace levers9 creates: its worker pods are privileged."""
FAILED_CREATE = "FailedCreate"
"""The reason of the Job controller's Event when it cannot create a Job's pod."""
EVENTS_SELECTOR = f"involvedObject.kind=Job,reason={FAILED_CREATE}"
AUTOPILOT_ADVICE = (
    "GKE Autopilot does not admit privileged pods (a levers9 worker needs privileged, "
    "hostNetwork and hostPath); use a GKE Standard cluster and its GPU node pools"
)
_ERROR_CREATING = "Error creating: "
_COMBINED = "(combined from similar events): "
_POD_FORBIDDEN = re.compile(r'pods "[^"]*" is forbidden: ')


def label_command(namespace: str) -> str:
    """What lets privileged pods into `namespace`."""
    return f"kubectl label namespace {namespace} {ENFORCE_LABEL}=privileged --overwrite"


def enforce_level(namespace: Mapping[str, Any]) -> str | None:
    """The Pod Security level a Namespace object's label enforces, as written; None when it
    has no such label (the cluster's default then decides)."""
    labels = (namespace.get("metadata") or {}).get("labels") or {}
    level = labels.get(ENFORCE_LABEL)
    return None if level is None else str(level)


def namespace_refusal(namespace: str, found: Mapping[str, Any]) -> str | None:
    """Why worker pods would be refused in `namespace` (the Namespace object as found), or
    None: its enforce label is set to anything but `privileged` (baseline, restricted, or a
    level Pod Security does not know and evaluates strictly)."""
    level = enforce_level(found)
    if level is None or level == "privileged":
        return None
    return (
        f"namespace {namespace} is labelled {ENFORCE_LABEL}={level}: Pod Security admission "
        "refuses levers9's worker pods there (they are privileged, with hostNetwork and "
        f"hostPath volumes). Run `{label_command(namespace)}` (with your own kubeconfig) and "
        "join again, or join with another --namespace"
    )


def refusal_advice(message: str, namespace: str) -> str:
    """What to do about the cluster's refusal `message` of a worker pod in `namespace`: relabel
    the namespace (Pod Security), leave Autopilot, or "" when the words say neither."""
    if "violates PodSecurity" in message:
        return f"run `{label_command(namespace)}`"
    if "Autopilot" in message:
        return AUTOPILOT_ADVICE
    return ""


def pod_refusal(event: Mapping[str, Any]) -> str | None:
    """The cluster's words in a Warning `FailedCreate` Event about a Job (without the Job
    controller's `Error creating: `, the correlator's `(combined from similar events): ` and
    the pod's name), or None for any other Event."""
    if event.get("reason") != FAILED_CREATE or event.get("type") != "Warning":
        return None
    if (event.get("involvedObject") or {}).get("kind") != "Job":
        return None
    message = str(event.get("message") or "")
    message = message.removeprefix(_COMBINED).removeprefix(_ERROR_CREATING)
    return _POD_FORBIDDEN.sub("", message, count=1).strip() or None


def worker_refusal(job: str, namespace: str, words: str) -> str:
    """What a node shows while the cluster refuses its worker's pods (`words`, from
    `pod_refusal`), and what to run."""
    advice = refusal_advice(words, namespace)
    shown = f"worker Job {job}: pods refused by the cluster: {words}"
    return f"{shown}; {advice}" if advice else shown


def _newest_first(event: Mapping[str, Any]) -> str:
    # RFC 3339 in UTC, so the text sorts as the time does.
    return str(event.get("lastTimestamp") or event.get("eventTime") or "")


def refused_nodes(
    namespace: str, jobs: Iterable[JobFacts], events: Iterable[Mapping[str, Any]]
) -> dict[str, str]:
    """Node -> why its worker's pods are refused, for each live Job of ours in `namespace`
    that has no pod (`JobFacts.pods` 0) and a `FailedCreate` Event about it (matched by the
    Job's uid, or by name where an Event names no uid); the newest Event speaks. A Job that
    has a pod shows nothing: the refusal has passed."""
    waiting = {job.name: job for job in jobs if job.active and job.pods == 0}
    said: dict[str, tuple[str, str]] = {}
    for event in sorted(events, key=_newest_first):
        involved = event.get("involvedObject") or {}
        job = waiting.get(str(involved.get("name") or ""))
        if job is None or (involved.get("uid") and job.uid and involved["uid"] != job.uid):
            continue
        words = pod_refusal(event)
        if words is not None:
            said[job.name] = (job.node, words)
    return {node: worker_refusal(name, namespace, words) for name, (node, words) in said.items()}
