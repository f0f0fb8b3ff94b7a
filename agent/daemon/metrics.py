"""The agent's Prometheus metrics: its cards, containers, object store and bucket mounts, now.

Why read at scrape time: every number here is already kept by the part that owns it (the
container manager, the object store, the bucket mounts); `AgentCollector` reads them when
Prometheus asks and keeps no second copy to drift. Which families and samples those readings
become is decided by the pure `metric_families`, tested without an agent.

NVML is the exception: its calls block, and a card falling off the bus can hold one for
seconds, while `generate_latest` runs the collector on the event loop. So `GpuSampler` owns one
NVML session for the agent's life and reads the cards in a worker thread, in a task of the
agent's nursery; a scrape asks it for a fresh sample (`refresh`, run by the listener before it
renders) and waits at most `MetricsConfig.sample_wait_s`, then reports the latest sample there is.
One read runs at a time, however many scrapes ask.

XIDs are events, not state. `GpuSampler` keeps one NVML event set registered for critical
XIDs (`nvmlEventTypeXidCriticalError`) on every card that offers them, and a task waits on it in
a worker thread, as NVIDIA's device plugin does. `levers9_gpu_xid_errors_total` counts the
events that set delivered: every critical XID a card reported since this agent started
listening, each once, whatever its number (XIDs from before the agent started are not replayed
by NVML). A new agent starts again at 0, which Prometheus' `rate()` and `increase()` read as
the counter reset it is. A card that does not offer XID events has no such series. (The
agent's claim reads XIDs once at start, through a short-lived registration; counting those
would count nothing that happens later.)

Cardinality is bounded by the node: card labels are `uuid`, `index` and `model` (a handful of
cards), containers are counted by state (six), the agent is named once. No task, container or
object id is ever a label. A reading a card cannot give is left out, never exported as 0.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from agent.daemon.config import MetricsConfig
from agent.runtime.manager import ContainerManager
from agent.store.objects import ObjectStore, StoreStatistics
from agent.volumes.supervisor import Volumes
from nvml import Device, Nvml, NvmlError, Readings, XidEvent, XidListener, open_nvml
from wire.metrics import serve_metrics
from workerapi import __version__
from workerapi.models import CardInfo, CardState, ContainerState

log = logging.getLogger("levers9.agent")

XID_WAIT_MS = 1000
"""How long one wait for XIDs blocks its thread; also how long stopping the agent may wait
for that thread to come back."""
CARD_LABELS = ("uuid", "index", "model")


@attrs.frozen
class CardSample:
    """One card as the last sample saw it."""

    uuid: str
    index: int
    model: str
    readings: Readings | None
    """None: the card did not answer this time."""


@attrs.frozen
class AgentView:
    """Everything the metrics report, as plain values (what `metric_families` turns into
    samples). None for a part the agent does not run or cannot read."""

    worker: str
    mode: str
    version: str
    cards: tuple[CardSample, ...] = ()
    xids: Mapping[str, int] = attrs.field(factory=dict)
    """Critical XIDs counted per card UUID, for the cards whose XIDs are heard."""
    claim: tuple[CardInfo, ...] | None = None
    """The cards this worker was given, serving or refused; None: the claim failed."""
    containers: Mapping[ContainerState, int] | None = None
    store: StoreStatistics | None = None
    bucket_mounts: int | None = None


def metric_families(view: AgentView) -> list[Metric]:
    """The metric families `view` makes. Pure."""
    families: list[Metric] = []
    info = InfoMetricFamily("levers9_agent", "This worker agent: its id, mode and version.")
    info.add_metric([], {"worker": view.worker, "mode": view.mode, "version": view.version})
    families.append(info)
    families += _card_families(view)
    if view.containers is not None:
        containers = GaugeMetricFamily(
            "levers9_containers", "Containers on this worker, by state.", labels=["state"]
        )
        for state in ContainerState:
            containers.add_metric([state.value], view.containers.get(state, 0))
        families.append(containers)
    if view.store is not None:
        store = view.store
        families += [
            GaugeMetricFamily(
                "levers9_store_bytes", "Bytes in the node's object store.", value=store.bytes
            ),
            GaugeMetricFamily(
                "levers9_store_objects", "Objects in the node's object store.", value=store.objects
            ),
            GaugeMetricFamily(
                "levers9_store_budget_bytes",
                "The object store's budget; least recently used objects are evicted above it.",
                value=store.budget_bytes,
            ),
            CounterMetricFamily(
                "levers9_store_evictions_total",
                "Objects this agent's store evicted since it started.",
                value=store.evicted_objects,
            ),
            CounterMetricFamily(
                "levers9_store_evicted_bytes_total",
                "Bytes this agent's store evicted since it started.",
                value=store.evicted_bytes,
            ),
        ]
    if view.bucket_mounts is not None:
        families.append(
            GaugeMetricFamily(
                "levers9_bucket_mounts",
                "Workspace buckets mounted for containers (one rclone each).",
                value=view.bucket_mounts,
            )
        )
    return families


def _card_families(view: AgentView) -> list[Metric]:
    def gauge(name: str, documentation: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, documentation, labels=CARD_LABELS)

    utilization = gauge(
        "levers9_gpu_utilization_percent",
        "Share of the card's last sample period in which a kernel ran (NVML).",
    )
    memory_utilization = gauge(
        "levers9_gpu_memory_utilization_percent",
        "Share of the card's last sample period in which its memory was read or written (NVML).",
    )
    memory_used = gauge("levers9_gpu_memory_used_bytes", "Card memory in use (NVML).")
    memory_total = gauge("levers9_gpu_memory_total_bytes", "Card memory in all (NVML).")
    temperature = gauge("levers9_gpu_temperature_celsius", "The card's die temperature (NVML).")
    power = gauge("levers9_gpu_power_watts", "Power the card's board draws (NVML).")
    ecc = CounterMetricFamily(
        "levers9_gpu_ecc_errors_total",
        "ECC errors since the driver loaded, by type (NVML volatile counts).",
        labels=(*CARD_LABELS, "type"),
    )
    xids = CounterMetricFamily(
        "levers9_gpu_xid_errors_total",
        "Critical XID events the card reported since this agent started listening (NVML).",
        labels=CARD_LABELS,
    )
    for card in view.cards:
        labels = [card.uuid, str(card.index), card.model]
        readings = card.readings or Readings()
        for family, value in (
            (utilization, readings.utilization_gpu_percent),
            (memory_utilization, readings.utilization_memory_percent),
            (memory_used, readings.memory_used_bytes),
            (memory_total, readings.memory_total_bytes),
            (temperature, readings.temperature_celsius),
            (power, readings.power_watts),
        ):
            if value is not None:
                family.add_metric(labels, value)
        for kind, count in (
            ("corrected", readings.ecc_corrected_volatile),
            ("uncorrected", readings.ecc_uncorrected_volatile),
        ):
            if count is not None:
                ecc.add_metric([*labels, kind], count)
        if card.uuid in view.xids:
            xids.add_metric(labels, view.xids[card.uuid])
    families: list[Metric] = [
        utilization,
        memory_utilization,
        memory_used,
        memory_total,
        temperature,
        power,
        ecc,
        xids,
    ]
    if view.claim is not None:
        claimed = gauge(
            "levers9_gpu_claimed", "1 for a card this worker serves, 0 for one it does not."
        )
        health = GaugeMetricFamily(
            "levers9_gpu_health",
            "1 for each card this worker was given, labelled with its state now (serving, "
            "refused, unhealthy: quarantined while the worker ran, occupied: used by a process "
            "outside levers9).",
            labels=("uuid", "index", "state"),
        )
        for info in view.claim:
            health.add_metric([info.uuid, str(info.index), str(info.state.value)], 1)
        families.append(health)
        given = {info.uuid: info for info in view.claim}
        for info in view.claim:
            serves = 1 if info.state is CardState.SERVING else 0
            claimed.add_metric([info.uuid, str(info.index), info.model], serves)
        for sample in view.cards:
            if sample.uuid not in given:  # on the node, but not given to this worker
                claimed.add_metric([sample.uuid, str(sample.index), sample.model], 0)
        families.append(claimed)
    return [family for family in families if family.samples]  # no cards: no card families


def container_counts(manager: ContainerManager) -> Counter[ContainerState]:
    """How many of the manager's containers are in each state."""
    return Counter(container.state for container in manager.all())


