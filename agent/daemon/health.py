"""The watch over the claimed cards while the worker runs: hears critical XIDs at once, polls
each card's health and processes every `poll_s`, and carries out what
`agent.gpus.health.decide_health` decides.

One NVML session, used from worker threads with short waits (like the metrics' `GpuSampler`),
so cancelling the agent never waits long on NVML. One task reads and decides, so the decisions
see one consistent state. A transition updates the card states the worker registers, takes the
card out of placement in the ledger (for good when UNHEALTHY, while it lasts when OCCUPIED),
is logged, and nudges the register loop so the controlplane hears it now. The container that
held a quarantined card gets an event naming the card and the fault; with the `fail` policy it
is stopped and ends FAILED with that reason.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs
import trio

from agent.daemon.config import HealthConfig
from agent.daemon.register import RegisterNudge
from agent.daemon.routes import WorkerState
from agent.gpus.health import (
    CardObservation,
    CardWatch,
    Transition,
    decide_health,
    our_pids,
)
from agent.gpus.ledger import CardLedger
from agent.runtime.manager import ContainerManager
from nvml import Nvml, NvmlError, XidEvent, XidListener, open_nvml
from nvml.errors import DeviceUnresponsiveError, NvmlUnavailableError
from wire.errors import ApiError
from workerapi.models import CardState

log = logging.getLogger("levers9.agent")
XID_WAIT_MS = 200
"""The longest one wait for XIDs blocks a worker thread: what a cancellation may wait for."""


def observe(
    nvml: Nvml, cards: Sequence[CardWatch], proc: Path = Path("/proc")
) -> tuple[dict[str, CardObservation], frozenset[int]]:
    """Reads each card's health and processes, and which of those processes are ours. Blocks."""
    observed: dict[str, CardObservation] = {}
    pids: set[int] = set()
    for card in cards:
        try:
            health = nvml.health(card.index)
            processes = nvml.processes(card.index)
        except DeviceUnresponsiveError as exc:
            observed[card.uuid] = CardObservation(card.uuid, error=exc.message)
            continue
        except NvmlUnavailableError:
            raise
        except NvmlError:
            health, processes = None, None
        observed[card.uuid] = CardObservation(card.uuid, health=health, processes=processes)
        pids.update(p.pid for p in processes or ())
    return observed, our_pids(pids, proc)


def _heard(listener: XidListener, wait_ms: int) -> tuple[XidEvent, ...]:
    """The XIDs heard within `wait_ms`; none where the wait itself failed (a card that went
    with its events is found by the poll). Blocks."""
    try:
        return listener.wait(wait_ms)
    except NvmlUnavailableError:
        raise
    except NvmlError:
        return ()


def fault_event(transition: Transition) -> str:
    """The event and error of a container whose card was quarantined."""
    return f"its card {transition.index} ({transition.uuid}) turned unhealthy: {transition.reason}"


@attrs.define
class CardHealthWatch:
    """Watches `state.cards`' serving cards until cancelled. Run it in a nursery:
    `await nursery.start(watch.run)`; `started()` comes once NVML is open and the XID listener
    registered (or at once, with a warning, where NVML cannot be opened)."""

    config: HealthConfig
    state: WorkerState
    nudge: RegisterNudge
    ledger: CardLedger | None = None
    manager: ContainerManager | None = None
    driver_dir: Path | None = None
    clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC)
    cards: tuple[CardWatch, ...] = ()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.cards = tuple(
            CardWatch(c.uuid, c.index, c.state, c.reason)
            for c in self.state.cards
            if c.state in (CardState.SERVING, CardState.OCCUPIED)
        )
        if not self.cards:
            task_status.started()
            return
        stack = contextlib.ExitStack()
        try:
            try:
                nvml = await trio.to_thread.run_sync(
                    stack.enter_context, open_nvml(self.driver_dir)
                )
                listener = await trio.to_thread.run_sync(
                    stack.enter_context, nvml.listen_for_xids()
                )
            except NvmlError as exc:
                log.warning(
                    "cards not watched while the worker runs: %s",
                    exc.message,
                    extra={"worker": self.state.worker_id, "reason": exc.message},
                )
                task_status.started()
                return
            async with trio.open_nursery() as nursery:
                task_status.started()
                await self._watch(nvml, listener, nursery)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(stack.close)

    async def _watch(self, nvml: Nvml, listener: XidListener, nursery: trio.Nursery) -> None:
        poll_due = trio.current_time()
        wait_ms = max(1, min(XID_WAIT_MS, int(self.config.poll_s * 1000)))
        try:
            while any(c.state in (CardState.SERVING, CardState.OCCUPIED) for c in self.cards):
                events: Sequence[XidEvent] = ()
                if listener.listening:
                    events = await trio.to_thread.run_sync(_heard, listener, wait_ms)
                else:  # no card offers XID events: the poll is all there is
                    await trio.sleep_until(poll_due)
                observed: Mapping[str, CardObservation] = {}
                ours: frozenset[int] = frozenset()
                if trio.current_time() >= poll_due:
                    observed, ours = await trio.to_thread.run_sync(
                        observe, nvml, [c for c in self.cards if c.state is not CardState.UNHEALTHY]
                    )
                    poll_due = trio.current_time() + self.config.poll_s
                if events or observed:
                    self._decide(events, observed, ours, nursery)
        except NvmlUnavailableError as exc:
            log.warning(
                "cards no longer watched: %s",
                exc.message,
                extra={"worker": self.state.worker_id, "reason": exc.message},
            )

    def _decide(
        self,
        events: Sequence[XidEvent],
        observed: Mapping[str, CardObservation],
        ours: frozenset[int],
        nursery: trio.Nursery,
    ) -> None:
        self.cards, transitions = decide_health(
            self.cards, events, observed, ours, self.config.fault_xids, self.clock()
        )
        for transition in transitions:
            self._apply(transition, nursery)
        if transitions:
            self.nudge.nudge()

    def _apply(self, transition: Transition, nursery: trio.Nursery) -> None:
        self.state.cards = tuple(
            attrs.evolve(c, state=transition.after, reason=transition.reason)
            if c.uuid == transition.uuid
            else c
            for c in self.state.cards
        )
        holder = None
        if self.ledger is not None:
            self.ledger.set_state(transition.uuid, transition.after)
            holder = self.ledger.holder(transition.uuid)
        level = logging.WARNING if transition.after is not CardState.SERVING else logging.INFO
        log.log(
            level,
            "card %d (%s) is %s: %s",
            transition.index,
            transition.uuid,
            transition.after.value,
            transition.reason,
            extra={
                "worker": self.state.worker_id,
                "card_uuid": transition.uuid,
                "card_index": transition.index,
                "card_state": str(transition.after.value),
                "card_state_before": str(transition.before.value),
                "xid": transition.xid,
                "container": holder,
                "reason": transition.reason,
            },
        )
        if transition.quarantined and holder is not None and self.manager is not None:
            nursery.start_soon(
                functools.partial(
                    _card_fault,
                    self.manager,
                    holder,
                    fault_event(transition),
                    stop=self.config.policy == "fail",
                )
            )


async def _card_fault(manager: ContainerManager, holder: str, message: str, *, stop: bool) -> None:
    """Tells the holder's manager; a container that cannot be stopped now is logged, and the
    watch (and the agent) go on."""
    try:
        await manager.card_fault(holder, message, stop=stop)
    except ApiError as exc:
        log.warning(
            "container %s on a quarantined card could not be stopped: %s",
            holder,
            exc.message,
            extra={"container": holder, "reason": exc.message},
        )
