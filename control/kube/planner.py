"""The reconcile planner: Kubernetes nodes, pods and Jobs in; machines and Job actions out.

Everything here is pure. The caller keeps nodes, pods and our Jobs as the few facts the rules
read (`node_facts`, `pod_facts`, `job_facts` make them from the API's JSON dicts, so a cache of
thousands of nodes and a hundred thousand pods stays small), hands them over with the worker
records and the time, and carries out the returned `Plan`; no function here performs I/O, so
every rule (what is a machine, what is free, when to start or stop a worker) is unit-tested
directly and stays the same whichever client applies it. Two facts are equal exactly when the
rules would decide the same from them, so a cache wakes the planner only for changes that
matter.

Free resources are counted as the scheduler counts them: allocatable minus every non-terminal
pod bound to the node, Pending included (GPUs from limits, CPU and memory from requests, see
`pod_request`). The planner indexes pods by node once, so one pass is linear in pods + nodes.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import attrs

from control.models import WorkerState
from wire.errors import ApiError, ErrorCode

GPU_RESOURCE = "nvidia.com/gpu"
NAME_LABEL = "app.kubernetes.io/name"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
POOL_LABEL = "levers9.dev/pool"
NODE_LABEL = "levers9.dev/node"
GENERATION_LABEL = "levers9.dev/generation"
# The full node name: a label value is at most 63 characters, a node name up to 253.
NODE_ANNOTATION = "levers9.dev/node"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
"""Set by the Job controller on its pods (with the older `job-name`)."""
WORKER_NAME = "levers9-worker"
MANAGER = "levers9"
TOKEN_KEY = "token"
TERMINATION_GRACE_S = 60
POD_RESOURCES_DIR = "/var/lib/kubelet/pod-resources"
GPU_MODEL_LABELS = (
    "cloud.google.com/gke-accelerator",
    "nvidia.com/gpu.product",
    "karpenter.k8s.aws/instance-gpu-name",
)
DEFAULT_TOLERATIONS: tuple[Mapping[str, Any], ...] = ({"key": GPU_RESOURCE, "operator": "Exists"},)
EXPIRE_AFTER_S = 600.0
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
MAX_NAME_CHARS = 63


class QuantityError(ApiError):
    """A Kubernetes resource quantity that does not parse."""

    def __init__(self, text: object, field: str | None = None) -> None:
        super().__init__(
            ErrorCode.INVALID_ARGUMENT,
            f"{text!r} is not a Kubernetes quantity; write a number with an optional suffix "
            "(m, k, M, G, T, P, E, Ki, Mi, Gi, Ti, Pi, Ei or an exponent such as e3)",
            field=field,
        )


# --- quantities -----------------------------------------------------------------------------

_QUANTITY = re.compile(r"([+-]?)(\d+\.?\d*|\.\d+)(.*)")
_SUFFIXES: Mapping[str, Fraction] = {
    "": Fraction(1),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
}
_EXPONENT = re.compile(r"[eE]([+-]?\d+)")


@functools.lru_cache(maxsize=4096)
def _parse_text(text: str) -> Fraction:
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise QuantityError(text)
    sign, number, suffix = match.groups()
    # A bare "E" is exa; "e3"/"E3" is an exponent (Kubernetes checks the exact suffixes first).
    multiplier = _SUFFIXES.get(suffix)
    if multiplier is None:
        exponent = _EXPONENT.fullmatch(suffix)
        if exponent is None:
            raise QuantityError(text)
        multiplier = Fraction(10) ** int(exponent.group(1))
    value = Fraction(number) * multiplier
    return -value if sign == "-" else value


def parse_quantity(value: str | int | float, *, field: str | None = None) -> Fraction:
    """A Kubernetes quantity ("500m", "1.5", "1Gi", "100M", "1e3") as an exact number."""
    if isinstance(value, bool):
        raise QuantityError(value, field)
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        return Fraction(value)
    try:
        return _parse_text(value.strip())
    except QuantityError:
        raise QuantityError(value, field) from None


def _ceil(value: Fraction) -> int:
    return -((-value.numerator) // value.denominator)


def cpu_millis(value: str | int | float, *, field: str | None = None) -> int:
    """CPU in millicores, rounded up as Kubernetes' MilliValue does ("1.5" -> 1500)."""
    if isinstance(value, str):
        try:
            return _cpu_text(value)
        except QuantityError:
            raise QuantityError(value, field) from None
    return _ceil(parse_quantity(value, field=field) * 1000)


def memory_bytes(value: str | int | float, *, field: str | None = None) -> int:
    """Memory (or any count) in whole units, rounded up as Kubernetes' Value does."""
    if isinstance(value, str):
        try:
            return _count_text(value)
        except QuantityError:
            raise QuantityError(value, field) from None
    return _ceil(parse_quantity(value, field=field))


