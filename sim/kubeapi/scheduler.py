"""The stand-in's scheduler: which node a pod is bound to, or why none fits.

The stand-in has no kube-scheduler; the Deployment controller binds its own pods with
`pick_node`, synchronously, as a scheduler's one cycle would: the first node in name order that
is Ready, not cordoned, has no NoSchedule/NoExecute taint the pod does not tolerate, matches the
pod's nodeSelector and required node affinity, and has room for the pod's requests
(`nvidia.com/gpu`, cpu, memory and the pod count) beside the pods already bound there; else
the scheduler's message, each node's first failed check counted. No scoring, no preemption, no
inter-pod affinity.

Requests are counted as the scheduler's `computePodResourceRequest` counts them, written here
from Kubernetes' rules rather than taken from the controlplane's planner, so that the planner's
counting is checked against another reading (as `sim.kubelet.pod_gpus` is for cards); a
quantity's syntax, which decides nothing, is read by `control.kube.quantities.parse_quantity`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import attrs

from control.kube.quantities import QuantityError, parse_quantity
from sim.kubeapi.model import GPU, Obj

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


def quantity(value: object) -> Fraction:
    """A resource quantity ("500m", "32Gi", "1e3", 4) as a number, read as the controlplane reads
    it (the syntax is Kubernetes'; only the counting rules below are written again); 0 when it
    does not parse (the apiserver would have refused it; the stand-in does not validate pods)."""
    if not isinstance(value, (str, int, float)):
        return Fraction(0)
    try:
        return parse_quantity(value)
    except QuantityError:
        return Fraction(0)


@attrs.frozen
class Request:
    """What a pod asks of a node, or what a node offers: cards, cpu in millicores, memory in
    bytes (rounded up, as the scheduler rounds)."""

    gpus: int = 0
    cpu_millis: int = 0
    memory_bytes: int = 0

    def __add__(self, other: Request) -> Request:
        return Request(
            self.gpus + other.gpus,
            self.cpu_millis + other.cpu_millis,
            self.memory_bytes + other.memory_bytes,
        )

    def most(self, other: Request) -> Request:
        """The larger of each resource."""
        return Request(
            max(self.gpus, other.gpus),
            max(self.cpu_millis, other.cpu_millis),
            max(self.memory_bytes, other.memory_bytes),
        )


def _ceil(value: Fraction) -> int:
    return -((-value.numerator) // value.denominator)


def _of(amounts: Mapping[str, Any]) -> Request:
    return Request(
        _ceil(quantity(amounts.get(GPU, 0))),
        _ceil(quantity(amounts.get("cpu", 0)) * 1000),
        _ceil(quantity(amounts.get("memory", 0))),
    )


def _container_request(container: Mapping[str, Any]) -> Request:
    resources = container.get("resources") or {}
    limits = resources.get("limits") or {}
    # The apiserver defaults a request to its limit when only the limit is given (and an
    # extended resource's request must equal its limit).
    return _of({**limits, **(resources.get("requests") or {})})


def pod_request(pod: Mapping[str, Any]) -> Request:
    """What the scheduler reserves for `pod`: its app containers side by side; an init
    container alone but for the sidecars (`restartPolicy: Always`) started before it, which
    keep running beside the app containers; the larger of the two, plus `spec.overhead`."""
    spec = pod.get("spec") or {}
    total = Request()
    for container in spec.get("containers") or ():
        total += _container_request(container)
    sidecars = Request()
    init_peak = Request()
    for container in spec.get("initContainers") or ():
        own = _container_request(container)
        if container.get("restartPolicy") == "Always":
            sidecars += own
            total += own
            init_peak = init_peak.most(sidecars)
        else:
            init_peak = init_peak.most(own + sidecars)
    return total.most(init_peak) + _of(spec.get("overhead") or {})


def _ready(node: Obj) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (node.get("status") or {}).get("conditions") or ()
    )


def _tolerates(taint: Mapping[str, Any], tolerations: Iterable[Mapping[str, Any]]) -> bool:
    for toleration in tolerations:
        effect = toleration.get("effect")
        if effect and effect != taint.get("effect"):
            continue
        key = toleration.get("key")
        if toleration.get("operator") == "Exists":
            if not key or key == taint.get("key"):
                return True
        elif key == taint.get("key") and (toleration.get("value") or "") == (
            taint.get("value") or ""
        ):
            return True
    return False


def _expression_matches(
    expression: Mapping[str, Any], labels: Mapping[str, str], name: str, field: bool
) -> bool:
    key = str(expression.get("key") or "")
    values = [str(v) for v in expression.get("values") or ()]
    present = key == "metadata.name" if field else key in labels
    value = name if field else labels.get(key, "")
    op = expression.get("operator")
    if op == "In":
        return present and value in values
    if op == "NotIn":
        return not present or value not in values
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt") and present and len(values) == 1:
        try:
            number, bound = int(value), int(values[0])
        except ValueError:
            return False
        return number > bound if op == "Gt" else number < bound
    return False


def _affinity_matches(spec: Mapping[str, Any], node: Obj) -> bool:
    """The pod's nodeSelector and required node affinity (its terms ORed, each term's
    expressions ANDed); preferred terms and pod (anti-)affinity are not modelled."""
    meta = node.get("metadata") or {}
    labels: Mapping[str, str] = meta.get("labels") or {}
    name = str(meta.get("name") or "")
    selector: Mapping[str, str] = spec.get("nodeSelector") or {}
    if any(labels.get(k) != v for k, v in selector.items()):
        return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        return True
    return any(
        all(_expression_matches(e, labels, name, False) for e in term.get("matchExpressions") or ())
        and all(_expression_matches(e, labels, name, True) for e in term.get("matchFields") or ())
        for term in terms
    )


@attrs.frozen
class Unschedulable:
    """No node fits; `message` is the scheduler's, as a pod's PodScheduled condition shows it."""

    message: str


def _misfit(pod: Obj, request: Request, node: Obj, bound: Sequence[Obj]) -> list[str]:
    """Why `node` cannot take `pod` (the scheduler's reasons), or [] when it can."""
    spec = pod.get("spec") or {}
    node_spec = node.get("spec") or {}
    if node_spec.get("unschedulable"):
        return ["node(s) were unschedulable"]
    taints = list(node_spec.get("taints") or ())
    if not _ready(node):
        # The node lifecycle controller's taint, which no pod tolerates by default.
        taints.append({"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"})
    for taint in taints:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(
            taint, spec.get("tolerations") or ()
        ):
            return [
                f"node(s) had untolerated taint {{{taint.get('key')}: {taint.get('value', '')}}}"
            ]
    if not _affinity_matches(spec, node):
        return ["node(s) didn't match Pod's node affinity/selector"]
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    offered = _of(allocatable)
    active = [p for p in bound if (p.get("status") or {}).get("phase") not in TERMINAL_PHASES]
    used = Request()
    for other in active:
        used += pod_request(other)
    reasons = []
    if len(active) + 1 > int(quantity(allocatable.get("pods", 110))):
        reasons.append("Too many pods")
    for wanted, offer, taken, label in (
        (request.cpu_millis, offered.cpu_millis, used.cpu_millis, "cpu"),
        (request.memory_bytes, offered.memory_bytes, used.memory_bytes, "memory"),
        (request.gpus, offered.gpus, used.gpus, GPU),
    ):
        if wanted > 0 and wanted > offer - taken:
            reasons.append(f"Insufficient {label}")
    return reasons


def pick_node(
    pod: Obj, nodes: Sequence[Obj], bound: Mapping[str, Sequence[Obj]]
) -> str | Unschedulable:
    """The node to bind `pod` to (the first that fits, in name order), or why none fits.
    `bound` holds the pods bound to each node now; a pod whose template names a node
    (`spec.nodeName`) is not scheduled at all and is not asked about."""
    request = pod_request(pod)
    reasons: Counter[str] = Counter()
    ordered = sorted(nodes, key=lambda n: str(n["metadata"]["name"]))
    for node in ordered:
        name = str(node["metadata"]["name"])
        misfit = _misfit(pod, request, node, bound.get(name, ()))
        if not misfit:
            return name
        reasons.update(misfit)
    listed = ", ".join(sorted(f"{count} {reason}" for reason, count in reasons.items()))
    return Unschedulable(
        f"0/{len(ordered)} nodes are available: {listed}."
        if listed
        else "no nodes available to schedule pods"
    )
