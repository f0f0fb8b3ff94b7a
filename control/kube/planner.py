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

Beside it: `control.kube.quantities` reads Kubernetes quantities, `control.kube.selectors`
matches selectors and tolerations, and `control.kube.manifests` writes the worker's Job and
Secret and owns the labels by which the facts tell our objects apart.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import attrs

from control.kube.manifests import (
    DEFAULT_TOLERATIONS,
    GENERATION_LABEL,
    GPU_RESOURCE,
    MANAGED_BY_LABEL,
    MANAGER,
    NAME_LABEL,
    NODE_ANNOTATION,
    NODE_LABEL,
    POOL_LABEL,
    WORKER_NAME,
    PoolSettings,
    job_name,
    token_secret_name,
)
from control.kube.quantities import cpu_millis, memory_bytes
from control.kube.selectors import selector_matches, tolerated
from control.models import WorkerState

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
"""Set by the Job controller on its pods (with the older `job-name`)."""
GPU_MODEL_LABELS = (
    "cloud.google.com/gke-accelerator",
    "nvidia.com/gpu.product",
    "karpenter.k8s.aws/instance-gpu-name",
)
EXPIRE_AFTER_S = 600.0
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


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


# --- settings, records, machines ------------------------------------------------------------


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
        if not tolerated(taint, tolerations):
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
    jobs = tuple(jobs)
    generations = _generations(records_by_job.values(), jobs)
    live_jobs, actions = _live_jobs(jobs, records_by_job, now, expire_after_s, retire)
    for node_name, node_jobs in live_jobs.items():
        keep, surplus = _one_worker(
            node_name, node_jobs, pods_by_node.get(node_name, ()), records_by_job
        )
        actions += surplus
        live_jobs[node_name] = keep
        if secrets is not None:
            actions.extend(
                CreateSecret(job.name, node_name)
                for job in keep
                if token_secret_name(job.name) not in secrets and job.name in tokens
            )

    machines: list[Machine] = []
    skipped: list[NotAMachine] = []
    seen_nodes: set[str] = set()
    for node in nodes:
        if not selector_matches(node.labels, settings.selector):
            continue
        seen_nodes.add(node.name)
        result, node_actions = _plan_node(
            settings,
            node,
            live_jobs.get(node.name, []),
            pods_by_node.get(node.name, ()),
            records_by_job,
            generations,
            now,
        )
        if isinstance(result, NotAMachine):
            skipped.append(result)
        else:
            machines.append(result)
        actions += node_actions
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


def _generations(records: Iterable[WorkerRecord], jobs: Iterable[JobFacts]) -> dict[str, int]:
    """The last generation seen per node, of every Job and record (ended ones included)."""
    generations: dict[str, int] = {}
    for known in records:
        # An expired record outlives its deleted Job, so the next name must still move on.
        tail = known.job_name.rpartition("-")[2]
        if tail.isdigit():
            generations[known.node] = max(generations.get(known.node, -1), int(tail))
    for job in jobs:
        generations[job.node] = max(generations.get(job.node, -1), job.generation)
    return generations


def _live_jobs(
    jobs: Iterable[JobFacts],
    records: Mapping[str, WorkerRecord],
    now: float,
    expire_after_s: float,
    retire: Mapping[str, str] | None,
) -> tuple[dict[str, list[JobFacts]], list[Action]]:
    """The active Jobs by node, and the deletions of those expired or retired."""
    live_jobs: dict[str, list[JobFacts]] = {}
    actions: list[Action] = []
    for job in jobs:
        if not job.active:
            continue
        record = records.get(job.name)
        if record is not None and now - record.last_seen() >= expire_after_s:
            actions.append(
                DeleteJob(job.name, f"no heartbeat for {int(now - record.last_seen())} s", job.node)
            )
        elif retire is not None and job.name in retire:
            actions.append(DeleteJob(job.name, retire[job.name], job.node))
        else:
            live_jobs.setdefault(job.node, []).append(job)
    return live_jobs, actions


def _one_worker(
    node_name: str,
    node_jobs: list[JobFacts],
    pods: Iterable[PodFacts],
    records: Mapping[str, WorkerRecord],
) -> tuple[list[JobFacts], list[Action]]:
    """The node's live Jobs cut to one (`_worker_to_keep`), and the deletions of the rest."""
    if len(node_jobs) <= 1:
        return node_jobs, []
    keep, why = _worker_to_keep(node_jobs, pods, records)
    surplus: list[Action] = [
        DeleteJob(job.name, f"surplus worker on {node_name}: {why}", node_name)
        for job in node_jobs
        if job is not keep
    ]
    return [keep], surplus


def _plan_node(
    settings: PoolSettings,
    node: NodeFacts,
    node_jobs: Sequence[JobFacts],
    node_pods: Sequence[PodFacts],
    records: Mapping[str, WorkerRecord],
    generations: Mapping[str, int],
    now: float,
) -> tuple[Machine | NotAMachine, list[Action]]:
    """One selected node: the machine it is (or why not) and what it needs done."""
    name = node.name
    view = _worker_view(node_jobs, records, now)
    result = machine_of(node, node_pods, view, pool=settings.name, tolerations=settings.tolerations)
    if isinstance(result, NotAMachine):
        if _in_not_ready_grace(node, settings, now):
            return result, []
        return result, [DeleteJob(job.name, result.reason, name) for job in node_jobs]
    if view is None and any(pod.ours and pod.phase not in TERMINAL_PHASES for pod in node_pods):
        view = WorkerView(WorkerState.STOPPING, 0.0)
        result = attrs.evolve(result, worker=view)
    if view is None and result.cards.free > 0:
        generation = generations.get(name, -1) + 1
        create = CreateJob(
            node=name,
            cards=result.cards.free,
            name=job_name(settings.name, name, generation),
            generation=generation,
            hostname=result.hostname,
        )
        return result, [create]
    return result, []


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
