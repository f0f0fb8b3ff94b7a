"""apps/v1 Deployments in the stand-in: defaulting and validation, the `scale` subresource, and
a Deployment controller that keeps `spec.replicas` pods, run synchronously inside the request
that changes what it reads (a Deployment, a pod, a node), as the garbage collector is.

Design choices:
- No ReplicaSets. A Deployment owns its pods directly (a controller ownerReference, so deleting
  it deletes them through the store's cascade); they are named `<deployment>-<hash>-<5 chars>`
  and labelled `pod-template-hash` as a ReplicaSet's would be.
- Nothing runs in a pod, so nothing paces a rollout: a changed template replaces every old pod
  at once, and a pod the scheduler (`sim.kubeapi.scheduler`) binds is Running and Ready at once.
  One that fits nowhere stays Pending and unbound, with the scheduler's reason, until a later
  change makes room (a pod deleted, a node added or changed).
- Scaling down deletes unbound, then not running, then unready pods, newest first among equals,
  as the ReplicaSet controller ranks them.
- What to do is decided by pure functions (`plan_pods`, `deployment_status`, `scale_of`,
  `pick_node`); `DeploymentController.sync` carries it out on the store.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from sim.kubeapi.model import Key, KubeError, Obj, Resource, resource_of
from sim.kubeapi.objects import owner_reference, timestamp_now
from sim.kubeapi.scheduler import TERMINAL_PHASES, Unschedulable, pick_node

POD_TEMPLATE_HASH = "pod-template-hash"
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
"""The letters of the apiserver's generated names (no vowels, no look-alike digits)."""


# -- the label selector of a Deployment (an object, not the query string)


def _expression_matches(expression: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key = str(expression.get("key") or "")
    values = {str(v) for v in expression.get("values") or ()}
    op = expression.get("operator")
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    return op == "DoesNotExist" and key not in labels


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels and matchExpressions) selects `labels`."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    return all(_expression_matches(e, labels) for e in selector.get("matchExpressions") or ())


def selector_text(selector: Mapping[str, Any]) -> str:
    """A LabelSelector in the query syntax, as a Scale's `status.selector` gives it."""
    terms = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expression in selector.get("matchExpressions") or ():
        key, op = expression.get("key"), expression.get("operator")
        values = ",".join(sorted(str(v) for v in expression.get("values") or ()))
        if op in ("In", "NotIn"):
            terms.append(f"{key} {op.lower()} ({values})")
        elif op == "Exists":
            terms.append(str(key))
        elif op == "DoesNotExist":
            terms.append(f"!{key}")
    return ",".join(terms)


# -- defaulting, validation and the scale subresource


def _invalid(kind: str, group: str, name: str, problems: Sequence[str]) -> KubeError:
    listed = problems[0] if len(problems) == 1 else f"[{', '.join(problems)}]"
    return KubeError(
        422,
        "Invalid",
        f'{kind}.{group} "{name}" is invalid: {listed}',
        {"name": name, "group": group, "kind": kind},
    )


def _replica_problem(replicas: object) -> str | None:
    if isinstance(replicas, int) and not isinstance(replicas, bool) and replicas >= 0:
        return None
    return (
        f"spec.replicas: Invalid value: {json.dumps(replicas)}: must be greater than or equal to 0"
    )


