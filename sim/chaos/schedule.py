"""The campaign's faults, drawn from its seed: which kinds, in what order, on what, for how long.

Why this module exists: a fault campaign is worth something only when a violation it finds can
be had again. Everything the campaign decides ahead of time comes from here, a pure function of
the seed and the installation's shape (node names, replica count), so `--seed N` replays the
same faults in the same order with the same durations. What depends on the run itself (which
node is pulling when an agent is to be killed mid-pull) is chosen there, from the candidates,
with a generator seeded from the fault's own number.

Kinds come in rounds: each round is every kind once, in an order shuffled by the seed, so a
short campaign still meets every kind and a long one meets each about equally often.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence

import attrs

__all__ = ["KINDS", "FaultKind", "PlannedFault", "draw", "planned"]


@attrs.frozen
class FaultKind:
    """A kind of fault: `target` says what it hits (a replica, a node, or the whole
    installation), `lasts_s` the range its duration is drawn from ((0, 0): it is an instant)."""

    name: str
    target: str
    lasts_s: tuple[float, float] = (0.0, 0.0)
    about: str = ""


KINDS: tuple[FaultKind, ...] = (
    FaultKind(
        "replica_kill", "replica", (1.0, 8.0), "SIGKILL a controlplane replica, start it later"
    ),
    FaultKind("agent_kill_pull", "node", about="SIGKILL an agent while it pulls an image"),
    FaultKind("agent_kill_ingest", "node", about="SIGKILL an agent while it takes in a snapshot"),
    FaultKind("agent_kill_start", "node", about="SIGKILL an agent while it starts a container"),
    FaultKind(
        "agent_kill_bucket_write", "node", about="SIGKILL an agent while a task writes a bucket"
    ),
    FaultKind("postgres_restart", "installation", about="restart PostgreSQL (immediate mode)"),
    FaultKind("tunnel_cut", "installation", about="cut every connection through the Service"),
    FaultKind("tunnel_stall", "installation", (2.0, 12.0), "hold every byte through the Service"),
    FaultKind("api_5xx", "installation", (2.0, 10.0), "the API server answers 500"),
    FaultKind("api_429", "installation", (2.0, 10.0), "the API server answers 429"),
    FaultKind("api_slow", "installation", (3.0, 12.0), "the API server answers after 1.5 s"),
    FaultKind("watch_drop", "installation", about="the API server drops every watch"),
    FaultKind("watch_lag", "installation", (5.0, 20.0), "watch events arrive 0.8-5 s late"),
    FaultKind("node_not_ready", "node", (3.0, 20.0), "a node NotReady, then Ready again"),
    FaultKind("registry_stall", "installation", (3.0, 15.0), "the registry stalls mid-blob"),
)
BY_NAME = {kind.name: kind for kind in KINDS}


@attrs.frozen
class PlannedFault:
    """The `number`th fault of a campaign (from 0): its kind, its target (a replica index or
    a node name; "" for the whole installation, or a node chosen at run time), how long it
    lasts, an amount drawn for it (a watch's lag, the bytes a blob stalls after), and the
    pause before it once the previous one has settled."""

    number: int
    kind: str
    target: str
    lasts_s: float
    amount: float
    pause_s: float

    def describe(self) -> str:
        on = f" on {self.target}" if self.target else ""
        lasts = f" for {self.lasts_s:.1f} s" if self.lasts_s else ""
        return f"#{self.number} {self.kind}{on}{lasts}"


def draw(
    seed: int,
    *,
    nodes: Sequence[str],
    replicas: int,
    kinds: Sequence[str] | None = None,
    pause_s: tuple[float, float] = (1.0, 4.0),
) -> Iterator[PlannedFault]:
    """The campaign's faults, without end; the same arguments give the same sequence."""
    chosen = [BY_NAME[name] for name in kinds] if kinds else list(KINDS)
    if not chosen:
        raise ValueError("a campaign needs at least one kind of fault")
    if not nodes or replicas < 1:
        raise ValueError("a campaign needs at least one node and one replica")
    rng = random.Random(f"levers9-chaos-{seed}")
    number = itertools.count()
    while True:
        round_ = list(chosen)
        rng.shuffle(round_)
        for kind in round_:
            low, high = kind.lasts_s
            lasts = round(rng.uniform(low, high), 1) if high else 0.0
            if kind.target == "replica":
                target = f"replica-{rng.randrange(replicas)}"
            elif kind.target == "node" and kind.lasts_s != (0.0, 0.0):
                target = rng.choice(list(nodes))
            else:
                target = ""  # the whole installation, or a node found busy at run time
            amount = round(rng.uniform(0.8, 5.0), 1) if kind.name == "watch_lag" else 0.0
            if kind.name == "registry_stall":
                amount = float(rng.randrange(64 << 10, 1 << 20))
            yield PlannedFault(
                number=next(number),
                kind=kind.name,
                target=target,
                lasts_s=lasts,
                amount=amount,
                pause_s=round(rng.uniform(*pause_s), 1),
            )


def planned(
    seed: int,
    count: int,
    *,
    nodes: Sequence[str],
    replicas: int,
    kinds: Sequence[str] | None = None,
) -> list[PlannedFault]:
    """The first `count` faults of `draw` (for printing and tests)."""
    return list(itertools.islice(draw(seed, nodes=nodes, replicas=replicas, kinds=kinds), count))
