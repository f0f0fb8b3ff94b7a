"""The controlplane's Prometheus metrics: what an operator alerts on and graphs.

Two kinds of figures, both in one private `CollectorRegistry` (never the process-global one,
so two controlplanes in one test process do not mix):

- events counted as they happen: API requests by route pattern (never by path), method (one
  of a fixed list, else `other`) and status with their latency; each placement's delay from
  create to placed; each reconcile pass's duration and failure per pool; each list a pool
  cache made again, by why, and each time a cache became unusable (its watches do not
  stream), per resource; each keepalive round trip to a worker per mode;
- states read when Prometheus scrapes: tasks by workspace and state (one GROUP BY on the
  records), machines and cards per pool from each pool's last pass, workers by mode, tunnels
  open on this replica, bytes carried to and from workers per mode.

Reading the records is async, and prometheus-client collects synchronously, so a scrape first
reads the states and `refresh`es a `Scrape` with them, then renders. Labels are bounded: route
patterns, pools, workspaces, modes, states and the four cached resources (nodes, pods, jobs,
secrets); never a task or worker id, nor a cluster's or cache's own id, and never a value a
client chose as it came (`wire.untrusted`): an anonymous request on an unknown route
with a made-up method is `unmatched` and `other`, one series however many there are.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from control.kube.informer import RELIST_REASONS, UNUSABLE
from control.models import MachineList, TaskState
from control.tasks.store import TaskRecord
from wire.connection import Http2Connection
from wire.untrusted import method_label, status_label
from workerapi import __version__
from workerapi.models import WorkerSummary

MODES = ("direct", "tunnel")
CACHES = ("nodes", "pods", "jobs", "secrets")
"""The resources a pool caches (`control.kube.caches`): the `cache` label's values."""
CARD_USES = ("total", "ours", "busy", "idle", "unhealthy", "occupied", "refused", "others", "free")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PLACEMENT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
RTT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@attrs.frozen
class PoolFigures:
    machines: int
    cards: Mapping[str, int]
    """By use: total, ours (busy, idle, unhealthy, occupied, refused), others, free."""
    refused: int = 0
    """Machines whose worker pods the cluster refuses (Pod Security, GKE Autopilot)."""


def pool_figures(machines: MachineList) -> dict[str, PoolFigures]:
    """Machines and cards per pool from what each pool's last pass saw. Pure."""
    out: dict[str, PoolFigures] = {}
    for status in machines.pools:
        mine = [m for m in machines.machines if m.pool == status.pool]
        out[status.pool] = PoolFigures(
            machines=len(mine),
            cards={use: sum(getattr(m.cards, use) for m in mine) for use in CARD_USES},
            refused=sum(1 for m in mine if m.refused),
        )
    return out


def tasks_by_state(
    counts: Mapping[tuple[str, TaskState], int],
) -> dict[str, dict[TaskState, int]]:
    """Per workspace, a count for EVERY state (0 included, so a rate or an alert on a state
    that has none yet still has a series). Pure."""
    out: dict[str, dict[TaskState, int]] = {}
    for (workspace, state), n in counts.items():
        out.setdefault(workspace, dict.fromkeys(TaskState, 0))[state] = n
    return out


def workers_by_mode(workers: Iterable[WorkerSummary]) -> dict[tuple[str, bool], int]:
    """(mode, connected) → how many workers; both modes and both answers always there, and a
    mode that is neither (a registration's own word) counted as `unknown`. Pure."""
    out = {(mode, connected): 0 for mode in MODES for connected in (True, False)}
    for worker in workers:
        key = (worker.mode if worker.mode in MODES else "unknown", worker.connected)
        out[key] = out.get(key, 0) + 1
    return out


@attrs.frozen
class Scrape:
    """What the states were at one scrape."""

    tasks: Mapping[str, Mapping[TaskState, int]] = attrs.Factory(dict)
    pools: Mapping[str, PoolFigures] = attrs.Factory(dict)
    workers: Mapping[tuple[str, bool], int] = attrs.Factory(dict)
    tunnels_open: int = 0


