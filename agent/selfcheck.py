"""`levers9-agent self-check`: can this worker do its job on this node, and if not, what to do.

An operator runs it in the worker image (`kubectl exec`, or as a Job) when a worker does not
register or serves fewer cards than expected. It is a table of checks, each ok / warn / fail with
a one-line reason and, when not ok, what to do; `--json` prints the same for scripts; the exit
status is 1 when any check fails.

Checks come in sections. A section is one function from a `SelfCheckContext` to checks, listed in
`SECTIONS`; adding a section is writing that function and listing it. A section that crashes
becomes a failed check rather than hiding the others.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import attrs

from agent.gpus import (
    CONTROL_DEVICES,
    CardState,
    Claim,
    GpuConfig,
    NodeFiles,
    decide_claim,
    discover_node_files,
    read_assignment,
)
from agent.runc import checkpoint_support
from nvml import NvmlUnavailableError, Snapshot, open_nvml


class Status(enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@attrs.frozen
class Check:
    section: str
    name: str
    status: Status
    reason: str
    action: str = ""
    """What to do about it; empty when there is nothing to do."""


@attrs.frozen
class SelfCheckContext:
    """What every section may read: the process environment, passed in so tests can set it."""

    environ: Mapping[str, str]


Section = Callable[[SelfCheckContext], Iterable[Check]]


# -- GPU section ----------------------------------------------------------------------------------


def _gpu_claim_checks(claim: Claim) -> list[Check]:
    checks = [
        Check(
            "gpu",
            f"card {card.index}",
            Status.OK if card.state is CardState.SERVING else Status.WARN,
            f"{card.uuid}, {card.model}, {card.memory_total_bytes / 2**30:.0f} GiB: serving"
            if card.state is CardState.SERVING
            else f"{card.model}, {card.memory_total_bytes / 2**30:.0f} GiB: refused: {card.reason}",
            card.action,
        )
        for card in claim.cards
    ]
    checks += [
        Check("gpu", f"card {u.ref}", Status.WARN, u.reason, u.action) for u in claim.unresolved
    ]
    serving = len(claim.serving)
    if serving:
        checks.append(
            Check(
                "gpu",
                "claim",
                Status.OK,
                f"{serving} of {len(claim.cards)} cards serve, as given by {claim.source}",
            )
        )
    else:
        why = "; ".join(claim.notes) or "every card given to this pod was refused (see above)"
        checks.append(
            Check(
                "gpu",
                "claim",
                Status.FAIL,
                f"no card can serve (cards from {claim.source}): {why}",
                "give the worker pod cards (request nvidia.com/gpu) that are healthy and unused",
            )
        )
    return checks


def _gpu_file_checks(claim: Claim | None, files: NodeFiles, config: GpuConfig) -> list[Check]:
    checks = []
    cdi = files.cdi_specs[0].path if files.cdi_specs else None
    wanted = [c.device_name for c in claim.serving] if claim else []
    missing = [name for name in wanted if name not in files.device_files]
    if "nvidiactl" not in files.device_files:
        missing.insert(0, "nvidiactl")
    present = [n for n in CONTROL_DEVICES if n in files.device_files]
    if missing:
        checks.append(
            Check(
                "gpu",
                "device nodes",
                Status.FAIL,
                "missing under " + str(files.dev_dir) + ": " + ", ".join(missing),
                "run the worker privileged with the node's /dev; check the driver on the node",
            )
        )
    else:
        checks.append(
            Check(
                "gpu",
                "device nodes",
                Status.OK,
                f"present under {files.dev_dir}: " + ", ".join([*wanted, *present]),
            )
        )
    if "nvidia-uvm" not in files.device_files:
        checks.append(
            Check(
                "gpu",
                "nvidia-uvm",
                Status.WARN,
                f"{files.dev_dir / 'nvidia-uvm'} is not there yet; CUDA programs need it",
                "load it on the node with nvidia-modprobe -u -c=0 (the first CUDA program on the "
                "node also does)",
            )
        )
    if files.driver_dir_present:
        checks.append(
            Check(
                "gpu",
                "driver directory",
                Status.OK,
                f"{config.driver_dir} (has {', '.join(files.driver_subdirs) or 'no bin/ or lib/'})"
                f"; containers see it at {config.driver_container_dir}",
            )
        )
    elif cdi is not None:
        checks.append(
            Check("gpu", "driver directory", Status.OK, f"containers get CDI spec {cdi}'s edits")
        )
    else:
        checks.append(
            Check(
                "gpu",
                "driver directory",
                Status.FAIL,
                f"{config.driver_dir} is missing and no NVIDIA CDI spec was found",
                "mount the node's driver files there (GKE: hostPath /home/kubernetes/bin/nvidia) "
                "or set LEVERS9_GPU_DRIVER_DIR",
            )
        )
    if cdi is not None and files.driver_dir_present:
        checks.append(Check("gpu", "CDI", Status.OK, f"containers get CDI spec {cdi}'s edits"))
    checks += [
        Check("gpu", "CDI", Status.WARN, problem, "fix or remove the file")
        for problem in files.problems
    ]
    return checks


def gpu_section(context: SelfCheckContext) -> list[Check]:
    """NVML loads, the driver's version, each card and its claim state, device nodes, the
    driver directory."""
    config = GpuConfig.from_environ(context.environ)
    checks: list[Check] = []
    claim: Claim | None = None
    try:
        with open_nvml() as nvml:
            snapshot: Snapshot = nvml.snapshot()
    except NvmlUnavailableError as exc:
        checks.append(Check("gpu", "nvml", Status.FAIL, exc.message, exc.action))
    else:
        count = len(snapshot.devices) + len(snapshot.unreachable)
        checks.append(Check("gpu", "nvml", Status.OK, f"NVML loads and lists {count} cards"))
        cuda = f", CUDA {snapshot.cuda_driver_version}" if snapshot.cuda_driver_version else ""
        checks.append(Check("gpu", "driver", Status.OK, f"driver {snapshot.driver_version}{cuda}"))
        assignment = read_assignment(config, context.environ)
        # The self-check runs beside the agent, not as it, so it cannot know the pids of the
        # agent's containers: a card busy with one of them shows as held by a foreign process.
        claim = decide_claim(assignment, snapshot, own_pids={os.getpid()})
        checks += _gpu_claim_checks(claim)
    checks += _gpu_file_checks(claim, discover_node_files(config), config)
    return checks


# -- containers section ---------------------------------------------------------------------------


def _command_version(argv: Sequence[str]) -> str | None:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    return (result.stdout or result.stderr).strip().splitlines()[0] if result.stdout else ""


def containers_section(context: SelfCheckContext) -> list[Check]:
    """Root, runc, the kernel's overlay filesystem and cgroups, nftables, the state directory,
    and whether process checkpoints (criu) work here."""
    checks: list[Check] = []
    if os.geteuid() == 0:
        checks.append(Check("containers", "root", Status.OK, "running as root"))
    else:
        checks.append(
            Check(
                "containers",
                "root",
                Status.FAIL,
                "not running as root: containers need a privileged worker",
                "run the worker pod privileged (the worker Job does)",
            )
        )
    runc = _command_version(["runc", "--version"])
    if runc is None:
        checks.append(
            Check("containers", "runc", Status.FAIL, "runc is missing or broken", "install runc")
        )
    else:
        checks.append(Check("containers", "runc", Status.OK, runc))
    try:
        filesystems = Path("/proc/filesystems").read_text()
    except OSError:
        filesystems = ""
    if "overlay" in filesystems.split():
        checks.append(Check("containers", "overlayfs", Status.OK, "the kernel has overlayfs"))
    else:
        checks.append(
            Check(
                "containers",
                "overlayfs",
                Status.FAIL,
                "the kernel does not list overlay in /proc/filesystems",
                "load the overlay module (modprobe overlay) on the node",
            )
        )
    memory = Path("/sys/fs/cgroup/memory")
    unified = Path("/sys/fs/cgroup/cgroup.controllers")
    if memory.is_dir() or (unified.is_file() and "memory" in unified.read_text()):
        checks.append(Check("containers", "cgroups", Status.OK, "the memory controller is mounted"))
    else:
        checks.append(
            Check(
                "containers",
                "cgroups",
                Status.FAIL,
                "no memory cgroup controller under /sys/fs/cgroup",
                "mount the node's cgroup filesystem into the worker pod",
            )
        )
    nft = _command_version(["nft", "--version"])
    if nft is None:
        checks.append(
            Check(
                "containers",
                "nftables",
                Status.FAIL,
                "nft is missing: containers' NAT and metadata block need it",
                "install nftables in the worker image",
            )
        )
    else:
        checks.append(Check("containers", "nftables", Status.OK, nft))
    state_dir = Path(context.environ.get("LEVERS9_STATE_DIR") or "/var/lib/levers9")
    probe = state_dir if state_dir.exists() else state_dir.parent
    if state_dir.exists() and not state_dir.is_dir():
        checks.append(
            Check(
                "containers",
                "state dir",
                Status.FAIL,
                f"{state_dir} is not a directory",
                "point LEVERS9_STATE_DIR at a node-local directory (the worker Job mounts one)",
            )
        )
    elif os.access(probe, os.W_OK):
        free = shutil.disk_usage(probe).free
        checks.append(
            Check(
                "containers",
                "state dir",
                Status.OK,
                f"{state_dir} is writable, {free >> 30} GiB free",
            )
        )
    else:
        checks.append(
            Check(
                "containers",
                "state dir",
                Status.FAIL,
                f"{state_dir} is not writable",
                "mount a node-local hostPath there (the worker Job does) or set LEVERS9_STATE_DIR",
            )
        )
    supported, why = checkpoint_support()
    if supported:
        checks.append(Check("containers", "checkpoint", Status.OK, "criu check passes"))
    else:
        checks.append(
            Check(
                "containers",
                "checkpoint",
                Status.WARN,
                f"process checkpoint is unavailable on this node: {why}",
                "filesystem snapshots work; for process checkpoints use a kernel criu supports",
            )
        )
    return checks


SECTIONS: tuple[Section, ...] = (gpu_section, containers_section)


# -- running and showing --------------------------------------------------------------------------


def run_checks(context: SelfCheckContext, sections: Sequence[Section] = SECTIONS) -> list[Check]:
    """Every section's checks, in order; a section that raises becomes one failed check."""
    checks: list[Check] = []
    for section in sections:
        name = section.__name__.removesuffix("_section")
        try:
            checks += list(section(context))
        except Exception as exc:
            checks.append(
                Check(
                    name,
                    "self-check",
                    Status.FAIL,
                    f"this section's checks crashed: {type(exc).__name__}: {exc}",
                    "report this as a levers9 bug, with this output",
                )
            )
    return checks