# A cluster repeats a handful of quantity strings across thousands of pods; parse each once.
@functools.lru_cache(maxsize=4096)
def _cpu_text(text: str) -> int:
    return _ceil(_parse_text(text.strip()) * 1000)


@functools.lru_cache(maxsize=4096)
def _count_text(text: str) -> int:
    return _ceil(_parse_text(text.strip()))


# --- pod requests ---------------------------------------------------------------------------


@attrs.frozen
class Resources:
    gpus: int = 0
    cpu_millis: int = 0
    memory_bytes: int = 0

    def __add__(self, other: Resources) -> Resources:
        return Resources(
            self.gpus + other.gpus,
            self.cpu_millis + other.cpu_millis,
            self.memory_bytes + other.memory_bytes,
        )

    def __sub__(self, other: Resources) -> Resources:
        return Resources(
            self.gpus - other.gpus,
            self.cpu_millis - other.cpu_millis,
            self.memory_bytes - other.memory_bytes,
        )

    def at_least_zero(self) -> Resources:
        return Resources(max(self.gpus, 0), max(self.cpu_millis, 0), max(self.memory_bytes, 0))


_Triple = tuple[int, int, int]  # (gpus, cpu millis, memory bytes): cheaper than Resources


def _triple(requests: Mapping[str, Any], gpus_from: Mapping[str, Any]) -> _Triple:
    gpus = gpus_from.get(GPU_RESOURCE)
    cpu = requests.get("cpu")
    memory = requests.get("memory")
    return (
        memory_bytes(gpus) if gpus is not None else 0,
        cpu_millis(cpu) if cpu is not None else 0,
        memory_bytes(memory) if memory is not None else 0,
    )


def _list_resources(requests: Mapping[str, Any], gpus_from: Mapping[str, Any]) -> Resources:
    return Resources(*_triple(requests, gpus_from))


def _container_request(container: Mapping[str, Any]) -> _Triple:
    resources = container.get("resources")
    if not resources:
        return (0, 0, 0)
    requests = resources.get("requests") or {}
    limits = resources.get("limits") or {}
    # An extended resource's request must equal its limit, and defaults to it when only the
    # limit is set; taking the limit first covers both.
    return _triple(requests, limits if GPU_RESOURCE in limits else requests)


def pod_request(pod: Mapping[str, Any]) -> Resources:
    """What the scheduler reserves for `pod`, as its `computePodResourceRequest` does.

    App containers are summed. Init containers run one at a time, so the pod needs the largest
    of them, except sidecars (init containers with `restartPolicy: Always`): they keep running,
    so each one is added to the sum of app containers, and every init container started after
    a sidecar needs the sidecars started before it on top of its own request. The pod reserves
    the larger of the two, plus `spec.overhead`. Pod-level `spec.resources` is not read.
    """
    return Resources(*_pod_triple(pod))


def _pod_triple(pod: Mapping[str, Any]) -> _Triple:
    spec = pod.get("spec") or {}
    gpus = cpu = memory = 0
    for container in spec.get("containers") or ():
        g, c, m = _container_request(container)
        gpus, cpu, memory = gpus + g, cpu + c, memory + m
    init_containers = spec.get("initContainers")
    if init_containers:
        side_g = side_c = side_m = 0
        peak_g = peak_c = peak_m = 0
        for container in init_containers:
            g, c, m = _container_request(container)
            if container.get("restartPolicy") == "Always":
                gpus, cpu, memory = gpus + g, cpu + c, memory + m
                side_g, side_c, side_m = side_g + g, side_c + c, side_m + m
                g, c, m = side_g, side_c, side_m
            else:
                g, c, m = g + side_g, c + side_c, m + side_m
            peak_g, peak_c, peak_m = max(peak_g, g), max(peak_c, c), max(peak_m, m)
        gpus, cpu, memory = max(gpus, peak_g), max(cpu, peak_c), max(memory, peak_m)
    overhead = spec.get("overhead")
    if overhead:
        g, c, m = _triple(overhead, overhead)
        gpus, cpu, memory = gpus + g, cpu + c, memory + m
    return gpus, cpu, memory


# --- selectors and tolerations ---------------------------------------------------------------


@attrs.frozen
class Selector:
    """A label selector: matchLabels and matchExpressions (dicts, as the API has them)."""

    labels: Mapping[str, str] = attrs.field(factory=dict)
    expressions: tuple[Mapping[str, Any], ...] = ()


