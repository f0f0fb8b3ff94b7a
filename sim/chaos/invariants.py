"""What must hold after every fault of the campaign, each violation a sentence a person can act on.

Why this module exists: a fault campaign finds bugs only if something checks what the faults
left. These checks are that something. Each returns a list of `Violation`s; each violation has a
short, stable invariant name (what `summarize` counts) and a sentence naming the task, node or
object and what is wrong with it, so a report can be read without the campaign's code at hand.

Two kinds of check:

- Pure checks over what the campaign recorded (`jobs_per_node`, `ran_twice`, `task_ends`,
  `replicas_agree`, `lines_once`): plain data in, violations out, unit-tested without a cluster.
  A condition that holds over consecutive samples is one violation naming the span, not one per
  sample.
- Node inspections (`node_leftovers`, `store_violations`): blocking reads of one simulated
  node's real state (call them in a thread). Several simulated nodes share this machine's
  /run/netns, cgroups and process table, so only what this node's state directory and network
  prefix name counts. `node_leftovers` reads (`read_node`) and then decides (`leftovers_in`, a
  pure function of what was read).

The simulator may not import the agent's runtime, host, volume or store modules (the
import-linter contract "The simulator runs the programs as a cluster would, never their
insides"), so what the agent names is re-derived here from the disk and the kernel, following
the agent's own naming, which each reader cites. The test leftover helpers (`mounts_under`,
`rclones_under`, `container_cgroups`) live here for the same reason: tests import them from here.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import socket
import subprocess
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import psutil

from control.models import TaskState
from control.tasks.dispatch import NOT_FOLLOWED

__all__ = [
    "NodeState",
    "NodeUnreadable",
    "TaskEnd",
    "Violation",
    "container_cgroups",
    "jobs_per_node",
    "leftovers_in",
    "lines_once",
    "mounts_under",
    "node_leftovers",
    "ran_twice",
    "rclones_under",
    "read_node",
    "replicas_agree",
    "store_violations",
    "summarize",
    "task_ends",
]

TRANSPORT_WORDS = ("connection lost", "transport broke", "BrokenResourceError", "reset by peer")
"""What the reason of a task that failed because a connection broke says (`WorkerUnavailable`'s
message): such a task was failed by the way to its worker, not by its container."""
TERMINAL_STATES = frozenset(state.value for state in TaskState if state.terminal)
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()
CHUNK_BYTES = 1 << 20
CGROUP_PARENT = "levers9"
"""A container's cgroup is `/levers9/<id>` (`agent.runtime.records.Container.cgroups_path`)."""
_HEX_NAME = re.compile(r"[0-9a-f]{64}")
_SHOWN = 3


@attrs.frozen
class Violation:
    """One broken invariant: `invariant` a short stable name, `detail` what is wrong, where."""

    invariant: str
    detail: str


@attrs.frozen
class TaskEnd:
    """What a task ended as (or is, if it has not ended), as a replica answered it."""

    state: str
    reason: str | None = None
    exit_code: int | None = None

    def describe(self) -> str:
        words = [self.state]
        if self.exit_code is not None:
            words.append(f"exit code {self.exit_code}")
        if self.reason:
            words.append(f"reason {self.reason!r}")
        return ", ".join(words)


def summarize(violations: Iterable[Violation]) -> dict[str, int]:
    """How many violations of each invariant, by name."""
    return dict(sorted(collections.Counter(v.invariant for v in violations).items()))


# -- what the campaign sampled --------------------------------------------------------------------


@attrs.define
class _Span:
    """Consecutive samples in which one key was in a bad state."""

    first_s: float
    last_s: float
    samples: int
    worst: int
    what: set[str]

    def when(self) -> str:
        if self.samples == 1:
            return f"at t={self.first_s:.1f} s"
        return f"from t={self.first_s:.1f} s to t={self.last_s:.1f} s ({self.samples} samples)"