class _ConnectionBytes:
    """Bytes to and from workers per mode, kept monotonic: a closed connection's bytes move
    into a per-mode total when it is next looked at, live ones are read as they stand."""

    def __init__(self) -> None:
        self._live: dict[str, weakref.WeakSet[Http2Connection]] = {
            mode: weakref.WeakSet() for mode in MODES
        }
        self._retired = {(mode, d): 0 for mode in MODES for d in ("sent", "received")}

    def watch(self, conn: Http2Connection, mode: str) -> None:
        self._live.setdefault(mode, weakref.WeakSet()).add(conn)

    def totals(self) -> dict[tuple[str, str], int]:
        out = dict(self._retired)
        for mode, conns in self._live.items():
            for conn in list(conns):
                sent, received = conn.bytes_sent, conn.bytes_received
                if conn.closed:
                    conns.discard(conn)
                    self._retired[(mode, "sent")] = self._retired.get((mode, "sent"), 0) + sent
                    self._retired[(mode, "received")] = (
                        self._retired.get((mode, "received"), 0) + received
                    )
                out[(mode, "sent")] = out.get((mode, "sent"), 0) + sent
                out[(mode, "received")] = out.get((mode, "received"), 0) + received
        return out


class _States(Collector):
    def __init__(self, metrics: ControlMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        scrape = self._metrics.last
        info = GaugeMetricFamily(
            "levers9_control_info", "This controlplane replica.", labels=["replica", "version"]
        )
        info.add_metric([self._metrics.replica, __version__], 1)
        yield info
        tasks = GaugeMetricFamily(
            "levers9_tasks", "Tasks by workspace and state.", labels=["workspace", "state"]
        )
        for workspace, states in sorted(scrape.tasks.items()):
            for state, n in states.items():
                tasks.add_metric([workspace, state.value], n)
        yield tasks
        machines = GaugeMetricFamily(
            "levers9_pool_machines",
            "Machines of each pool at its last pass (reported by the replica leading it).",
            labels=["pool"],
        )
        cards = GaugeMetricFamily(
            "levers9_pool_cards",
            "Cards on a pool's machines: all, held by our workers (busy, idle, or out of "
            "placement: unhealthy, occupied by a process outside levers9, refused at the "
            "worker's start), by other pods, free.",
            labels=["pool", "use"],
        )
        refused = GaugeMetricFamily(
            "levers9_pool_refused_workers",
            "Machines of a pool whose worker pods the cluster refuses (Pod Security, GKE "
            "Autopilot); `levers9 machine list` says why and what to run.",
            labels=["pool"],
        )
        for pool, figures in sorted(scrape.pools.items()):
            machines.add_metric([pool], figures.machines)
            for use, n in figures.cards.items():
                cards.add_metric([pool, use], n)
            refused.add_metric([pool], figures.refused)
        yield machines
        yield cards
        yield refused
        workers = GaugeMetricFamily(
            "levers9_workers",
            "Registered workers by mode and connection.",
            labels=["mode", "connected"],
        )
        for (mode, connected), n in sorted(scrape.workers.items()):
            workers.add_metric([mode, str(connected).lower()], n)
        yield workers
        yield GaugeMetricFamily(
            "levers9_tunnels_open",
            "Workers' tunnels open on this replica.",
            value=scrape.tunnels_open,
        )
        carried = CounterMetricFamily(
            "levers9_worker_connection_bytes",
            "Bytes this replica wrote to (sent) and read from (received) workers' connections.",
            labels=["mode", "direction"],
        )
        for (mode, direction), n in sorted(self._metrics.bytes.totals().items()):
            carried.add_metric([mode, direction], n)
        yield carried


class ControlMetrics:
    """The controlplane's metrics; the hooks are given to the Service, the registry, the
    dispatcher and each pool's reconciler."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.registry = CollectorRegistry(auto_describe=True)
        self.last = Scrape()
        self.bytes = _ConnectionBytes()
        self.requests = Counter(
            "levers9_api_requests",
            "API requests by route pattern, method and status code.",
            ["route", "method", "code"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "levers9_api_request_seconds",
            "Time to answer an API request (a stream: until it ended).",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.placement_seconds = Histogram(
            "levers9_task_placement_seconds",
            "From a task's creation to its placement on a worker.",
            buckets=PLACEMENT_BUCKETS,
            registry=self.registry,
        )
        self.pass_seconds = Histogram(
            "levers9_reconcile_pass_seconds",
            "Duration of each reconcile pass of a pool.",
            ["pool"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.pass_errors = Counter(
            "levers9_reconcile_errors",
            "Reconcile passes of a pool that failed.",
            ["pool"],
            registry=self.registry,
        )
        self.cache_relists = Counter(
            "levers9_cache_relists",
            "Full lists a pool cache made again, by reason: expired (410 Gone), silent (its "
            "watch heard no event or bookmark for two bookmark periods), empty_watches (its "
            "watches ended at once with nothing in them).",
            ["cache", "reason"],
            registry=self.registry,
        )
        self.cache_unusable = Counter(
            "levers9_cache_unusable",
            "Times a pool cache became unusable: listed again twice as its watches did not "
            "stream; the pools reading it write nothing until a watch streams again.",
            ["cache"],
            registry=self.registry,
        )
        for cache in CACHES:  # every series exists (at 0) before the first count
            self.cache_unusable.labels(cache)
            for reason in RELIST_REASONS:
                self.cache_relists.labels(cache, reason)
        self.rtt_seconds = Histogram(
            "levers9_worker_rtt_seconds",
            "Keepalive PING round trips to workers, by mode.",
            ["mode"],
            buckets=RTT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_States(self))

    # -- events -------------------------------------------------------------------------------

    def request(self, method: str, route: str, status: int, seconds: float) -> None:
        """`Service.observe`: one answered request. `route` is the Service's (a pattern,
        `unmatched` or `CONNECT`); the method and status are mapped to a fixed set here."""
        method = method_label(method)
        self.requests.labels(route, method, status_label(status)).inc()
        self.request_seconds.labels(route, method).observe(seconds)

    def placed(self, record: TaskRecord) -> None:
        """`Dispatcher.on_placed`."""
        if record.started_at is not None:
            self.placement_seconds.observe(max(0.0, record.started_at - record.created_at))

    def reconcile_pass(self, pool: str, seconds: float, ok: bool) -> None:
        """`PoolReconciler.on_pass`."""
        self.pass_seconds.labels(pool).observe(seconds)
        if not ok:
            self.pass_errors.labels(pool).inc()
        else:
            self.pass_errors.labels(pool)  # the series exists (at 0) before the first failure

    def cache_event(self, cache: str, what: str) -> None:
        """`Clusters(on_cache_event=)`: a cache (its resource plural) listed again (`what`: a
        reason) or became unusable."""
        if what == UNUSABLE:
            self.cache_unusable.labels(cache).inc()
        else:
            self.cache_relists.labels(cache, what).inc()

    def connection(self, conn: Http2Connection, mode: str) -> None:
        """`WorkerRegistry.on_connection`: count its bytes and round trips."""
        self.bytes.watch(conn, mode)
        histogram = self.rtt_seconds.labels(mode)
        conn.on_rtt = histogram.observe

    # -- states -------------------------------------------------------------------------------

    def refresh(
        self,
        counts: Mapping[tuple[str, TaskState], int],
        machines: MachineList,
        workers: Sequence[WorkerSummary],
        tunnels_open: int,
    ) -> None:
        """Take the states for the next `render`: the records' counts (`count_by_state`), the
        pools' machines, the workers, this replica's open tunnels."""
        self.last = Scrape(
            tasks=tasks_by_state(counts),
            pools=pool_figures(machines),
            workers=workers_by_mode(workers),
            tunnels_open=tunnels_open,
        )
