"""The one adapter for runc, and the Python side of the container shim.

Why: every way runc can fail (a container that is gone, a command that is not in the image, a
kernel feature that is missing) must reach the user as our own error with runc's own words in
it. Only this module runs `runc`; it reads runc's JSON log lines, picks the message of the last
error and turns it into a `RuncError` whose code says what the caller can do.

Containers are started through `levers9-shim` (see `agent/shim/levers9-shim.c`), never as the
agent's children: the shim holds the container's pipes, writes its log and records its exit
status, so all three survive the agent being killed. The agent keeps only file paths and the
shim's pid; `wait_exit` wakes on a pidfd when the shim exits and reads the exit file, and works
the same from a restarted agent through the recorded `shim.pid`.

Cgroups (limits read back, OOM kills, removal after delete) are read straight from cgroupfs; both
v1 hierarchies (this machine's hybrid layout) and the v2 unified one are handled.
"""

from __future__ import annotations

import array
import builtins
import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal as signals
import socket
import struct
import subprocess
import tempfile
import termios
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from agent.host.cgroups import remove_cgroup
from wire.errors import ApiError, ErrorCode

_REPORT_MAX_BYTES = 256 * 1024
_CLEANUP_DEADLINE_S = 10.0


class RuncError(ApiError):
    """runc (or the shim) refused or failed; the message quotes runc's own words."""


class ShimLost(RuncError):
    """The shim ended without recording the container's exit: its status is unknown."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INTERNAL, message)


@attrs.frozen
class RuncState:
    id: str
    status: str
    """created, running, paused or stopped."""
    pid: int
    bundle: str


@attrs.frozen
class ExitStatus:
    exit_code: int
    """The process's exit code, or 128 + the signal that killed it (137 for SIGKILL and OOM)."""
    signal: int | None
    finished_at: str
    """RFC 3339 with nanoseconds, UTC."""


@attrs.frozen
class ShimHandle:
    """A started container: what `wait_exit` needs, all of it also on disk."""

    container_id: str
    pid: int
    """The container's init, in the node's PID namespace."""
    shim_pid: int
    exit_path: Path
    shim_pid_path: Path
    log_path: Path


# -- runc's messages -------------------------------------------------------------------------------


def runc_message(output: str) -> str:
    """runc's error message out of its output: the `msg` of the last JSON line at level error
    (or fatal), else the last line that is not JSON."""
    found = ""
    plain = ""
    for raw in output.splitlines():
        line = raw.strip()
        if not line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            plain = line
            continue
        if isinstance(entry, dict) and entry.get("level") in ("error", "fatal"):
            found = str(entry.get("msg", ""))
    return found or plain or "runc gave no message"


_BAD_COMMAND = (
    "executable file not found",
    "no such file or directory",
    "permission denied",
    "not a directory",
    "exec format error",
)


def error_code(message: str, *, starting: bool = False) -> ErrorCode:
    """What the caller can do about a runc failure with this message."""
    text = message.lower()
    if "already exists" in text or "container with id exists" in text:
        return ErrorCode.ALREADY_EXISTS
    if not starting and "does not exist" in text:
        return ErrorCode.NOT_FOUND
    if any(marker in text for marker in _BAD_COMMAND):
        return ErrorCode.INVALID_ARGUMENT
    if "not running" in text or "stopped" in text or "paused" in text:
        return ErrorCode.FAILED_PRECONDITION
    return ErrorCode.INTERNAL


def _runc_error(action: str, container_id: str, message: str) -> RuncError:
    code = error_code(message)
    if not container_id:
        return RuncError(code, f"runc {action} failed: {message}")
    if code is ErrorCode.NOT_FOUND:
        return RuncError(
            code,
            f"container {container_id!r} does not exist on this node (runc {action}: {message})",
        )
    hint = {
        ErrorCode.INVALID_ARGUMENT: "; check the command and that it exists in the image",
        ErrorCode.FAILED_PRECONDITION: "; check the container's state first",
    }.get(code, "")
    return RuncError(code, f"runc {action} of container {container_id!r} failed: {message}{hint}")


# -- runc ------------------------------------------------------------------------------------------