def _spans(
    samples: Iterable[tuple[float, Mapping[str, tuple[int, Collection[str]]]]],
) -> list[tuple[str, _Span]]:
    """Each run of consecutive samples (by time) in which a key was bad; a sample maps each bad
    key to (how bad, what it names)."""
    open_spans: dict[str, _Span] = {}
    done: list[tuple[str, _Span]] = []
    for time_s, bad in sorted(samples, key=lambda sample: sample[0]):
        for key in [k for k in open_spans if k not in bad]:
            done.append((key, open_spans.pop(key)))
        for key, (level, what) in bad.items():
            span = open_spans.get(key)
            if span is None:
                open_spans[key] = _Span(time_s, time_s, 1, level, set(what))
            else:
                span.last_s = time_s
                span.samples += 1
                span.worst = max(span.worst, level)
                span.what.update(what)
    done.extend(open_spans.items())
    return sorted(done, key=lambda item: (item[1].first_s, item[0]))


def jobs_per_node(samples: Iterable[tuple[float, Mapping[str, int]]]) -> list[Violation]:
    """At every sample time, at most one active worker Job per node (node → active Job count)."""
    bad = (
        (time_s, {node: (count, ()) for node, count in counts.items() if count > 1})
        for time_s, counts in samples
    )
    return [
        Violation(
            "jobs-per-node",
            f"node {node} had {span.worst} active worker Jobs {span.when()}; a node may hold one",
        )
        for node, span in _spans(bad)
    ]


def ran_twice(samples: Iterable[tuple[float, Mapping[str, Collection[str]]]]) -> list[Violation]:
    """No task runs on two nodes at once (each sample: node → ids of the containers running)."""

    def doubles(running: Mapping[str, Collection[str]]) -> dict[str, tuple[int, set[str]]]:
        nodes: dict[str, set[str]] = collections.defaultdict(set)
        for node, ids in running.items():
            for task in ids:
                nodes[task].add(node)
        return {task: (len(on), on) for task, on in nodes.items() if len(on) > 1}

    return [
        Violation(
            "ran-twice",
            f"task {task} ran twice at once, on nodes {', '.join(sorted(span.what))}, "
            f"{span.when()}",
        )
        for task, span in _spans((time_s, doubles(running)) for time_s, running in samples)
    ]


# -- what the tasks ended as ----------------------------------------------------------------------


def task_ends(submitted: Collection[str], records: Mapping[str, TaskEnd]) -> list[Violation]:
    """Every submitted task is known and ended; one that did not succeed names a cause, one that
    succeeded exited 0."""
    found: list[Violation] = []
    for task in sorted(submitted):
        end = records.get(task)
        if end is None:
            found.append(
                Violation("task-vanished", f"task {task} was submitted but no replica knows it")
            )
        elif end.state not in TERMINAL_STATES:
            found.append(
                Violation("task-unfinished", f"task {task} has not ended: it is {end.describe()}")
            )
        elif end.state == TaskState.SUCCEEDED:
            if end.exit_code != 0:
                found.append(
                    Violation(
                        "task-exit-code",
                        f"task {task} succeeded with exit code {end.exit_code}; success is 0",
                    )
                )
        elif not (reason := (end.reason or "").strip()):
            found.append(
                Violation("task-no-cause", f"task {task} ended {end.state} without a reason")
            )
        elif NOT_FOLLOWED in reason:
            found.append(
                Violation(
                    "task-not-followed",
                    f"task {task} ended {end.state} with {reason!r}: the controlplane lost "
                    "track of it instead of naming a cause",
                )
            )
        elif end.state == TaskState.FAILED and any(w in reason for w in TRANSPORT_WORDS):
            found.append(
                Violation(
                    "task-failed-by-transport",
                    f"task {task} failed with {reason!r}: a connection that broke is a worker "
                    "to reach again, or a lost one, never the task's own failure",
                )
            )
    return found


def replicas_agree(views: Mapping[str, Mapping[str, TaskEnd]]) -> list[Violation]:
    """Every task answered by more than one replica is answered the same by all of them
    (replica name → task id → what it answered)."""
    answers: dict[str, dict[str, TaskEnd]] = collections.defaultdict(dict)
    for replica, tasks in views.items():
        for task, end in tasks.items():
            answers[task][replica] = end
    found = []
    for task, by_replica in sorted(answers.items()):
        if len(set(by_replica.values())) > 1:
            said = "; ".join(
                f"replica {replica} says {end.describe()}"
                for replica, end in sorted(by_replica.items())
            )
            found.append(Violation("replicas-disagree", f"task {task}: {said}"))
    return found