def prepare_deployment(deployment: Obj, old: Obj | None) -> Obj:
    """A Deployment as the apiserver stores it on create (`old` None) or update: validated
    (KubeError 422), defaulted, with `metadata.generation` counting changes of its spec."""
    meta = deployment["metadata"]
    spec = dict(deployment.get("spec") or {})
    spec.setdefault("replicas", 1)
    template = spec.get("template") or {}
    labels = (template.get("metadata") or {}).get("labels") or {}
    selector = spec.get("selector")
    problems = [p for p in (_replica_problem(spec["replicas"]),) if p]
    if not isinstance(selector, dict) or not (
        selector.get("matchLabels") or selector.get("matchExpressions")
    ):
        problems.append("spec.selector: Required value")
    elif not selector_matches(selector, labels):
        problems.append(
            f"spec.template.metadata.labels: Invalid value: {json.dumps(labels)}: `selector` "
            "does not match template `labels`"
        )
    elif old is not None and old["spec"].get("selector") != selector:
        problems.append(f"spec.selector: Invalid value: {json.dumps(selector)}: field is immutable")
    if not (template.get("spec") or {}).get("containers"):
        problems.append("spec.template.spec.containers: Required value")
    if problems:
        raise _invalid("Deployment", "apps", meta["name"], problems)
    strategy = dict(spec.get("strategy") or {})
    strategy.setdefault("type", "RollingUpdate")
    if strategy["type"] == "RollingUpdate":
        strategy["rollingUpdate"] = {
            "maxUnavailable": "25%",
            "maxSurge": "25%",
            **(strategy.get("rollingUpdate") or {}),
        }
    spec["strategy"] = strategy
    spec.setdefault("revisionHistoryLimit", 10)
    spec.setdefault("progressDeadlineSeconds", 600)
    generation = 1
    if old is not None:
        generation = int(old["metadata"].get("generation") or 1)
        if old.get("spec") != spec:
            generation += 1
    return {
        **deployment,
        "metadata": {**meta, "generation": generation},
        "spec": spec,
        "status": deployment.get("status") or {},
    }


def scale_of(deployment: Obj) -> Obj:
    """The Deployment's autoscaling/v1 Scale, as its `scale` subresource answers it."""
    meta = deployment["metadata"]
    spec = deployment.get("spec") or {}
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            key: meta[key]
            for key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            if key in meta
        },
        "spec": {"replicas": spec.get("replicas", 1)},
        "status": {
            "replicas": (deployment.get("status") or {}).get("replicas", 0),
            "selector": selector_text(spec.get("selector") or {}),
        },
    }


def scale_replicas(scale: Obj, name: str) -> int:
    """The replicas a Scale written to the subresource asks for (KubeError 422 if invalid)."""
    replicas = (scale.get("spec") or {}).get("replicas", 0)
    problem = _replica_problem(replicas)
    if problem is not None:
        raise _invalid("Scale", "autoscaling", name, [problem])
    assert isinstance(replicas, int)
    return replicas


# -- pods


def template_hash(template: Obj) -> str:
    """The `pod-template-hash` of a pod template: a 32-bit digest of it, spelt as the
    controller spells it (its decimal digits mapped onto the generated-name letters)."""
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).digest()
    number = str(int.from_bytes(digest[:4], "big"))
    return "".join(_NAME_ALPHABET[ord(c) % len(_NAME_ALPHABET)] for c in number)


def _qos_class(spec: Obj) -> str:
    containers = [*(spec.get("initContainers") or ()), *(spec.get("containers") or ())]
    guaranteed = bool(containers)
    anything = False
    for container in containers:
        resources = container.get("resources") or {}
        limits = resources.get("limits") or {}
        requests = {**limits, **(resources.get("requests") or {})}
        anything = anything or any(k in requests for k in ("cpu", "memory"))
        guaranteed = guaranteed and all(
            k in limits and requests.get(k) == limits[k] for k in ("cpu", "memory")
        )
    if not anything:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def new_pod(deployment: Obj, pod_hash: str) -> Obj:
    """A pod of the Deployment's template, as its ReplicaSet would create it: not yet bound."""
    meta = deployment["metadata"]
    template = deployment["spec"]["template"]
    template_meta = template.get("metadata") or {}
    spec: Obj = {
        "restartPolicy": "Always",
        "dnsPolicy": "ClusterFirst",
        "schedulerName": "default-scheduler",
        "terminationGracePeriodSeconds": 30,
        "securityContext": {},
        **(template.get("spec") or {}),
    }
    spec.setdefault("serviceAccountName", spec.get("serviceAccount") or "default")
    suffix = "".join(secrets.choice(_NAME_ALPHABET) for _ in range(5))
    pod_meta: Obj = {
        "name": f"{meta['name']}-{pod_hash}-{suffix}",
        "namespace": meta["namespace"],
        "labels": {**(template_meta.get("labels") or {}), POD_TEMPLATE_HASH: pod_hash},
        "ownerReferences": [owner_reference(deployment)],
    }
    if template_meta.get("annotations"):
        pod_meta["annotations"] = dict(template_meta["annotations"])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": pod_meta,
        "spec": spec,
        "status": {"phase": "Pending", "qosClass": _qos_class(spec)},
    }