def render_table(checks: Sequence[Check]) -> str:
    """For people: one line per check, what to do indented below it."""
    rows = [("STATUS", "SECTION", "CHECK", "REASON")]
    rows += [(c.status.value, c.section, c.name, c.reason) for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = []
    for row, check in zip(rows, (None, *checks), strict=True):
        lines.append(
            "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True))
            + "  "
            + row[3]
        )
        if check is not None and check.action and check.status is not Status.OK:
            lines.append(" " * (sum(widths) + 6) + "-> " + check.action)
    counts = {s: sum(1 for c in checks if c.status is s) for s in Status}
    lines.append("")
    lines.append(", ".join(f"{counts[s]} {s.value}" for s in Status))
    return "\n".join(lines)


def render_json(checks: Sequence[Check]) -> str:
    """For scripts: {"ok": bool, "checks": [{section, name, status, reason, action}]}."""
    return json.dumps(
        {
            "ok": all(c.status is not Status.FAIL for c in checks),
            "checks": [
                {
                    "section": c.section,
                    "name": c.name,
                    "status": c.status.value,
                    "reason": c.reason,
                    "action": c.action,
                }
                for c in checks
            ],
        },
        indent=2,
    )


def main_self_check(argv: list[str]) -> int:
    """`levers9-agent self-check [--json]`: 0 when no check fails, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="levers9-agent self-check",
        description="Check that this worker can use the node: GPUs, driver, device nodes.",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = parser.parse_args(argv)
    checks = run_checks(SelfCheckContext(environ=dict(os.environ)))
    print(render_json(checks) if args.json else render_table(checks))
    return 1 if any(c.status is Status.FAIL for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main_self_check(sys.argv[1:]))