def _expression_matches(labels: Mapping[str, str], expression: Mapping[str, Any]) -> bool:
    key = expression.get("key", "")
    operator = expression.get("operator")
    values = expression.get("values") or ()
    if operator == "In":
        return key in labels and labels[key] in values
    if operator == "NotIn":
        return key not in labels or labels[key] not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise ApiError(
        ErrorCode.INVALID_ARGUMENT,
        f"selector operator {operator!r} for key {key!r} is not one of In, NotIn, Exists, "
        "DoesNotExist; fix the pool's selector",
        field="selector.matchExpressions",
    )


def selector_matches(labels: Mapping[str, str], selector: Selector) -> bool:
    """Whether a node with `labels` is selected (every label and every expression must hold)."""
    for key, value in selector.labels.items():
        if labels.get(key) != value:
            return False
    return all(_expression_matches(labels, e) for e in selector.expressions)


def label_selector_text(selector: Selector) -> str:
    """The `labelSelector` query parameter that asks the API server for the same nodes."""
    parts = [f"{key}={value}" for key, value in sorted(selector.labels.items())]
    for expression in selector.expressions:
        key = expression.get("key", "")
        operator = expression.get("operator")
        values = ",".join(sorted(expression.get("values") or ()))
        if operator == "In":
            parts.append(f"{key} in ({values})")
        elif operator == "NotIn":
            parts.append(f"{key} notin ({values})")
        elif operator == "Exists":
            parts.append(key)
        elif operator == "DoesNotExist":
            parts.append(f"!{key}")
        else:
            _expression_matches({}, expression)  # raises the error naming the operator
    return ",".join(parts)


def _tolerated(taint: Mapping[str, Any], tolerations: Iterable[Mapping[str, Any]]) -> bool:
    for toleration in tolerations:
        effect = toleration.get("effect") or ""
        if effect and effect != taint.get("effect"):
            continue
        key = toleration.get("key") or ""
        if toleration.get("operator", "Equal") == "Exists":
            if not key or key == taint.get("key"):
                return True
        elif key == taint.get("key") and (toleration.get("value") or "") == (
            taint.get("value") or ""
        ):
            return True
    return False


# --- settings, records, machines ------------------------------------------------------------


@attrs.frozen
class PoolSettings:
    """What the planner needs of a pool's config (the integration maps `PoolConfig` onto it)."""

    name: str
    namespace: str
    image: str
    selector: Selector = Selector()
    tunnel: bool = False
    host_network: bool = True
    tolerations: tuple[Mapping[str, Any], ...] = DEFAULT_TOLERATIONS
    objects_path: str = "/var/lib/levers9"
    driver_path: str = "/home/kubernetes/bin/nvidia"
    idle_minutes: float = 5.0
    reconcile_seconds: float = 15.0
    metrics_port: int | None = None
    """The agent's `/metrics` listener (LEVERS9_METRICS_PORT/HOST); None: off."""
    metrics_host: str = "127.0.0.1"
    ttl_seconds_after_finished: int = 600
    not_ready_grace_s: float = 300.0
    """As long as Kubernetes' own pods tolerate `node.kubernetes.io/not-ready` by default."""
    allow_local_registries: bool = False
    """LEVERS9_ALLOW_LOCAL_REGISTRIES=1: the workers pull from registries on their node."""


@attrs.frozen
class WorkerRecord:
    """The controlplane's record of one worker (Job): pending from creation, ready once the
    agent registers. `last_heartbeat` is None until the first one; times are epoch seconds."""

    job_name: str
    node: str
    state: WorkerState
    created_at: float
    last_heartbeat: float | None = None

    def last_seen(self) -> float:
        return self.created_at if self.last_heartbeat is None else self.last_heartbeat


@attrs.frozen
class WorkerView:
    state: WorkerState
    age_seconds: float
    name: str = ""
    """Its Job's name (the worker's id); empty for a pod left of a deleted Job."""


@attrs.frozen
class Cards:
    total: int
    ours: int
    others: int
    free: int


@attrs.frozen
class Machine:
    """A node we can place a worker on, with what the scheduler leaves free on it."""

    pool: str
    node: str
    hostname: str
    gpu_model: str | None
    cards: Cards
    cpu_free_millis: int
    memory_free_bytes: int
    worker: WorkerView | None
    error: str | None = None
    """Why the last write for this node failed (it is retried on its own backoff)."""

    def to_json(self) -> dict[str, Any]:
        """The `levers9 machine list --json` shape."""
        return {
            "pool": self.pool,
            "node": self.node,
            "gpuModel": self.gpu_model,
            "cards": attrs.asdict(self.cards),
            "cpuFreeMillis": self.cpu_free_millis,
            "memoryFreeBytes": self.memory_free_bytes,
            "worker": None
            if self.worker is None
            else {"state": self.worker.state, "ageSeconds": self.worker.age_seconds},
            "error": self.error,
        }