def running_pod(pod: Obj, node: str, now: str) -> Obj:
    """`pod` bound to `node` and, as nothing has to start in it, Running and Ready."""
    spec = {**pod["spec"], "nodeName": node}
    digest = hashlib.sha256(str(pod["metadata"].get("uid", "")).encode()).digest()
    conditions = [
        {"type": kind, "status": "True", "lastProbeTime": None, "lastTransitionTime": now}
        for kind in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady")
    ]
    conditions.append(
        {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now}
    )
    status = {
        "phase": "Running",
        "qosClass": pod["status"].get("qosClass", "BestEffort"),
        "conditions": conditions,
        "hostIP": "10.0.0.1",
        "podIP": f"10.244.{digest[0]}.{digest[1] or 1}",
        "startTime": now,
        "containerStatuses": [
            {
                "name": c.get("name", ""),
                "ready": True,
                "started": True,
                "restartCount": 0,
                "image": c.get("image", ""),
                "imageID": "",
                "containerID": "containerd://"
                + hashlib.sha256(digest + str(i).encode()).hexdigest(),
                "state": {"running": {"startedAt": now}},
            }
            for i, c in enumerate(spec.get("containers") or ())
        ],
    }
    return {**pod, "spec": spec, "status": status}


def unschedulable_pod(pod: Obj, why: Unschedulable, now: str) -> Obj:
    """`pod` with the scheduler's reason for leaving it Pending."""
    condition = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": why.message,
        "lastProbeTime": None,
        "lastTransitionTime": now,
    }
    return {**pod, "status": {**pod["status"], "phase": "Pending", "conditions": [condition]}}


def _scheduled_message(pod: Obj) -> str | None:
    for condition in (pod.get("status") or {}).get("conditions") or ():
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return str(condition.get("message") or "")
    return None


def is_ready(pod: Obj) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or ()
    )


def _active(pod: Obj) -> bool:
    """Not finished and not being deleted: a pod the controller counts."""
    phase = (pod.get("status") or {}).get("phase")
    return phase not in TERMINAL_PHASES and not pod["metadata"].get("deletionTimestamp")


def _of_template(pod: Obj, pod_hash: str) -> bool:
    return bool((pod["metadata"].get("labels") or {}).get(POD_TEMPLATE_HASH) == pod_hash)


@attrs.frozen
class PodPlan:
    """What the controller does to one Deployment's pods: delete `doomed`, create `missing`."""

    doomed: tuple[Obj, ...]
    missing: int


def plan_pods(deployment: Obj, pods: Sequence[Obj], born: Mapping[str, int]) -> PodPlan:
    """Every active pod of an old template goes; of the current template's, those beyond
    `spec.replicas` go, worst first (unbound, not running, not ready, then newest by `born`,
    pod uid -> creation order); the rest that `spec.replicas` asks for are created."""
    pod_hash = template_hash(deployment["spec"]["template"])
    active = [p for p in pods if _active(p)]
    old = [p for p in active if not _of_template(p, pod_hash)]
    current = [p for p in active if _of_template(p, pod_hash)]

    def rank(pod: Obj) -> tuple[bool, bool, bool, int]:
        status = pod.get("status") or {}
        return (
            bool(pod["spec"].get("nodeName")),
            status.get("phase") == "Running",
            is_ready(pod),
            -born.get(pod["metadata"]["uid"], 0),
        )

    replicas = int(deployment["spec"].get("replicas", 1))
    extra = sorted(current, key=rank)[: max(len(current) - replicas, 0)]
    return PodPlan(tuple(old + extra), max(replicas - len(current), 0))


# -- status


