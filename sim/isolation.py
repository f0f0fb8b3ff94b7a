"""`python -m sim.isolation -- COMMAND...`: runs COMMAND (the test suite, a fault campaign) with
the host-wide names a worker uses made its own, so that two runs on one machine do not meet.

A worker names things the whole host shares: network namespaces under /run/netns, veths, nft
tables, link-local routes, listening ports, and cgroups under `/levers9`. The tests and the
simulated nodes give each worker of a run its own names, but two runs side by side (a second
`make test`, a campaign beside the tests) gave theirs the same ones, and one run's sweep removed
the other's namespaces. As root, COMMAND gets what a container engine gives each CI job:

- a network namespace of its own (only `lo`, up), with its own /run/netns and a /sys that
  shows that namespace's links;
- `/levers9` in every cgroup hierarchy bound to a cgroup of this run (`/levers9-run-ID`),
  removed when COMMAND ends (one left with processes in it is named on stderr).

Elsewhere (not root, no `unshare`, or LEVERS9_ISOLATION=off) COMMAND runs as it is, and the
reason is printed.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

CGROUP_PARENT = "levers9"
"""The cgroup every worker puts its containers under (`agent.runtime.ocispec.CGROUP_PARENT`)."""

OFF_VARIABLE = "LEVERS9_ISOLATION"


@attrs.frozen
class Mount:
    """One line of /proc/self/mountinfo: the mount's id, its parent's, where and what."""

    mount_id: int
    parent_id: int
    point: str
    fstype: str


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a /proc/PID/mountinfo (proc(5)); octal escapes in paths are decoded."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 7 or "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)
        point = fields[4].encode().decode("unicode_escape")
        mounts.append(Mount(int(fields[0]), int(fields[1]), point, fields[separator + 1]))
    return mounts


def cgroup_hierarchies(mounts: Sequence[Mount]) -> list[str]:
    """Where each cgroup hierarchy (v1 and v2) is mounted, each once; a cgroup mount inside
    another (an outer run's `/levers9`) is not one."""
    points = [m.point for m in mounts if m.fstype in ("cgroup", "cgroup2")]
    seen: list[str] = []
    for point in points:
        inside_another = any(point.startswith(other + "/") for other in points)
        if not inside_another and point not in seen:
            seen.append(point)
    return seen


def mounts_under_sys(mounts: Sequence[Mount]) -> list[str]:
    """The mounts directly on top of /sys (its cgroup tree, fuse's connections, ...): a new
    sysfs on /sys would hide them, so they are carried over it."""
    sys_ids = {m.mount_id for m in mounts if m.point == "/sys"}
    return [m.point for m in mounts if m.parent_id in sys_ids and m.point != "/sys"]


def why_not(
    environ: Mapping[str, str], euid: int, unshare: str | None, refused: str | None = None
) -> str | None:
    """Why COMMAND runs without a namespace of its own; None when it gets one. `refused`:
    what a trial `unshare` said, when it could not make the namespaces (a container without
    the right to)."""
    if environ.get(OFF_VARIABLE, "").lower() == "off":
        return f"{OFF_VARIABLE}=off"
    if euid != 0:
        return "not root (the tests that need root skip)"
    if unshare is None:
        return "no unshare(1) on PATH (util-linux)"
    if refused is not None:
        return f"unshare --net --mount is not allowed here: {refused}"
    return None


def _trial(unshare: str | None) -> str | None:
    """What `unshare --net --mount true` said when it failed; None when it worked."""
    if unshare is None:
        return None
    done = subprocess.run(
        [unshare, "--net", "--mount", "true"], check=False, capture_output=True, text=True
    )
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


def _run(*argv: str) -> None:
    done = subprocess.run(argv, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"isolation: {' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}; "
            f"set {OFF_VARIABLE}=off to run without it"
        )


def _inside(run_id: str, command: Sequence[str]) -> None:
    """In the new network and mount namespaces (mounts private): the namespace's own /run/netns
    and /sys, this run's cgroups on `/levers9`, `lo` up; then COMMAND in place of this process."""
    mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    Path("/run/netns").mkdir(parents=True, exist_ok=True)
    _run("mount", "-t", "tmpfs", "-o", "mode=0755", "levers9-netns", "/run/netns")
    with tempfile.TemporaryDirectory(prefix="levers9-isolation-") as keep:
        carried = []
        for index, point in enumerate(mounts_under_sys(mounts)):
            place = Path(keep, str(index))
            place.mkdir()
            _run("mount", "--rbind", point, str(place))
            carried.append((place, point))
        _run("mount", "-t", "sysfs", "sysfs", "/sys")
        for place, point in carried:
            _run("mount", "--move", str(place), point)
    for hierarchy in cgroup_hierarchies(mounts):
        _run("mount", "--bind", f"{hierarchy}/{run_id}", f"{hierarchy}/{CGROUP_PARENT}")
    _run("ip", "link", "set", "lo", "up")
    os.execvp(command[0], list(command))


def _make_cgroups(hierarchies: Sequence[str]) -> str:
    """A run id whose cgroup `/levers9-run-ID` is new in every hierarchy, and `/levers9` there
    to bind it on."""
    while True:
        run_id = f"{CGROUP_PARENT}-run-{secrets.token_hex(4)}"
        if not any(Path(h, run_id).exists() for h in hierarchies):
            break
    for hierarchy in hierarchies:
        Path(hierarchy, CGROUP_PARENT).mkdir(exist_ok=True)
        Path(hierarchy, run_id).mkdir()
    return run_id


def _remove_cgroups(hierarchies: Sequence[str], run_id: str) -> list[str]:
    """Removes the run's cgroups, deepest first; the ones that would not go (processes left)."""
    left = []
    for hierarchy in hierarchies:
        top = Path(hierarchy, run_id)
        if not top.is_dir():
            continue
        for directory, _, _ in sorted(os.walk(top), key=lambda w: -len(Path(w[0]).parts)):
            try:
                os.rmdir(directory)
            except OSError as exc:
                left.append(f"{directory} ({exc.strerror})")
    return left


def main(argv: Sequence[str]) -> int:
    if len(argv) >= 3 and argv[0] == "--inside" and argv[2] == "--":
        _inside(argv[1], argv[3:])
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: python -m sim.isolation -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    command = argv[1:]
    unshare_path = shutil.which("unshare")
    refused = _trial(unshare_path) if os.geteuid() == 0 else None
    reason = why_not(os.environ, os.geteuid(), unshare_path, refused)
    if reason is not None:
        print(f"isolation: running {command[0]} on the host's own network ({reason})", flush=True)
        os.execvp(command[0], list(command))
    hierarchies = cgroup_hierarchies(parse_mountinfo(Path("/proc/self/mountinfo").read_text()))
    run_id = _make_cgroups(hierarchies)
    try:
        inner = [sys.executable, "-m", "sim.isolation", "--inside", run_id, "--", *command]
        unshare = ["unshare", "--net", "--mount", "--propagation", "private", *inner]
        child = subprocess.Popen(unshare)
        # Ctrl-C reaches COMMAND (the same process group), which ends as it chooses; SIGTERM is
        # passed on. Either way this process waits for it, to remove the cgroups after.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))
        code = child.wait()
        return 128 - code if code < 0 else code  # ended by a signal: as a shell reports it
    finally:
        for line in _remove_cgroups(hierarchies, run_id):
            print(f"isolation: cgroup left: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