@attrs.frozen
class NotAMachine:
    node: str
    reason: str


# --- facts: what the rules read of nodes, pods and Jobs ------------------------------------------


@attrs.frozen(slots=True)
class NodeFacts:
    """A node as the rules see it. `labels` holds only the labels a caller asked to keep (the
    pool selectors' keys) and those `machine_of` shows; `ready_since` is when its Ready
    condition last changed (epoch seconds, None when not reported)."""

    name: str
    labels: Mapping[str, str]
    ready: bool
    ready_since: float | None
    unschedulable: bool
    taints: tuple[Mapping[str, str], ...]
    allocatable: tuple[int, int, int]


@attrs.frozen(slots=True)
class PodFacts:
    """A pod bound to a node: its phase and what the scheduler counts for it, whether it is
    one of our workers, and then the Job it belongs to."""

    node: str
    phase: str
    request: tuple[int, int, int]
    ours: bool
    job: str = ""


@attrs.frozen(slots=True)
class JobFacts:
    """One of our worker Jobs: its node, generation, pool label, uid and whether it may run."""

    name: str
    node: str
    generation: int
    created_at: float | None
    active: bool
    pool: str = ""
    uid: str = ""
    pods: int = 0
    """Its pods that exist and have not ended, pending or running (`status.active`): 0 for a
    live Job whose pods the cluster refuses (`control.kube.podsecurity`)."""


_SHOWN_LABELS = frozenset({"kubernetes.io/hostname", *GPU_MODEL_LABELS})


def node_facts(node: Mapping[str, Any], keep_labels: Iterable[str] | None = None) -> NodeFacts:
    """The facts of a Node dict; `keep_labels` limits the labels kept (None keeps all)."""
    metadata = node.get("metadata") or {}
    labels: Mapping[str, str] = metadata.get("labels") or {}
    if keep_labels is not None:
        keep = _SHOWN_LABELS.union(keep_labels)
        labels = {k: v for k, v in labels.items() if k in keep}
    spec = node.get("spec") or {}
    status = node.get("status") or {}
    ready = False
    ready_since = None
    for condition in status.get("conditions") or ():
        if condition.get("type") == "Ready":
            ready = condition.get("status") == "True"
            ready_since = _timestamp(condition.get("lastTransitionTime"))
            break
    allocatable = status.get("allocatable") or {}
    return NodeFacts(
        name=str(metadata.get("name", "")),
        labels=dict(labels),
        ready=ready,
        ready_since=ready_since,
        unschedulable=bool(spec.get("unschedulable")),
        taints=tuple(
            {k: str(t[k]) for k in ("key", "value", "effect") if t.get(k) is not None}
            for t in spec.get("taints") or ()
            if t.get("effect") in ("NoSchedule", "NoExecute")
        ),
        allocatable=_triple(allocatable, allocatable),
    )


def pod_facts(pod: Mapping[str, Any]) -> PodFacts | None:
    """The facts of a Pod dict; None for a pod not bound to a node (it holds nothing yet)."""
    node = (pod.get("spec") or {}).get("nodeName")
    if not node:
        return None
    ours = is_our_worker(pod)
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return PodFacts(
        node=str(node),
        phase=str((pod.get("status") or {}).get("phase") or ""),
        request=_pod_triple(pod),
        ours=ours,
        job=str(labels.get(JOB_NAME_LABEL) or labels.get("job-name") or "") if ours else "",
    )


def job_facts(job: Mapping[str, Any]) -> JobFacts | None:
    """The facts of one of our Job dicts; None for a Job that names no node."""
    metadata = job.get("metadata") or {}
    labels = metadata.get("labels") or {}
    annotations = metadata.get("annotations") or {}
    node = annotations.get(NODE_ANNOTATION) or labels.get(NODE_LABEL)
    if not node:
        return None
    try:
        generation = int(labels.get(GENERATION_LABEL, "0"))
    except ValueError:
        generation = 0
    return JobFacts(
        name=str(metadata.get("name", "")),
        node=str(node),
        generation=generation,
        created_at=_timestamp(metadata.get("creationTimestamp")),
        active=job_active(job),
        pool=str(labels.get(POOL_LABEL, "")),
        uid=str(metadata.get("uid", "")),
        pods=_count((job.get("status") or {}).get("active")),
    )


def _count(value: Any) -> int:
    try:
        return max(int(value or 0), 0)
    except (TypeError, ValueError):
        return 0