def lines_once(
    follower: str, task: str, lines: Sequence[str], expected: Sequence[str], *, complete: bool
) -> list[Violation]:
    """A log follower saw each line once, in order, and only expected lines; with `complete`
    (the task succeeded, so its whole log was there to see) none is missing.

    A line that `expected` holds k times may be seen k times: the n-th sighting is its n-th
    place. One violation per kind of fault, naming how many lines and the first.
    """
    places: dict[str, list[int]] = collections.defaultdict(list)
    for index, line in enumerate(expected):
        places[line].append(index)
    sightings: collections.Counter[str] = collections.Counter()
    duplicate: list[str] = []
    unexpected: list[str] = []
    disordered: list[str] = []
    last = -1
    for line in lines:
        if line not in places:
            unexpected.append(line)
            continue
        sightings[line] += 1
        if sightings[line] > len(places[line]):
            duplicate.append(line)
            continue
        place = places[line][sightings[line] - 1]
        if place < last:
            disordered.append(line)
        last = max(last, place)
    missing = [line for line in expected if sightings[line] < len(places[line])]
    missing = list(dict.fromkeys(missing))
    who = f"follower {follower} of task {task}"
    found = []
    for invariant, what, bad in (
        ("log-duplicate", "saw {} line(s) more than once, first {!r}", duplicate),
        ("log-order", "saw {} line(s) out of order, first {!r}", disordered),
        ("log-unexpected", "saw {} line(s) the task never wrote, first {!r}", unexpected),
        ("log-missing", "missed {} line(s) of a task that succeeded, first {!r}", missing),
    ):
        if bad and (invariant != "log-missing" or complete):
            found.append(Violation(invariant, f"{who} {what.format(len(bad), bad[0])}"))
    return found


# -- the object store -----------------------------------------------------------------------------


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def store_violations(node: str, state_dir: Path) -> list[Violation]:
    """Every object under `<state_dir>/objects/sha256/` is a file named by the sha256 of its
    content (`agent.store.objects`: an ingest writes in `objects/tmp/` and links into place only
    once the digest checked, so a file there being written is no excuse). Blocking."""
    directory = state_dir / "objects" / "sha256"
    try:
        entries = sorted(directory.iterdir())
    except FileNotFoundError:
        return []
    found = []
    for path in entries:
        name = path.name
        where = f"node {node}: {path}"
        try:
            if not _HEX_NAME.fullmatch(name) or not path.is_file() or path.is_symlink():
                found.append(
                    Violation("store-name", f"{where} is not an object file named by its digest")
                )
            elif path.stat().st_size == 0 and name != EMPTY_DIGEST:
                found.append(
                    Violation("store-truncated", f"{where}: object sha256:{name} is empty")
                )
            elif (actual := _sha256_of(path)) != name:
                found.append(
                    Violation(
                        "store-corrupt",
                        f"{where}: object sha256:{name} holds content whose digest is "
                        f"sha256:{actual}",
                    )
                )
        except FileNotFoundError:
            continue  # evicted while we looked
    return found


# -- what a node holds ----------------------------------------------------------------------------


def _real(path: Path) -> Path:
    # The kernel reports mount points with symlinks resolved.
    return Path(os.path.realpath(path))


def mounts_under(root: Path) -> list[Path]:
    """Mount points below `root` in this mount namespace, in the kernel's order."""
    root = _real(root)
    return [
        Path(part.mountpoint)
        for part in psutil.disk_partitions(all=True)
        if root in Path(part.mountpoint).parents
    ]