class Runc:
    """runc with one state directory (`--root`). Every call is a new runc process."""

    def __init__(self, root: Path, *, binary: str = "runc", shim: Path | None = None) -> None:
        self.root = root
        self.binary = binary
        self._shim = shim

    def __repr__(self) -> str:
        return f"Runc(root={str(self.root)!r}, binary={self.binary!r})"

    async def _run(self, action: str, container_id: str, *args: str) -> bytes:
        command = [self.binary, "--root", str(self.root), "--log-format", "json", action, *args]
        try:
            result = await trio.run_process(
                command,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                deliver_cancel=_kill_at_once,
            )
        except FileNotFoundError:
            raise RuncError(
                ErrorCode.FAILED_PRECONDITION,
                f"runc was not found ({self.binary!r}): install runc on this node",
            ) from None
        if result.returncode != 0:
            message = runc_message(result.stderr.decode(errors="replace"))
            raise _runc_error(action, container_id, message)
        return result.stdout

    async def state(self, container_id: str) -> RuncState | None:
        """The container's state, or None if runc does not know it."""
        try:
            out = await self._run("state", container_id, container_id)
        except RuncError as exc:
            if exc.code is ErrorCode.NOT_FOUND:
                return None
            raise
        return _state(json.loads(out))

    async def list(self) -> builtins.list[RuncState]:
        out = await self._run("list", "", "--format", "json")
        return [_state(entry) for entry in json.loads(out or b"null") or ()]

    async def kill(
        self, container_id: str, signal: int = 15, *, all_processes: bool = False
    ) -> None:
        args = ["--all"] if all_processes else []
        await self._run("kill", container_id, *args, container_id, str(int(signal)))

    async def delete(self, container_id: str, *, force: bool = False) -> None:
        """Deletes the container's runc state (and, with `force`, kills it first); a container
        runc does not know is no error."""
        args = ["--force"] if force else []
        try:
            await self._run("delete", container_id, *args, container_id)
        except RuncError as exc:
            if exc.code is not ErrorCode.NOT_FOUND:
                raise

    async def pause(self, container_id: str) -> None:
        """Freezes every process of the container (cgroup freezer)."""
        await self._run("pause", container_id, container_id)

    async def resume(self, container_id: str) -> None:
        await self._run("resume", container_id, container_id)

    async def _shim_binary(self) -> Path:
        if self._shim is None:
            from agent.runtime.shim import shim_path

            self._shim = await trio.to_thread.run_sync(shim_path)
        return self._shim

    async def exec(self, container_id: str, process: dict[str, Any], *, tty: bool) -> ExecProcess:
        """Starts `process` (see `agent.runtime.ocispec.exec_process`) in a running container.

        Without a TTY the returned object's `stdin`, `stdout` and `stderr` are pipes; with one,
        its `terminal` is the pty's master. Either way `wait()` gives the exit code.

        runc 1.1 refuses `--console-socket` unless it detaches, and a process left behind by a
        detached runc is nobody's child, so its exit code would be lost. So both modes run
        through the shim's exec mode: it runs `runc exec --detach`, is the subreaper the process
        re-parents to, and exits with the process's status.
        """
        shim = await self._shim_binary()
        workdir = Path(tempfile.mkdtemp(prefix="levers9-exec-"))
        listener: trio.socket.SocketType | None = None
        try:
            process_file = workdir / "process.json"
            process_file.write_text(json.dumps({**process, "terminal": tty}))
            argv = [
                str(shim),
                "exec",
                "--id",
                container_id,
                "--runc",
                self.binary,
                "--root",
                str(self.root),
                "--runc-log",
                str(workdir / "runc.log"),
                "--pid-file",
                str(workdir / "exec.pid"),
                "--process",
                str(process_file),
            ]
            if tty:
                console = workdir / "console.sock"
                listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                await listener.bind(str(console))
                listener.listen(1)
                argv += ["--console-socket", str(console)]
            stdio = subprocess.DEVNULL if tty else subprocess.PIPE

            async def abandon(report: bytes) -> None:
                ok = _parse_ok(report)
                if ok:
                    _kill_quietly(ok[0])

            shim_process, report = await _start_shim(argv, stdio=stdio, abandon=abandon)
            ok = _parse_ok(report)
            if ok is None:
                with trio.CancelScope(shield=True):
                    await _close_process(shim_process)
                message = _report_message(report)
                raise _runc_error("exec", container_id, message)
            pid = ok[0]
            terminal = None
            if listener is not None:
                try:
                    terminal = PtyStream(await _receive_pty(listener))
                except BaseException:
                    _kill_quietly(pid)
                    with trio.CancelScope(shield=True):
                        await _close_process(shim_process)
                    raise
            return ExecProcess(shim_process, pid, terminal)
        finally:
            if listener is not None:
                listener.close()
            shutil.rmtree(workdir, ignore_errors=True)