def _percent_or_count(value: object, replicas: int, round_up: bool) -> int:
    text = str(value if value is not None else 0)
    if text.endswith("%"):
        try:
            share = int(text[:-1]) * replicas
        except ValueError:
            return 0
        return -(-share // 100) if round_up else share // 100
    try:
        return int(text)
    except ValueError:
        return 0


def max_unavailable(deployment: Obj) -> int:
    """How many pods may be unavailable while the Deployment still counts as Available."""
    spec = deployment["spec"]
    replicas = int(spec.get("replicas", 1))
    strategy = spec.get("strategy") or {}
    if strategy.get("type") != "RollingUpdate" or replicas == 0:
        return 0
    rolling = strategy.get("rollingUpdate") or {}
    unavailable = _percent_or_count(rolling.get("maxUnavailable"), replicas, round_up=False)
    surge = _percent_or_count(rolling.get("maxSurge"), replicas, round_up=True)
    if unavailable == 0 and surge == 0:
        unavailable = 1
    return min(unavailable, replicas)


def _condition(
    old: Sequence[Obj], kind: str, status: str, reason: str, message: str, now: str
) -> Obj:
    previous = next((c for c in old if c.get("type") == kind), {})
    same = (previous.get("status"), previous.get("reason"), previous.get("message")) == (
        status,
        reason,
        message,
    )
    return {
        "type": kind,
        "status": status,
        "lastUpdateTime": previous.get("lastUpdateTime", now) if same else now,
        "lastTransitionTime": previous.get("lastTransitionTime", now)
        if previous.get("status") == status
        else now,
        "reason": reason,
        "message": message,
    }


def deployment_status(deployment: Obj, pods: Sequence[Obj], failure: str | None, now: str) -> Obj:
    """The Deployment's status for its pods now (counts left out when 0, as the apiserver
    leaves them out); `failure` is why its last pod create was refused, if it was."""
    spec = deployment["spec"]
    replicas = int(spec.get("replicas", 1))
    pod_hash = template_hash(spec["template"])
    active = [p for p in pods if _active(p)]
    updated = sum(1 for p in active if _of_template(p, pod_hash))
    ready = sum(1 for p in active if is_ready(p))
    generation = int(deployment["metadata"].get("generation") or 1)
    counts = {
        "replicas": len(active),
        "updatedReplicas": updated,
        "readyReplicas": ready,
        "availableReplicas": ready,
        "unavailableReplicas": max(replicas - ready, 0),
    }
    old = (deployment.get("status") or {}).get("conditions") or []
    replica_set = f'ReplicaSet "{deployment["metadata"]["name"]}-{pod_hash}"'
    conditions = [
        _condition(
            old,
            "Available",
            "True",
            "MinimumReplicasAvailable",
            "Deployment has minimum availability.",
            now,
        )
        if ready >= replicas - max_unavailable(deployment)
        else _condition(
            old,
            "Available",
            "False",
            "MinimumReplicasUnavailable",
            "Deployment does not have minimum availability.",
            now,
        ),
        _condition(
            old,
            "Progressing",
            "True",
            "NewReplicaSetAvailable",
            f"{replica_set} has successfully progressed.",
            now,
        )
        if updated == replicas and len(active) == replicas and ready == replicas
        else _condition(
            old, "Progressing", "True", "ReplicaSetUpdated", f"{replica_set} is progressing.", now
        ),
    ]
    if failure is not None:
        conditions.append(_condition(old, "ReplicaFailure", "True", "FailedCreate", failure, now))
    return {
        "observedGeneration": generation,
        **{key: value for key, value in counts.items() if value},
        "conditions": conditions,
    }


# -- the controller


class Store(Protocol):
    """What the controller reads and writes of `KubeStandin`, with its lock held."""

    @property
    def _store(self) -> Mapping[str, Mapping[Key, Any]]: ...

    @property
    def _pods_by_node(self) -> Mapping[str, Mapping[Key, None]]: ...

    def _create(self, res: Resource, ns: str, body: Obj) -> Obj: ...

    def _put(self, plural: str, obj: Obj, create: bool) -> Obj: ...

    def _delete(self, res: Resource, ns: str, name: str, policy: str) -> Obj: ...


def _owned(store: Store) -> dict[str, list[Obj]]:
    """Deployment uid -> the pods it controls, in the store's order."""
    owned: dict[str, list[Obj]] = {}
    for stored in store._store["pods"].values():
        for ref in stored.obj["metadata"].get("ownerReferences") or ():
            if ref.get("kind") == "Deployment" and ref.get("controller"):
                owned.setdefault(str(ref.get("uid")), []).append(stored.obj)
    return owned


def _live(store: Store, key: Key) -> Obj | None:
    """The Deployment at `key`, or None when it or its namespace is gone (a namespace being
    deleted takes its Deployments with it: nothing is made there meanwhile)."""
    stored = store._store["deployments"].get(key)
    if stored is None or ("", key[0]) not in store._store["namespaces"]:
        return None
    obj: Obj = stored.obj
    return obj


def _waiting(pod: Obj) -> bool:
    """Created and not yet bound by the controller (or left Pending by the scheduler)."""
    status = pod.get("status") or {}
    return (
        _active(pod)
        and status.get("phase") == "Pending"
        and not any(
            c.get("type") == "PodScheduled" and c.get("status") == "True"
            for c in status.get("conditions") or ()
        )
    )


class DeploymentController:
    """Keeps every Deployment's pods and status. `sync` runs with the store's lock held after
    each change to a Deployment, a pod or a node; a change it makes itself starts no second
    pass (the pass running finishes the work)."""

    def __init__(self) -> None:
        self._births = itertools.count(1)
        self._born: dict[str, int] = {}
        """Pod uid -> creation order (creationTimestamp counts whole seconds only)."""
        self._failures: dict[str, str] = {}
        """Deployment uid -> why its last pod create was refused."""
        self._syncing = False

    def sync(self, store: Store) -> None:
        if self._syncing or not store._store["deployments"]:
            return
        self._syncing = True
        try:
            keys = sorted(store._store["deployments"])
            owned = _owned(store)
            for key in keys:
                self._scale(store, key, owned)
            owned = _owned(store)
            self._bind(store, keys, owned)
            owned = _owned(store)
            for key in keys:
                self._write_status(store, key, owned)
            live = {uid for pods in owned.values() for uid in (p["metadata"]["uid"] for p in pods)}
            self._born = {uid: n for uid, n in self._born.items() if uid in live}
        finally:
            self._syncing = False

    def _scale(self, store: Store, key: Key, owned: Mapping[str, list[Obj]]) -> None:
        deployment = _live(store, key)
        if deployment is None or deployment["metadata"].get("deletionTimestamp"):
            return
        uid = deployment["metadata"]["uid"]
        plan = plan_pods(deployment, owned.get(uid, []), self._born)
        pods = resource_of("pods")
        for pod in plan.doomed:
            store._delete(pods, key[0], pod["metadata"]["name"], "Background")
        pod_hash = template_hash(deployment["spec"]["template"])
        for _ in range(plan.missing):
            try:
                created = store._create(pods, key[0], new_pod(deployment, pod_hash))
            except KubeError as err:
                # As the ReplicaSet controller reports a refused create (admission, quota).
                self._failures[uid] = err.message
                break
            self._born[created["metadata"]["uid"]] = next(self._births)
        else:
            self._failures.pop(uid, None)

    def _bind(self, store: Store, keys: Sequence[Key], owned: Mapping[str, list[Obj]]) -> None:
        """Binds the Deployments' waiting pods where they fit, oldest first."""
        waiting = [
            pod
            for key in keys
            if (deployment := _live(store, key)) is not None
            for pod in owned.get(deployment["metadata"]["uid"], [])
            if _waiting(pod)
        ]
        if not waiting:
            return
        waiting.sort(key=lambda p: self._born.get(p["metadata"]["uid"], 0))
        nodes = [s.obj for s in store._store["nodes"].values()]
        all_pods = store._store["pods"]
        bound = {
            name: [all_pods[k].obj for k in store._pods_by_node.get(name, {})]
            for name in (str(n["metadata"]["name"]) for n in nodes)
        }
        now = timestamp_now()
        for pod in waiting:
            named = pod["spec"].get("nodeName")
            # A template naming its node skips the scheduler, as it does in a cluster.
            choice = str(named) if named else pick_node(pod, nodes, bound)
            if isinstance(choice, Unschedulable):
                if _scheduled_message(pod) != choice.message:
                    store._put("pods", unschedulable_pod(pod, choice, now), False)
                continue
            stored = store._put("pods", running_pod(pod, choice, now), False)
            bound.setdefault(choice, []).append(stored)

    def _write_status(self, store: Store, key: Key, owned: Mapping[str, list[Obj]]) -> None:
        deployment = _live(store, key)
        if deployment is None:
            return
        uid = deployment["metadata"]["uid"]
        status = deployment_status(
            deployment, owned.get(uid, []), self._failures.get(uid), timestamp_now()
        )
        if status != deployment.get("status"):
            store._put("deployments", {**deployment, "status": status}, False)