def rclones_under(root: Path) -> list[psutil.Process]:
    """rclone processes whose arguments name a path under `root`."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info.get("cmdline") or []
        named = cmdline[:1] and os.path.basename(cmdline[0]) == "rclone"
        if named and any(str(root) in arg for arg in cmdline):
            found.append(process)
    return found


def _cgroup_mounts() -> list[Path]:
    """Every mounted cgroup hierarchy: the unified one (v2) and each v1 one, as the agent's
    `remove_cgroup` walks them."""
    seen: dict[Path, None] = {}
    for part in psutil.disk_partitions(all=True):
        if part.fstype in ("cgroup", "cgroup2"):
            seen[Path(part.mountpoint)] = None
    return list(seen)


def container_cgroups(container_id: str) -> list[Path]:
    """The cgroup directories of `container_id` (`/levers9/<id>`) in every hierarchy."""
    return [
        mount / CGROUP_PARENT / container_id
        for mount in _cgroup_mounts()
        if (mount / CGROUP_PARENT / container_id).is_dir()
    ]


@attrs.frozen
class NodeState:
    """What `read_node` found of one node's containers on this machine."""

    runc: tuple[str, ...] = ()
    """Ids of the containers in the node's runc state (`<state_dir>/runc`)."""
    records: tuple[str, ...] = ()
    """Ids with a record directory (`<state_dir>/containers/<id>`)."""
    mounts: tuple[tuple[Path, str], ...] = ()
    """(mount point, file system type) of every mount below the state directory."""
    netns: tuple[str, ...] = ()
    """Names in /run/netns with the node's prefix (`<prefix>-<id>`)."""
    veths: tuple[tuple[str, str], ...] = ()
    """(name, alias) of the host interfaces named with the node's prefix (`<prefix>h<8 hex>`);
    the alias holds the container id ("" when a create died before naming it)."""
    cgroups: tuple[tuple[str, Path], ...] = ()
    """(container id, directory) of the cgroups of ids this node names anywhere above."""
    rclones: tuple[tuple[int, str], ...] = ()
    """(pid, command line) of rclone processes naming the state directory."""


class NodeUnreadable(Exception):
    """What a node holds could not be read; the message says what failed."""


def _runc_ids(state_dir: Path) -> list[str]:
    # `agent.runtime.runc.Runc` keeps its state in `<state_dir>/runc` (`agent.runtime.manager`).
    root = state_dir / "runc"
    result = subprocess.run(
        ["runc", "--root", str(root), "list", "--format", "json"],
        capture_output=True,
        check=False,
    )
    if result.returncode != 0:
        raise NodeUnreadable(
            f"runc --root {root} list failed (exit {result.returncode}): "
            f"{result.stderr.decode(errors='replace').strip()}"
        )
    return [str(entry["id"]) for entry in json.loads(result.stdout or b"null") or ()]


def _veths(prefix: str) -> list[tuple[str, str]]:
    # `agent.runtime.network.host_ifname`: the prefix, "h", the /30's address in 8 hex digits;
    # the interface's ifalias holds the container id.
    name_re = re.compile(rf"{re.escape(prefix)}h[0-9a-f]{{8}}")
    found = []
    for _, name in socket.if_nameindex():
        if name_re.fullmatch(name):
            try:
                alias = Path("/sys/class/net", name, "ifalias").read_text().strip()
            except OSError:
                continue  # gone meanwhile
            found.append((name, alias))
    return found


def _netns(prefix: str) -> list[str]:
    # `agent.runtime.network.Networking.netns_name`: /run/netns/<prefix>-<container id>.
    try:
        names = os.listdir("/run/netns")
    except FileNotFoundError:
        return []
    return sorted(name for name in names if name.startswith(f"{prefix}-"))


def _named_ids(state: NodeState, state_dir: Path, prefix: str) -> set[str]:
    """Every container id that something of this node names."""
    containers = _real(state_dir) / "containers"
    ids = set(state.runc) | set(state.records)
    ids |= {name[len(prefix) + 1 :] for name in state.netns}
    ids |= {alias for _, alias in state.veths if alias}
    for point, _ in state.mounts:
        if containers in point.parents:
            ids.add(point.relative_to(containers).parts[0])
    return ids


def read_node(state_dir: Path, network_prefix: str) -> NodeState:
    """Read what the node with this state directory and network prefix holds. Blocking."""
    containers = state_dir / "containers"
    records = sorted(p.name for p in containers.iterdir()) if containers.is_dir() else []
    real = _real(state_dir)
    mounts = tuple(
        (Path(part.mountpoint), part.fstype)
        for part in psutil.disk_partitions(all=True)
        if real in Path(part.mountpoint).parents
    )
    state = NodeState(
        runc=tuple(_runc_ids(state_dir)),
        records=tuple(records),
        mounts=mounts,
        netns=tuple(_netns(network_prefix)),
        veths=tuple(_veths(network_prefix)),
        rclones=tuple(
            (p.pid, " ".join(p.info.get("cmdline") or ())) for p in rclones_under(state_dir)
        ),
    )
    cgroups = tuple(
        (cid, path)
        for cid in sorted(_named_ids(state, state_dir, network_prefix))
        for path in container_cgroups(cid)
    )
    return attrs.evolve(state, cgroups=cgroups)