async def _kill_at_once(process: trio.Process) -> None:
    """How a cancelled runc call ends: SIGKILL at once, not trio's SIGTERM and 5 s wait. runc's
    commands are short and keep their state on disk, and a cleanup cancels one only when its
    deadline has passed (a runc that hangs must not hold up the agent's shutdown)."""
    process.kill()


def _state(entry: dict[str, Any]) -> RuncState:
    return RuncState(
        id=str(entry["id"]),
        status=str(entry["status"]),
        pid=int(entry.get("pid") or 0),
        bundle=str(entry.get("bundle", "")),
    )


# -- exec ------------------------------------------------------------------------------------------


class PtyStream(trio.abc.Stream):
    """The master side of an exec's pty. The kernel answers EIO once the process side is closed;
    that reads here as end of stream."""

    def __init__(self, fd: int) -> None:
        self._stream = trio.lowlevel.FdStream(fd)

    def fileno(self) -> int:
        return self._stream.fileno()

    def resize(self, rows: int, columns: int) -> None:
        fcntl.ioctl(self.fileno(), termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        try:
            return await self._stream.receive_some(max_bytes)
        except trio.BrokenResourceError as exc:
            cause = exc.__cause__
            if isinstance(cause, OSError) and cause.errno == errno.EIO:
                return b""
            raise

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()


@attrs.define(eq=False)
class ExecProcess:
    """A process started in a container. The caller owns it: pump its streams, then `wait()`
    (or `aclose()` to kill it)."""

    process: trio.Process
    """The shim that waits for the process; its exit status is the process's."""
    pid: int
    """The exec'd process in the node's PID namespace."""
    terminal: PtyStream | None = None

    @property
    def stdin(self) -> trio.abc.SendStream | None:
        return self.process.stdin

    @property
    def stdout(self) -> trio.abc.ReceiveStream | None:
        return self.process.stdout

    @property
    def stderr(self) -> trio.abc.ReceiveStream | None:
        return self.process.stderr

    def resize(self, rows: int, columns: int) -> None:
        if self.terminal is None:
            raise RuncError(
                ErrorCode.FAILED_PRECONDITION,
                f"exec process {self.pid} has no terminal to resize; start it with a TTY",
            )
        self.terminal.resize(rows, columns)

    async def wait(self) -> int:
        """The exit code: the process's own, or 128 + the signal that killed it."""
        code = await self.process.wait()
        return code if code >= 0 else 128 - code

    async def aclose(self) -> None:
        """Kills the process if it still runs and releases its streams."""
        if self.process.returncode is None:
            _kill_quietly(self.pid)
        with trio.CancelScope(shield=True):
            if self.terminal is not None:
                await self.terminal.aclose()
            await _close_process(self.process)


async def _close_process(process: trio.Process) -> None:
    """Closes our ends of the process's pipes and waits for it, `_CLEANUP_DEADLINE_S` at most
    (callers shield it): then SIGKILL, and a short wait more (a process stuck in the kernel
    stays a zombie rather than hold up a shutdown)."""
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None:
            await stream.aclose()
    with trio.move_on_after(_CLEANUP_DEADLINE_S):
        await process.wait()
        return
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    with trio.move_on_after(1):
        await process.wait()


async def _receive_pty(listener: trio.socket.SocketType) -> int:
    """The pty master runc sends on its console socket (SCM_RIGHTS)."""
    connection, _ = await listener.accept()
    with connection:
        fds = array.array("i")
        _, ancillary, _, _ = await connection.recvmsg(4096, socket.CMSG_SPACE(4 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if not fds:
        raise RuncError(ErrorCode.INTERNAL, "runc sent no terminal on the console socket")
    for extra in fds[1:]:
        os.close(extra)
    return fds[0]


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signals.SIGKILL)
    except ProcessLookupError:
        pass


# -- the shim --------------------------------------------------------------------------------------


async def _read_to_eof(stream: trio.lowlevel.FdStream) -> bytes:
    chunks = bytearray()
    while len(chunks) < _REPORT_MAX_BYTES:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        chunks += chunk
    return bytes(chunks)


async def _start_shim(
    argv: Sequence[str],
    *,
    stdio: int,
    abandon: Callable[[bytes], Awaitable[None]],
) -> tuple[trio.Process, bytes]:
    """Starts the shim and reads its report from the sync pipe until the shim closes it.

    If we are cancelled meanwhile the shim still finishes what it started; we then read its
    report anyway (bounded, shielded) and let `abandon` undo it, so nothing is left running.
    """
    read_fd, write_fd = os.pipe()
    try:
        process = await trio.lowlevel.open_process(
            [*argv, "--sync-fd", str(write_fd)],
            stdin=stdio,
            stdout=stdio,
            stderr=stdio,
            pass_fds=(write_fd,),
        )
    except BaseException as exc:
        os.close(read_fd)
        if isinstance(exc, OSError):
            raise RuncError(
                ErrorCode.FAILED_PRECONDITION,
                f"the container shim {argv[0]} cannot be run ({exc.strerror}); rebuild it with "
                "agent.runtime.shim.shim_path",
            ) from None
        raise
    finally:
        os.close(write_fd)
    stream = trio.lowlevel.FdStream(read_fd)
    try:
        report = await _read_to_eof(stream)
    except BaseException:
        with trio.CancelScope(shield=True, deadline=trio.current_time() + _CLEANUP_DEADLINE_S):
            report = await _read_to_eof(stream)
            await abandon(report)
            await _close_process(process)
        raise
    finally:
        stream.close()
    return process, report


def _parse_ok(report: bytes) -> tuple[int, ...] | None:
    first = report.split(b"\n", 1)[0].split()
    if len(first) >= 2 and first[0] == b"ok":
        try:
            return tuple(int(word) for word in first[1:])
        except ValueError:
            return None
    return None


def _report_message(report: bytes) -> str:
    head, _, rest = report.decode(errors="replace").partition("\n")
    if not head:
        return "the shim ended without a report"
    message = runc_message(rest)
    return message if rest.strip() else head.removeprefix("error ").strip()


def _cgroups_path_of(bundle: Path) -> str | None:
    try:
        config = json.loads((bundle / "config.json").read_text())
        path = config["linux"]["cgroupsPath"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if isinstance(path, str) and path.startswith("/") else None


def _already_exists(container_id: str) -> RuncError:
    return RuncError(
        ErrorCode.ALREADY_EXISTS,
        f"container {container_id!r} could not start: runc already has a container with this "
        "id; delete it first",
    )


def _prepare_start(
    runc_root: Path,
    container_id: str,
    bundle: Path,
    log_path: Path,
    exit_path: Path,
    shim_pid_path: Path | None,
) -> tuple[Path, Path, Path, Path]:
    """Absolute paths for the shim (it runs in /), their directories, no stale exit file."""
    # runc keeps each container's state in <root>/<id>; a taken id must not lose its exit file.
    if (runc_root / container_id).exists():
        raise _already_exists(container_id)
    bundle, log_path, exit_path = bundle.absolute(), log_path.absolute(), exit_path.absolute()
    pid_path = (shim_pid_path or exit_path.parent / "shim.pid").absolute()
    for stale in (exit_path, exit_path.with_name(exit_path.name + ".tmp")):
        stale.unlink(missing_ok=True)
    for directory in {exit_path.parent, log_path.parent, pid_path.parent}:
        directory.mkdir(parents=True, exist_ok=True)
    return bundle, log_path, exit_path, pid_path


async def run_container(
    runc: Runc,
    *,
    container_id: str,
    bundle: Path,
    log_path: Path,
    exit_path: Path,
    log_max_bytes: int,
    shim: Path,
    shim_pid_path: Path | None = None,
) -> ShimHandle:
    """Creates and starts the container in `bundle` (one `runc run --detach`) under a new shim.

    Returns once the container's process runs, or raises with runc's message; after a failure
    nothing is left (no runc state, no cgroup). The shim writes the container's output to
    `log_path` in the CRI format (rotated at `log_max_bytes`, 0 for never, one previous file
    kept as `log_path.1`) and its exit status to `exit_path`. Its pid goes to `shim_pid_path`
    (default: `shim.pid` beside the exit file, so give each container its own directory); runc's
    own files (`init.pid`, `runc.log`) go into the bundle.
    """
    bundle, log_path, exit_path, pid_path = await trio.to_thread.run_sync(
        _prepare_start, runc.root, container_id, bundle, log_path, exit_path, shim_pid_path
    )
    argv = [
        str(shim),
        "run",
        "--id",
        container_id,
        "--bundle",
        str(bundle),
        "--runc",
        runc.binary,
        "--root",
        str(runc.root.absolute()),
        "--runc-log",
        str(bundle / "runc.log"),
        "--pid-file",
        str(bundle / "init.pid"),
        "--log",
        str(log_path),
        "--log-max-bytes",
        str(int(log_max_bytes)),
        "--exit",
        str(exit_path),
        "--shim-pid-file",
        str(pid_path),
    ]

    async def abandon(report: bytes) -> None:
        if _parse_ok(report):
            await runc.delete(container_id, force=True)
        cgroups = _cgroups_path_of(bundle)
        if cgroups:
            remove_cgroup(cgroups)

    process, report = await _start_shim(argv, stdio=subprocess.DEVNULL, abandon=abandon)
    # The first shim process only forks and exits; reap it.
    await process.wait()
    ok = _parse_ok(report)
    if ok is None or len(ok) != 2:
        message = _report_message(report)
        code = error_code(message, starting=True)
        if code is ErrorCode.ALREADY_EXISTS:
            # Someone else's container: its cgroup is not ours to remove.
            raise _already_exists(container_id)
        cgroups = _cgroups_path_of(bundle)
        if cgroups:
            remove_cgroup(cgroups)
        hint = (
            "; check the command and that it exists in the image"
            if (code is ErrorCode.INVALID_ARGUMENT)
            else ""
        )
        raise RuncError(code, f"container {container_id!r} could not start: {message}{hint}")
    return ShimHandle(
        container_id=container_id,
        pid=ok[0],
        shim_pid=ok[1],
        exit_path=exit_path,
        shim_pid_path=pid_path,
        log_path=log_path,
    )


def read_exit(exit_path: Path) -> ExitStatus | None:
    """The exit status the shim recorded, or None while the container has not exited."""
    try:
        data = json.loads(exit_path.read_text())
        return ExitStatus(
            exit_code=int(data["exitCode"]),
            signal=None if data.get("signal") is None else int(data["signal"]),
            finished_at=str(data["finishedAt"]),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RuncError(
            ErrorCode.INTERNAL, f"the exit file {exit_path} is unreadable ({exc}); remove it"
        ) from None


def _is_our_shim(pid: int, exit_path: Path) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    from agent.runtime.shim import BINARY_PREFIX

    return (
        len(argv) > 2
        and os.path.basename(argv[0]).startswith(BINARY_PREFIX.encode())
        and argv[1] == b"run"
        and os.fsencode(exit_path) in argv
    )


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def running_shim(exit_path: Path, shim_pid_path: Path | None = None) -> int | None:
    """The pid of the shim that will write `exit_path`, if it still runs (checked against its
    command line, so a reused pid is not mistaken for it)."""
    exit_path = exit_path.absolute()
    pid = _read_pid(shim_pid_path or exit_path.parent / "shim.pid")
    if pid is None or not _is_our_shim(pid, exit_path):
        return None
    return pid


def _shim_target(
    target: ShimHandle | int | Path, exit_path: Path | None, shim_pid_path: Path | None
) -> tuple[int | None, Path]:
    if isinstance(target, ShimHandle):
        return target.shim_pid, target.exit_path
    if isinstance(target, int):
        if exit_path is None:
            raise TypeError("wait_exit(shim_pid, exit_path): the exit file's path is needed")
        return target, exit_path.absolute()
    path = target.absolute()
    return _read_pid(shim_pid_path or path.parent / "shim.pid"), path


async def wait_exit(
    target: ShimHandle | int | Path,
    exit_path: Path | None = None,
    *,
    shim_pid_path: Path | None = None,
) -> ExitStatus:
    """Waits until the container exits and returns its status.

    `target` is the handle `run_container` gave; or, after an agent restart, the shim's pid
    with the exit file's path (`wait_exit(pid, exit_path)`), or the exit file's path alone (the
    pid is then read from `shim_pid_path`, by default `shim.pid` beside it). The pid is trusted
    only while its command line shows it is the shim of that exit file.
    Raises `ShimLost` if the shim ended without writing the exit file.
    """
    pid, path = _shim_target(target, exit_path, shim_pid_path)
    status = read_exit(path)
    if status is not None:
        return status
    if pid is not None:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            pidfd = None
        if pidfd is not None:
            try:
                # Checked after the pidfd is open: the pidfd then names this very process.
                if _is_our_shim(pid, path):
                    await trio.lowlevel.wait_readable(pidfd)
                    try:
                        # Reaps it only where we are its parent (an agent that is PID 1 of its
                        # pod); WNOHANG, so this never blocks.
                        os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)  # noqa: ASYNC222
                    except ChildProcessError:
                        pass
            finally:
                trio.lowlevel.notify_closing(pidfd)
                os.close(pidfd)
    status = read_exit(path)
    if status is None:
        raise ShimLost(
            f"the shim of the container whose exit file is {path} ended without recording "
            "the exit status; the container's state is unknown, check it with runc state"
        )
    return status