class GpuSampler:
    """Reads every card's readings on request and counts XIDs, in worker threads.

    Run it in a nursery (`await nursery.start(sampler.run)`); `started()` comes once NVML is
    open and the XIDs already queued are counted. Where NVML cannot be opened it logs why once
    and reports no cards.
    """

    def __init__(self) -> None:
        self.cards: tuple[CardSample, ...] = ()
        """The latest sample."""
        self._xids: dict[str, int] = {}
        self._sampling = False
        self._wanted = trio.Event()
        self._done = trio.Event()

    @property
    def xids(self) -> Mapping[str, int]:
        """Critical XIDs counted so far, by card UUID, for the cards whose XIDs are heard."""
        return dict(self._xids)

    async def refresh(self) -> None:
        """Waits until a sample taken after this call is in `cards` (callers bound the wait:
        a card that does not answer may hold a sample up)."""
        if not self._sampling:
            return
        done = self._done
        self._wanted.set()
        await done.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        stack = contextlib.ExitStack()
        try:
            try:
                nvml = await trio.to_thread.run_sync(stack.enter_context, open_nvml())
                devices = await trio.to_thread.run_sync(_describe_cards, nvml)
            except NvmlError as exc:
                log.warning("no GPU metrics: %s", exc.message, extra={"reason": exc.message})
                task_status.started()
                return
            listener = await self._listen(stack, nvml)
            async with trio.open_nursery() as nursery:
                self._sampling = True
                nursery.start_soon(self._sample_on_request, nvml, devices)
                if listener is not None:
                    nursery.start_soon(self._count_xids, listener)
                task_status.started()
        finally:
            self._sampling = False
            with trio.CancelScope(shield=True):  # nvmlEventSetFree and nvmlShutdown: quick
                await trio.to_thread.run_sync(stack.close)

    async def _listen(self, stack: contextlib.ExitStack, nvml: Nvml) -> XidListener | None:
        try:
            listener = await trio.to_thread.run_sync(stack.enter_context, nvml.listen_for_xids())
            queued = await trio.to_thread.run_sync(listener.wait, 0)
        except NvmlError as exc:
            log.warning("XIDs are not counted: %s", exc.message, extra={"reason": exc.message})
            return None
        self._xids = dict.fromkeys(sorted(listener.listening), 0)
        self._count(queued)
        return listener

    async def _sample_on_request(self, nvml: Nvml, devices: Sequence[Device]) -> None:
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            # Scrapes that ask from now on wait for the next sample, not this one.
            done, self._done = self._done, trio.Event()
            self.cards = await trio.to_thread.run_sync(read_cards, nvml, devices)
            done.set()

    async def _count_xids(self, listener: XidListener) -> None:
        while True:
            try:
                events = await trio.to_thread.run_sync(listener.wait, XID_WAIT_MS)
            except NvmlError as exc:
                log.warning("stopped counting XIDs: %s", exc.message, extra={"reason": exc.message})
                self._xids = {}  # unknown from now on, rather than a count that stopped
                return
            self._count(events)

    def _count(self, events: Iterable[XidEvent]) -> None:
        for event in events:
            if event.uuid in self._xids:
                self._xids[event.uuid] += 1