def leftovers_in(
    node: str, state_dir: Path, network_prefix: str, state: NodeState, owned: Collection[str]
) -> list[Violation]:
    """What of `state` belongs to no container in `owned`.

    Each thing's container id comes from its name, as the agent names it: runc's id, the
    directory below `<state_dir>/containers` (the overlay rootfs is `containers/<id>/rootfs`),
    the namespace's name after the prefix, the veth's alias, the cgroup's last part. Bucket
    mounts and their rclone processes carry no id: a mount is shared by every container of a
    workspace with the same bucket (`agent.volumes`), and who holds it is kept in the agent's
    memory only. They are left over when no container in `owned` has a record on this node.
    """
    owned = set(owned)
    root = _real(state_dir)
    containers, volumes = root / "containers", root / "volumes"
    found = []

    def add(invariant: str, what: str) -> None:
        found.append(Violation(invariant, f"node {node}: {what}"))

    for cid in state.runc:
        if cid not in owned:
            add("leftover-runc", f"runc still has container {cid} ({state_dir / 'runc'})")
    holding = owned & set(state.records)
    for point, fs_type in state.mounts:
        if containers in point.parents:
            cid = point.relative_to(containers).parts[0]
            if cid in owned:
                continue
            kind = "rootfs overlay" if fs_type == "overlay" else f"{fs_type} mount"
            add("leftover-rootfs", f"the {kind} of container {cid} is still mounted at {point}")
        elif volumes in point.parents:
            if not holding:
                add(
                    "leftover-bucket-mount",
                    f"bucket mount {point} ({fs_type}) is still there and no container of a "
                    "running task is on the node",
                )
        else:
            add("leftover-mount", f"{point} ({fs_type}) is mounted where the agent mounts nothing")
    for name in state.netns:
        cid = name[len(network_prefix) + 1 :]
        if cid not in owned:
            add("leftover-netns", f"network namespace /run/netns/{name} of container {cid} is left")
    for name, alias in state.veths:
        if not alias:
            add("leftover-veth", f"host interface {name} is left half made (no container id)")
        elif alias not in owned:
            add("leftover-veth", f"host interface {name} of container {alias} is left")
    cgroups: dict[str, list[Path]] = collections.defaultdict(list)
    for cid, path in state.cgroups:
        cgroups[cid].append(path)
    for cid, paths in sorted(cgroups.items()):
        if cid not in owned:
            others = len(paths) - 1
            more = f" and {others} other hierarch{'y' if others == 1 else 'ies'}" if others else ""
            add(
                "leftover-cgroup",
                f"cgroup /{CGROUP_PARENT}/{cid} of container {cid} is left ({paths[0]}{more})",
            )
    if not holding:
        for pid, cmdline in state.rclones:
            add(
                "leftover-rclone",
                f"rclone pid {pid} ({cmdline[:200]}) still runs and no container of a running "
                "task is on the node",
            )
    return found


def node_leftovers(
    node: str, state_dir: Path, network_prefix: str, owned: Collection[str]
) -> list[Violation]:
    """Every runc container, rootfs mount, bucket mount, network namespace, host veth, cgroup
    and rclone process of this node that no container in `owned` accounts for. `owned`: the ids
    of tasks whose records have not ended, and of those the caller knows are being cleaned up.

    Only a cgroup of an id this node names somewhere (its runc state, records, mounts or
    network) counts: `/levers9/<id>` is shared by every agent on the machine. Blocking.
    """
    try:
        state = read_node(state_dir, network_prefix)
    except (NodeUnreadable, OSError) as exc:
        return [Violation("node-unreadable", f"node {node}: its leftovers cannot be read: {exc}")]
    return leftovers_in(node, state_dir, network_prefix, state, owned)