def is_our_worker(obj: Mapping[str, Any]) -> bool:
    """A pod or Job of ours, told by its labels."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(MANAGED_BY_LABEL) == MANAGER and labels.get(NAME_LABEL) == WORKER_NAME


def machine_of(
    node: NodeFacts,
    pods: Iterable[PodFacts],
    our_worker: WorkerView | None,
    *,
    pool: str = "",
    tolerations: Iterable[Mapping[str, Any]] = DEFAULT_TOLERATIONS,
) -> Machine | NotAMachine:
    """What `node` offers given the pods bound to it (others are skipped), or why it offers
    nothing. `our_worker` is the state of our worker there, shown on the machine."""
    name = node.name
    if not node.ready:
        return NotAMachine(name, "node is not Ready")
    if node.unschedulable:
        return NotAMachine(name, "node is cordoned (unschedulable)")
    tolerations = tuple(tolerations)
    for taint in node.taints:
        if not _tolerated(taint, tolerations):
            return NotAMachine(
                name, f"node has taint {taint.get('key')}:{taint.get('effect')} not tolerated"
            )
    capacity = Resources(*node.allocatable)
    if capacity.gpus <= 0:
        return NotAMachine(name, f"node has no allocatable {GPU_RESOURCE}")
    ours_g = others_g = used_c = used_m = 0
    for pod in pods:
        if pod.node != name or pod.phase in TERMINAL_PHASES:
            continue
        g, c, m = pod.request
        if pod.ours:
            ours_g += g
        else:
            others_g += g
        used_c += c
        used_m += m
    ours = Resources(ours_g)
    others = Resources(others_g, used_c, used_m)
    free = (capacity - ours - others).at_least_zero()
    # Ours first: the cards our worker holds are ours even where neighbours overcommit.
    ours_cards = min(ours.gpus, capacity.gpus)
    cards = Cards(
        total=capacity.gpus,
        ours=ours_cards,
        others=min(others.gpus, capacity.gpus - ours_cards),
        free=free.gpus,
    )
    if cards.free == 0 and cards.ours == 0:
        return NotAMachine(name, "node is full: other pods hold every card")
    labels = node.labels
    return Machine(
        pool=pool,
        node=name,
        hostname=labels.get("kubernetes.io/hostname", name),
        gpu_model=next((labels[key] for key in GPU_MODEL_LABELS if key in labels), None),
        cards=cards,
        cpu_free_millis=free.cpu_millis,
        memory_free_bytes=free.memory_bytes,
        worker=our_worker,
    )


# --- names ----------------------------------------------------------------------------------


def _dns_part(text: str) -> str:
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-")


def job_name(pool: str, node: str, generation: int) -> str:
    """`levers9-<pool>-<node>-<hash>-<generation>`: a DNS-1123 label of at most 63 characters,
    the same for the same inputs (a retried create collides instead of doubling a worker).
    The hash covers the full pool and node names, so truncation never merges two nodes."""
    digest = hashlib.sha256(f"{pool}\0{node}".encode()).hexdigest()[:8]
    pool_part = _dns_part(pool)[:16].strip("-")
    tail = f"{digest}-{generation}"
    head = f"levers9-{pool_part}-" if pool_part else "levers9-"
    room = MAX_NAME_CHARS - len(head) - len(tail) - 1
    node_part = _dns_part(node)[: max(room, 0)].strip("-")
    return f"{head}{node_part}-{tail}" if node_part else f"{head}{tail}"


def token_secret_name(job: str) -> str:
    return f"{job}-token"


def _label_value(text: str) -> str:
    """`text` when it is a valid label value, else a shortened form with a hash."""
    if re.fullmatch(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?", text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '-', text)[:50].strip('-_.')}-{digest}".strip("-")


# --- the plan -------------------------------------------------------------------------------


@attrs.frozen
class CreateJob:
    node: str
    cards: int
    name: str
    generation: int
    hostname: str


@attrs.frozen
class DeleteJob:
    name: str
    reason: str
    node: str = ""


@attrs.frozen
class CreateSecret:
    """A worker Job whose token Secret is missing (its create failed after the Job's): the
    Secret is made again from the token this controlplane holds."""

    job: str
    node: str


Action = CreateJob | DeleteJob | CreateSecret


@attrs.frozen
class Plan:
    machines: tuple[Machine, ...]
    skipped: tuple[NotAMachine, ...]
    actions: tuple[Action, ...]
    held: tuple[str, ...] = ()
    """Nodes that needed an action but are held (a write not observed yet, or a failed one
    waiting for its retry)."""


def _timestamp(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def _finished(job: Mapping[str, Any]) -> bool:
    status = job.get("status") or {}
    for condition in status.get("conditions") or ():
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return True
    return bool(status.get("succeeded") or status.get("failed"))


def job_active(job: Mapping[str, Any]) -> bool:
    """The Job's worker may still run: not finished and not being deleted."""
    return not _finished(job) and not (job.get("metadata") or {}).get("deletionTimestamp")


def plan_pool(
    settings: PoolSettings,
    nodes: Iterable[NodeFacts],
    pods: Iterable[PodFacts],
    jobs: Iterable[JobFacts],
    records: Iterable[WorkerRecord],
    now: float,
    *,
    expire_after_s: float = EXPIRE_AFTER_S,
    held: Collection[str] = (),
    secrets: Collection[str] | None = None,
    tokens: Collection[str] = (),
    retire: Mapping[str, str] | None = None,
) -> Plan:
    """One reconcile pass for one pool.

    `nodes` are the cached nodes (those not matching the selector are skipped), `pods` the
    bound pods (indexed by node once), `jobs` this pool's worker Jobs, `records` the
    controlplane's worker records. A worker counts on a node while its Job is active (not
    finished, not being deleted, record not expired) or one of our worker pods is still bound
    there (a deleted worker's pod holds its cards until it is gone). Rules:

    - an expired record (no heartbeat for `expire_after_s`, counted from creation while
      pending) deletes its Job; a later pass may then create the next generation;
    - a Job on a node that is no longer a machine (gone, cordoned, untolerated taint, full,
      NotReady for `not_ready_grace_s` or since an unknown time) is deleted; a node NotReady
      for less than that keeps its worker (a flapping kubelet does not cost running tasks)
      but is no machine;
    - a machine with free cards and no worker of ours gets a Job for all its free cards, named
      for the next generation after every Job and record seen for the node;
    - a node with more than one active Job of ours keeps one and the others are deleted: the
      one whose pod holds cards, else the one whose worker registered, else the oldest;
    - with `secrets` (the token Secrets' names): an active Job whose Secret is missing gets
      it again when this controlplane holds its token (`tokens`: the Jobs' names).
    - `retire` (Job name → why) names idle workers the dispatcher gave up so that a waiting
      task can have their cards and the node's free ones together: each such active Job is
      deleted, and its node gets the next worker, for every free card, once the pod is gone.

    Nodes in `held` get no action at all this pass (a write for them was not observed yet, or
    failed and waits for its retry); the plan names those that wanted one.

    A Job without a record is counted as a pending worker and never expired here: after a
    controlplane restart its agent registers again.
    """
    pods_by_node: dict[str, list[PodFacts]] = {}
    for pod in pods:
        pods_by_node.setdefault(pod.node, []).append(pod)
    records_by_job = {record.job_name: record for record in records}
    generations: dict[str, int] = {}
    for known in records_by_job.values():
        # An expired record outlives its deleted Job, so the next name must still move on.
        tail = known.job_name.rpartition("-")[2]
        if tail.isdigit():
            generations[known.node] = max(generations.get(known.node, -1), int(tail))
    live_jobs: dict[str, list[JobFacts]] = {}
    actions: list[Action] = []
    for job in jobs:
        generations[job.node] = max(generations.get(job.node, -1), job.generation)
        record = records_by_job.get(job.name)
        if job.active and record is not None and now - record.last_seen() >= expire_after_s:
            actions.append(
                DeleteJob(job.name, f"no heartbeat for {int(now - record.last_seen())} s", job.node)
            )
            continue
        if job.active and retire is not None and job.name in retire:
            actions.append(DeleteJob(job.name, retire[job.name], job.node))
            continue
        if job.active:
            live_jobs.setdefault(job.node, []).append(job)
    for node_name, node_jobs in live_jobs.items():
        if len(node_jobs) > 1:
            keep = _worker_to_keep(node_jobs, pods_by_node.get(node_name, ()), records_by_job)
            actions.extend(
                DeleteJob(job.name, f"surplus worker on {node_name}: {keep[1]}", node_name)
                for job in node_jobs
                if job is not keep[0]
            )
            live_jobs[node_name] = [keep[0]]
        if secrets is not None:
            actions.extend(
                CreateSecret(job.name, node_name)
                for job in live_jobs[node_name]
                if token_secret_name(job.name) not in secrets and job.name in tokens
            )

    machines: list[Machine] = []
    skipped: list[NotAMachine] = []
    seen_nodes: set[str] = set()
    for node in nodes:
        name = node.name
        if not selector_matches(node.labels, settings.selector):
            continue
        seen_nodes.add(name)
        node_jobs = live_jobs.get(name, [])
        view = _worker_view(node_jobs, records_by_job, now)
        node_pods = pods_by_node.get(name, ())
        result = machine_of(
            node, node_pods, view, pool=settings.name, tolerations=settings.tolerations
        )
        if isinstance(result, NotAMachine):
            skipped.append(result)
            if not _in_not_ready_grace(node, settings, now):
                actions.extend(DeleteJob(job.name, result.reason, name) for job in node_jobs)
            continue
        if view is None and any(pod.ours and pod.phase not in TERMINAL_PHASES for pod in node_pods):
            view = WorkerView(WorkerState.STOPPING, 0.0)
            result = attrs.evolve(result, worker=view)
        machines.append(result)
        if view is None and result.cards.free > 0:
            generation = generations.get(name, -1) + 1
            actions.append(
                CreateJob(
                    node=name,
                    cards=result.cards.free,
                    name=job_name(settings.name, name, generation),
                    generation=generation,
                    hostname=result.hostname,
                )
            )
    for node_name, node_jobs in live_jobs.items():
        if node_name not in seen_nodes:
            actions.extend(
                DeleteJob(
                    job.name, "node is gone or no longer matches the pool's selector", node_name
                )
                for job in node_jobs
            )
    wanted = {_action_node(action) for action in actions}
    return Plan(
        tuple(machines),
        tuple(skipped),
        tuple(a for a in actions if _action_node(a) not in held),
        held=tuple(sorted(wanted.intersection(held))),
    )


def _action_node(action: Action) -> str:
    return action.node


def _worker_to_keep(
    node_jobs: Sequence[JobFacts], pods: Iterable[PodFacts], records: Mapping[str, WorkerRecord]
) -> tuple[JobFacts, str]:
    """Which of several Jobs of ours on one node stays, and why: the one whose pod holds cards
    (its worker may run tasks), else the one whose worker registered, else the oldest."""
    holding = {
        pod.job
        for pod in pods
        if pod.ours and pod.phase == "Running" and pod.request[0] > 0 and pod.job
    }
    bound = {pod.job for pod in pods if pod.ours and pod.phase not in TERMINAL_PHASES}

    def rank(job: JobFacts) -> tuple[int, int, int, int]:
        record = records.get(job.name)
        registered = record is not None and record.last_heartbeat is not None
        return (
            job.name not in holding,
            job.name not in bound,
            not registered,
            job.generation,
        )

    keep = min(node_jobs, key=rank)
    if keep.name in holding:
        why = f"{keep.name} holds its cards"
    elif keep.name in bound:
        why = f"{keep.name} has its pod there"
    elif rank(keep)[2] == 0:
        why = f"{keep.name} has registered"
    else:
        why = f"{keep.name} is older"
    return keep, why


def plan_objects(
    settings: PoolSettings,
    nodes: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    jobs: Iterable[Mapping[str, Any]],
    records: Iterable[WorkerRecord],
    now: float,
    **kw: Any,
) -> Plan:
    """`plan_pool` over objects as the API returns them (a list, not a cache)."""
    return plan_pool(
        settings,
        [node_facts(n) for n in nodes],
        [f for f in map(pod_facts, pods) if f is not None],
        [f for f in map(job_facts, jobs) if f is not None],
        records,
        now,
        **kw,
    )


def _in_not_ready_grace(node: NodeFacts, settings: PoolSettings, now: float) -> bool:
    return (
        not node.ready
        and node.ready_since is not None
        and now - node.ready_since < settings.not_ready_grace_s
    )


def _worker_view(
    node_jobs: Sequence[JobFacts], records: Mapping[str, WorkerRecord], now: float
) -> WorkerView | None:
    if not node_jobs:
        return None
    job = max(node_jobs, key=lambda j: j.generation)
    record = records.get(job.name)
    if record is not None:
        since = record.created_at
        state = record.state
    else:
        since = job.created_at if job.created_at is not None else now
        state = WorkerState.PENDING
    return WorkerView(state, max(now - since, 0.0), job.name)


# --- the worker Job -------------------------------------------------------------------------


@attrs.frozen
class WorkerManifests:
    """The Job and its token Secret. Create the Job, then the Secret via `with_job_uid`."""

    job: dict[str, Any]
    secret: dict[str, Any] = attrs.field(repr=False)


def worker_labels(pool: str, node: str) -> dict[str, str]:
    return {
        NAME_LABEL: WORKER_NAME,
        MANAGED_BY_LABEL: MANAGER,
        POOL_LABEL: _label_value(pool),
        NODE_LABEL: _label_value(node),
    }


def job_manifest(
    settings: PoolSettings,
    node: str,
    cards: int,
    name: str,
    token_secret_name: str,
    controlplane_url: str,
    *,
    token: str,
    generation: int = 0,
    hostname: str | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> WorkerManifests:
    """The worker Job pinned to `node` (through the scheduler, so Kubernetes accounts for the
    `cards` it requests) and the Secret holding its token, owned by the Job once created."""
    if cards <= 0:
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"a worker Job for node {node!r} needs at least one card, not {cards}",
            field="cards",
        )
    if settings.tunnel is False and settings.host_network is False:
        raise ApiError(
            ErrorCode.INVALID_ARGUMENT,
            f"pool {settings.name!r}: hostNetwork false needs tunnel true (the controlplane "
            "dials a direct worker at its node's address)",
            field="hostNetwork",
        )
    labels = worker_labels(settings.name, node)
    job_labels = {**labels, GENERATION_LABEL: str(generation)}
    env: list[dict[str, Any]] = [
        {"name": "LEVERS9_WORKER_ID", "value": name},
        {"name": "LEVERS9_MODE", "value": "tunnel" if settings.tunnel else "direct"},
        {"name": "LEVERS9_CONTROLPLANE_URL", "value": controlplane_url},
        {
            "name": "LEVERS9_NODE_NAME",
            "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
        },
        {"name": "LEVERS9_STATE_DIR", "value": settings.objects_path},
        {"name": "LEVERS9_GPU_DRIVER_DIR", "value": settings.driver_path},
        {"name": "LEVERS9_IDLE_S", "value": str(int(settings.idle_minutes * 60))},
        # Said explicitly: with hostNetwork the worker's loopback is the node's (kubelet, sshd).
        {"name": "LEVERS9_LOOPBACK_CONNECT", "value": "off"},
        {
            "name": "LEVERS9_WORKER_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": token_secret_name, "key": TOKEN_KEY}},
        },
    ]
    if settings.allow_local_registries:
        env.append({"name": "LEVERS9_ALLOW_LOCAL_REGISTRIES", "value": "1"})
    if settings.metrics_port is not None:
        env += [
            {"name": "LEVERS9_METRICS_PORT", "value": str(settings.metrics_port)},
            {"name": "LEVERS9_METRICS_HOST", "value": settings.metrics_host},
        ]
    env += [{"name": key, "value": value} for key, value in sorted((extra_env or {}).items())]
    mounts = [
        ("objects", settings.objects_path, "DirectoryOrCreate"),
        ("dev", "/dev", "Directory"),
        ("driver", settings.driver_path, "Directory"),
        ("pod-resources", POD_RESOURCES_DIR, "Directory"),
    ]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        # A stopping agent stops its containers first, each with its own grace (10 s unless the
        # task says otherwise); Kubernetes' default of 30 s would cut a slow one short.
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "nodeSelector": {"kubernetes.io/hostname": hostname or node},
        "hostNetwork": settings.host_network,
        "tolerations": [dict(t) for t in settings.tolerations],
        "containers": [
            {
                "name": "agent",
                "image": settings.image,
                "args": ["run"],
                "securityContext": {"privileged": True},
                "env": env,
                "resources": {
                    "limits": {GPU_RESOURCE: str(cards)},
                    "requests": {GPU_RESOURCE: str(cards)},
                },
                "volumeMounts": [{"name": volume, "mountPath": path} for volume, path, _ in mounts],
            }
        ],
        "volumes": [
            {"name": volume, "hostPath": {"path": path, "type": kind}}
            for volume, path, kind in mounts
        ],
    }
    if settings.host_network:
        # Without it a hostNetwork pod resolves through the node's resolv.conf, not the cluster.
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    annotations = {NODE_ANNOTATION: node}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": settings.namespace,
            "labels": job_labels,
            "annotations": annotations,
        },
        "spec": {
            "backoffLimit": 0,
            "ttlSecondsAfterFinished": settings.ttl_seconds_after_finished,
            "template": {
                "metadata": {"labels": job_labels, "annotations": annotations},
                "spec": pod_spec,
            },
        },
    }
    return WorkerManifests(job, token_secret(settings, node, name, token_secret_name, token))


def token_secret(
    settings: PoolSettings, node: str, job: str, secret_name: str, token: str
) -> dict[str, Any]:
    """The Secret holding a worker's token, to be owned by its Job (`with_job_uid`)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name,
            "namespace": settings.namespace,
            "labels": worker_labels(settings.name, node),
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": job,
                    "uid": "",
                    "controller": True,
                    "blockOwnerDeletion": False,
                }
            ],
        },
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token},
    }


def with_job_uid(secret: Mapping[str, Any], uid: str) -> dict[str, Any]:
    """`secret` owned by the created Job (`uid` from the create response), so deleting the Job
    deletes the token too."""
    metadata = dict(secret["metadata"])
    metadata["ownerReferences"] = [{**ref, "uid": uid} for ref in metadata["ownerReferences"]]
    return {**secret, "metadata": metadata}