def _describe_cards(nvml: Nvml) -> tuple[Device, ...]:
    """The cards NVML describes now; one that does not answer at start is left out."""
    devices = []
    for index in range(nvml.device_count()):
        try:
            devices.append(nvml.device(index))
        except NvmlError:
            continue
    return tuple(devices)


def read_cards(nvml: Nvml, devices: Sequence[Device]) -> tuple[CardSample, ...]:
    """Every card's readings (blocks); a card that does not answer has none this time."""
    samples = []
    for device in devices:
        try:
            readings: Readings | None = nvml.readings(device.index)
        except NvmlError:  # lost, or the driver went away: nothing to report for it now
            readings = None
        samples.append(
            CardSample(uuid=device.uuid, index=device.index, model=device.name, readings=readings)
        )
    return tuple(samples)


ClaimSource = tuple[CardInfo, ...] | Callable[[], tuple[CardInfo, ...]] | None
"""The claimed cards, or how to read them at each scrape (their states change while the worker
runs: agent/daemon/health.py); None: the claim failed."""


class AgentCollector:
    """A `prometheus_client` collector reading the agent's parts at scrape time (memory only:
    the cards come from `GpuSampler`'s latest sample). A part left None is not reported."""

    def __init__(
        self,
        *,
        worker: str,
        mode: str,
        gpus: GpuSampler | None = None,
        claim: ClaimSource = None,
        containers: ContainerManager | None = None,
        store: ObjectStore | None = None,
        volumes: Volumes | None = None,
    ) -> None:
        self._worker = worker
        self._mode = mode
        self._gpus = gpus
        self._claim = claim
        self._containers = containers
        self._store = store
        self._volumes = volumes

    def view(self) -> AgentView:
        return AgentView(
            worker=self._worker,
            mode=self._mode,
            version=__version__,
            cards=self._gpus.cards if self._gpus else (),
            xids=self._gpus.xids if self._gpus else {},
            claim=self._claim() if callable(self._claim) else self._claim,
            containers=None if self._containers is None else container_counts(self._containers),
            store=None if self._store is None else self._store.statistics(),
            bucket_mounts=None if self._volumes is None else len(self._volumes.statistics().mounts),
        )

    def collect(self) -> Iterable[Metric]:
        return metric_families(self.view())


def agent_registry(collector: AgentCollector) -> CollectorRegistry:
    """A registry of its own holding `collector` (never the process-wide default one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


async def serve_agent_metrics(
    config: MetricsConfig,
    *,
    worker: str,
    mode: str,
    claim: ClaimSource,
    manager: ContainerManager | None,
    task_status: trio.TaskStatus[int | None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The `/metrics` listener with its card sampler, until cancelled; `started()` gives the
    port it listens on, or None while the port is taken.

    Workers use the node's network, so a worker rolled onto a node where the previous one is
    still stopping finds the port taken: it then serves its cards without `/metrics` for the
    moment (a warning says so) and listens as soon as the port is free. Any other failure to
    listen (an address not on this node, a port it may not use) ends the agent, naming it."""
    sampler = GpuSampler()
    registry = agent_registry(
        AgentCollector(
            worker=worker,
            mode=mode,
            gpus=sampler,
            claim=claim,
            containers=manager,
            store=None if manager is None else manager.store,
            volumes=None if manager is None else manager.volumes,
        )
    )

    async def refresh() -> None:
        with trio.move_on_after(config.sample_wait_s):
            await sampler.refresh()

    serve = functools.partial(
        serve_metrics,
        config.host,
        config.port,
        registry,
        refresh=refresh,
        read_timeout_s=config.read_timeout_s,
    )
    host = f"[{config.host}]" if ":" in config.host else config.host
    fields = {"worker": worker, "metrics_host": config.host}
    async with trio.open_nursery() as nursery:
        await nursery.start(sampler.run)
        waiting = False
        while True:
            try:
                port = await nursery.start(serve)
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                if not waiting:
                    log.warning(
                        "metrics: %s:%d is taken (by a worker still stopping on this node?); "
                        "serving without /metrics until it is free",
                        host,
                        config.port,
                        extra={**fields, "metrics_port": config.port, "reason": str(exc)},
                    )
                    task_status.started(None)
                    waiting = True
            await trio.sleep(config.bind_retry_s)
        log.info(
            "metrics for Prometheus at http://%s:%d/metrics",
            host,
            port,
            extra={**fields, "metrics_port": port},
        )
        if not waiting:
            task_status.started(port)
