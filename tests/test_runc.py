"""runc, the shim and cgroups for real: containers on a busybox rootfs, no mocks.

Each test uses its own runc state directory and container ids of its own, and the `lab` fixture
deletes every container it started and removes its cgroups, also when the test fails.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from agent.host.cgroups import CgroupError, oom_killed, remove_cgroup
from agent.runtime.ocispec import Bind, Limits, RuntimeSpec, exec_process, write_bundle
from agent.runtime.runc import (
    Runc,
    RuncError,
    ShimHandle,
    ShimLost,
    error_code,
    read_exit,
    run_container,
    runc_message,
    running_shim,
    wait_exit,
)
from agent.runtime.shim import shim_path
from tests.cgroups import read_cgroup_limits
from wire.errors import ErrorCode

_needs_runc = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("runc") or not Path("/bin/busybox").exists(),
    reason="needs root, runc and busybox-static (/bin/busybox)",
)


def containers(test: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """Marks a test that runs real containers (root, runc, busybox)."""
    marked: Callable[..., Awaitable[None]] = pytest.mark.root(_needs_runc(test))
    return marked


REPO = Path(__file__).resolve().parent.parent
APPLETS = ("sh", "sleep", "echo", "cat", "head", "tail", "tr", "printf", "stty", "grep", "hostname")
# Docker's default capability set as /proc/<pid>/status shows it.
DOCKER_CAP_MASK = "00000000a80425fb"
CRI_LINE = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z) (stdout|stderr) ([FP]) (.*)")
TIMEOUT_S = 20


@pytest.fixture(scope="session")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shim_path(tmp_path_factory.mktemp("shim-cache"))


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    root = tmp_path / "rootfs"
    (root / "bin").mkdir(parents=True)
    (root / "tmp").mkdir()
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    return root


@attrs.define
class Started:
    handle: ShimHandle
    spec: RuntimeSpec

    @property
    def log(self) -> Path:
        return self.handle.log_path


def cgroup_dirs(container_id: str) -> list[str]:
    return glob.glob(f"/sys/fs/cgroup/*/levers9/{container_id}") + glob.glob(
        f"/sys/fs/cgroup/levers9/{container_id}"
    )


@attrs.define
class Lab:
    """Starts containers for one test and removes all of them afterwards."""

    runc: Runc
    shim: Path
    rootfs: Path
    base: Path
    ids: list[str] = attrs.Factory(list)

    def spec(self, name: str, *args: str, **changes: Any) -> RuntimeSpec:
        container_id = f"l9t-{os.getpid()}-{name}"
        self.ids.append(container_id)
        return RuntimeSpec(container_id=container_id, rootfs=str(self.rootfs), args=args, **changes)

    async def start(self, spec: RuntimeSpec, *, log_max_bytes: int = 1 << 20) -> Started:
        directory = self.base / spec.container_id
        write_bundle(directory / "bundle", spec)
        handle = await run_container(
            self.runc,
            container_id=spec.container_id,
            bundle=directory / "bundle",
            log_path=directory / "container.log",
            exit_path=directory / "exit.json",
            log_max_bytes=log_max_bytes,
            shim=self.shim,
        )
        return Started(handle, spec)

    async def run(self, name: str, *args: str, **changes: Any) -> Started:
        return await self.start(self.spec(name, *args, **changes))

    async def cleanup(self) -> None:
        problems = []
        with trio.CancelScope(shield=True):
            for container_id in self.ids:
                try:
                    await self.runc.delete(container_id, force=True)
                    remove_cgroup(f"/levers9/{container_id}")
                except RuncError as exc:
                    problems.append(f"{container_id}: {exc}")
        assert not problems, f"cleanup failed: {problems}"


@pytest.fixture
async def lab(tmp_path: Path, shim: Path, rootfs: Path) -> AsyncIterator[Lab]:
    runc = Runc(tmp_path / "runc", shim=shim)
    lab = Lab(runc, shim, rootfs, tmp_path / "containers")
    try:
        yield lab
    finally:
        await lab.cleanup()


def log_entries(path: Path) -> list[tuple[str, str, str]]:
    """(stream, tag, text) of each line; fails on a line not in the CRI format."""
    entries = []
    for line in path.read_text().splitlines():
        match = CRI_LINE.fullmatch(line)
        assert match, f"not a CRI log line: {line!r}"
        entries.append((match[2], match[3], match[4]))
    return entries


# -- runc's messages (pure) ----------------------------------------------------------------------


def test_the_message_is_the_last_error_of_runcs_json_log() -> None:
    output = "\n".join(
        [
            '{"level":"warning","msg":"cgroup v1 is deprecated","time":"t"}',
            '{"level":"error","msg":"first try failed","time":"t"}',
            '{"level":"error","msg":"exec: \\"x\\": executable file not found","time":"t"}',
            "exec: x: executable file not found",
        ]
    )
    assert runc_message(output) == 'exec: "x": executable file not found'
    assert runc_message("plain failure\n") == "plain failure"
    assert runc_message("") == "runc gave no message"


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("container does not exist", ErrorCode.NOT_FOUND),
        ('exec: "x": executable file not found in $PATH', ErrorCode.INVALID_ARGUMENT),
        ("container with given ID already exists", ErrorCode.ALREADY_EXISTS),
        ("container not running", ErrorCode.FAILED_PRECONDITION),
        ("exec failed: cannot exec in a stopped container", ErrorCode.FAILED_PRECONDITION),
        ("unable to apply cgroup configuration", ErrorCode.INTERNAL),
    ],
)
def test_runc_failures_get_the_code_that_says_what_to_do(message: str, code: ErrorCode) -> None:
    assert error_code(message) is code


# -- run, log, exit -------------------------------------------------------------------------------


@containers
async def test_output_is_logged_in_cri_format_and_the_exit_code_is_kept(lab: Lab) -> None:
    started = await lab.run("exit3", "sh", "-c", "echo hi; echo err >&2; exit 3")
    with trio.fail_after(TIMEOUT_S):
        status = await wait_exit(started.handle)
    assert (status.exit_code, status.signal) == (3, None)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z", status.finished_at)
    entries = log_entries(started.log)
    assert ("stdout", "F", "hi") in entries
    assert ("stderr", "F", "err") in entries
    assert read_exit(started.handle.exit_path) == status
    assert not oom_killed(started.spec.cgroups_path)


@containers
async def test_long_and_unterminated_lines_are_marked_partial(lab: Lab) -> None:
    script = "head -c 20000 /dev/zero | tr '\\0' a; echo; printf end"
    started = await lab.run("partial", "sh", "-c", script)
    with trio.fail_after(TIMEOUT_S):
        await wait_exit(started.handle)
    assert log_entries(started.log) == [
        ("stdout", "P", "a" * 16384),
        ("stdout", "F", "a" * (20000 - 16384)),
        ("stdout", "P", "end"),
    ]


@containers
@pytest.mark.parametrize(("uid", "effective"), [(0, DOCKER_CAP_MASK), (1000, "0000000000000000")])
async def test_the_process_runs_with_dockers_capabilities_and_no_new_privileges(
    lab: Lab, uid: int, effective: str
) -> None:
    script = "grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status; hostname"
    started = await lab.run(f"caps-{uid}", "sh", "-c", script, uid=uid, gid=uid)
    with trio.fail_after(TIMEOUT_S):
        await wait_exit(started.handle)
    lines = [" ".join(text.split()) for _, _, text in log_entries(started.log)]
    assert f"CapEff: {effective}" in lines
    assert f"CapBnd: {DOCKER_CAP_MASK}" in lines
    assert "NoNewPrivs: 1" in lines
    assert started.spec.container_id in lines  # its own UTS namespace, named after it


@containers
async def test_binds_are_read_only_when_asked_and_writable_otherwise(
    lab: Lab, tmp_path: Path
) -> None:
    data, results = tmp_path / "data", tmp_path / "results"
    data.mkdir()
    results.mkdir()
    (data / "input").write_text("from the host\n")
    binds = (Bind(str(data), "/in", read_only=True), Bind(str(results), "/out"))
    script = "cat /in/input; echo x > /in/new || echo refused; echo result > /out/file"
    started = await lab.run("binds", "sh", "-c", script, binds=binds)
    with trio.fail_after(TIMEOUT_S):
        status = await wait_exit(started.handle)
    assert status.exit_code == 0
    stdout = [text for stream, _, text in log_entries(started.log) if stream == "stdout"]
    assert stdout == ["from the host", "refused"]
    assert not (data / "new").exists()
    assert (results / "file").read_text() == "result\n"


@containers
async def test_sigkill_gives_exit_code_137(lab: Lab) -> None:
    started = await lab.run("kill", "sleep", "1000")
    state = await lab.runc.state(started.spec.container_id)
    assert state is not None and state.status == "running" and state.pid == started.handle.pid
    assert read_exit(started.handle.exit_path) is None
    await lab.runc.kill(started.spec.container_id, signal.SIGKILL)
    with trio.fail_after(TIMEOUT_S):
        status = await wait_exit(started.handle)
    assert (status.exit_code, status.signal) == (137, 9)
    assert not oom_killed(started.spec.cgroups_path)
    with pytest.raises(RuncError) as caught:
        await lab.runc.kill(started.spec.container_id, signal.SIGKILL)
    assert caught.value.code is ErrorCode.FAILED_PRECONDITION


@containers
async def test_out_of_memory_gives_137_and_is_reported(lab: Lab) -> None:
    # tail keeps the last "line" of endless zero bytes: it grows until the limit kills it.
    spec = lab.spec(
        "oom", "sh", "-c", "exec tail < /dev/zero", limits=Limits(memory_bytes=16 << 20)
    )
    started = await lab.start(spec)
    with trio.fail_after(TIMEOUT_S):
        status = await wait_exit(started.handle)
    assert status.exit_code == 137
    assert oom_killed(spec.cgroups_path)


@containers
async def test_limits_are_applied_to_the_cgroup(lab: Lab) -> None:
    limits = Limits(cpu_millis=250, memory_bytes=64 << 20, pids=32)
    started = await lab.run("limits", "sleep", "1000", limits=limits)
    assert read_cgroup_limits(started.spec.cgroups_path) == {
        "memory_bytes": 64 << 20,
        "memory_swap_bytes": 64 << 20,
        "cpu_quota_us": 25_000,
        "cpu_period_us": 100_000,
        "pids_max": 32,
    }


@containers
async def test_a_bad_command_fails_with_runcs_message_and_leaves_nothing(lab: Lab) -> None:
    spec = lab.spec("nosuch", "nosuch")
    with pytest.raises(RuncError) as caught:
        await lab.start(spec)
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert 'exec: "nosuch": executable file not found' in caught.value.message
    assert spec.container_id in caught.value.message
    assert await lab.runc.state(spec.container_id) is None
    assert cgroup_dirs(spec.container_id) == []
    directory = lab.base / spec.container_id
    assert not (directory / "exit.json").exists()
    assert running_shim(directory / "exit.json") is None


@containers
async def test_a_taken_id_is_refused_and_the_container_holding_it_is_kept(lab: Lab) -> None:
    first = await lab.run("taken", "sh", "-c", "echo first; exit 2")
    with trio.fail_after(TIMEOUT_S):
        status = await wait_exit(first.handle)
    with pytest.raises(RuncError) as caught:
        await lab.start(attrs.evolve(first.spec, args=("sleep", "1000")))
    assert caught.value.code is ErrorCode.ALREADY_EXISTS
    assert first.spec.container_id in caught.value.message
    state = await lab.runc.state(first.spec.container_id)
    assert state is not None and state.status == "stopped"
    assert read_exit(first.handle.exit_path) == status
    assert cgroup_dirs(first.spec.container_id)


@containers
async def test_the_log_is_rotated_to_cap_its_size(lab: Lab) -> None:
    limit = 4096
    script = 'i=0; while [ $i -lt 2000 ]; do echo "line-$i-xxxxxxxxxxxxxxxx"; i=$((i+1)); done'
    spec = lab.spec("rotate", "sh", "-c", script)
    started = await lab.start(spec, log_max_bytes=limit)
    with trio.fail_after(TIMEOUT_S):
        await wait_exit(started.handle)
    previous = started.log.with_name(started.log.name + ".1")
    assert started.log.stat().st_size <= limit
    assert previous.stat().st_size <= limit
    assert sorted(p.name for p in started.log.parent.glob("container.log*")) == [
        "container.log",
        "container.log.1",
    ]
    current = [text for _, _, text in log_entries(started.log)]
    older = [text for _, _, text in log_entries(previous)]
    assert current[-1] == "line-1999-xxxxxxxxxxxxxxxx"
    # The two files hold consecutive lines: nothing lost at the rotation.
    assert int(older[-1].split("-")[1]) + 1 == int(current[0].split("-")[1])


_AGENT_SCRIPT = """
import json, sys, time
from pathlib import Path
import trio
from agent.runtime.runc import Runc, run_container

args = json.loads(sys.argv[1])
async def main():
    handle = await run_container(
        Runc(Path(args["root"])), container_id=args["id"], bundle=Path(args["bundle"]),
        log_path=Path(args["log"]), exit_path=Path(args["exit"]), log_max_bytes=1 << 20,
        shim=Path(args["shim"]),
    )
    print(handle.pid, handle.shim_pid, flush=True)
    time.sleep(3600)
trio.run(main)
"""


@containers
async def test_the_container_and_its_log_outlive_the_agent(lab: Lab) -> None:
    gate = lab.rootfs / "tmp" / "gate"
    os.mkfifo(gate)
    spec = lab.spec("survive", "sh", "-c", "echo one; read x < /tmp/gate; echo two; exit 5")
    directory = lab.base / spec.container_id
    write_bundle(directory / "bundle", spec)
    exit_path = directory / "exit.json"
    args = {
        "root": str(lab.runc.root),
        "id": spec.container_id,
        "bundle": str(directory / "bundle"),
        "log": str(directory / "container.log"),
        "exit": str(exit_path),
        "shim": str(lab.shim),
    }
    agent = await trio.lowlevel.open_process(
        [sys.executable, "-c", _AGENT_SCRIPT, json.dumps(args)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert agent.stdout is not None
        with trio.fail_after(TIMEOUT_S):
            line = b""
            while not line.endswith(b"\n"):
                chunk = await agent.stdout.receive_some()
                assert chunk, "the agent process ended before starting the container"
                line += chunk
        container_pid, shim_pid = map(int, line.split())
    finally:
        agent.kill()  # SIGKILL: the agent gets no chance to clean anything up
        await agent.wait()
        if agent.stdout is not None:
            await agent.stdout.aclose()

    state = await lab.runc.state(spec.container_id)
    assert state is not None and state.status == "running" and state.pid == container_pid
    assert running_shim(exit_path) == shim_pid

    def open_gate() -> None:
        with open(gate, "w") as fifo:  # blocks until the container opens it for reading
            fifo.write("go\n")

    with trio.fail_after(TIMEOUT_S):
        await trio.to_thread.run_sync(open_gate, abandon_on_cancel=True)
        # As a restarted agent would: from the recorded pid and the exit file's path.
        status = await wait_exit(shim_pid, exit_path)
    assert status.exit_code == 5
    texts = [text for stream, _, text in log_entries(directory / "container.log")]
    assert texts == ["one", "two"]
    assert await wait_exit(exit_path) == status
    assert running_shim(exit_path) is None


async def test_a_pid_that_is_not_our_shim_is_not_waited_for(tmp_path: Path) -> None:
    exit_path = tmp_path / "exit.json"
    (tmp_path / "shim.pid").write_text(f"{os.getpid()}\n")
    assert running_shim(exit_path) is None
    with trio.fail_after(TIMEOUT_S), pytest.raises(ShimLost):
        await wait_exit(exit_path)


# -- state, kill, delete, cgroups -----------------------------------------------------------------


@containers
async def test_delete_removes_state_and_cgroup_and_may_be_repeated(lab: Lab) -> None:
    started = await lab.run("delete", "sleep", "1000")
    container_id = started.spec.container_id
    assert [s.id for s in await lab.runc.list()] == [container_id]
    assert cgroup_dirs(container_id)
    with pytest.raises(CgroupError) as busy:
        remove_cgroup(started.spec.cgroups_path)
    assert busy.value.code is ErrorCode.FAILED_PRECONDITION

    await lab.runc.delete(container_id, force=True)
    remove_cgroup(started.spec.cgroups_path)
    assert await lab.runc.state(container_id) is None
    assert await lab.runc.list() == []
    assert cgroup_dirs(container_id) == []
    await lab.runc.delete(container_id, force=True)
    remove_cgroup(started.spec.cgroups_path)
    with trio.fail_after(TIMEOUT_S):
        status = await wait_exit(started.handle)
    assert status.exit_code == 137


@containers
async def test_unknown_container_is_not_found_naming_it(lab: Lab) -> None:
    with pytest.raises(RuncError) as caught:
        await lab.runc.kill("l9t-nobody", signal.SIGTERM)
    assert caught.value.code is ErrorCode.NOT_FOUND
    assert "l9t-nobody" in caught.value.message
    assert await lab.runc.state("l9t-nobody") is None


# -- exec -----------------------------------------------------------------------------------------


@containers
async def test_exec_without_tty_pipes_stdio_and_returns_the_exit_code(lab: Lab) -> None:
    started = await lab.run("exec", "sleep", "1000")
    process = exec_process(started.spec, ["sh", "-c", "cat; echo oops >&2; exit 7"])
    running = await lab.runc.exec(started.spec.container_id, process, tty=False)
    assert running.stdin and running.stdout and running.stderr
    out, err = bytearray(), bytearray()

    async def drain(stream: trio.abc.ReceiveStream, into: bytearray) -> None:
        while chunk := await stream.receive_some():
            into += chunk

    with trio.fail_after(TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, running.stdout, out)
            nursery.start_soon(drain, running.stderr, err)
            await running.stdin.send_all(b"hello\n")
            await running.stdin.aclose()
        code = await running.wait()
    assert (bytes(out), bytes(err), code) == (b"hello\n", b"oops\n", 7)
    await running.aclose()


@containers
async def test_exec_with_tty_gives_a_resizable_terminal_and_the_exit_code(lab: Lab) -> None:
    started = await lab.run("tty", "sleep", "1000")
    process = exec_process(started.spec, ["sh", "-c", "read x; stty size; exit 4"], terminal=True)
    running = await lab.runc.exec(started.spec.container_id, process, tty=True)
    assert running.terminal is not None and running.stdout is None
    try:
        running.resize(40, 100)
        output = bytearray()
        with trio.fail_after(TIMEOUT_S):
            await running.terminal.send_all(b"go\n")
            while chunk := await running.terminal.receive_some():
                output += chunk
            code = await running.wait()
    finally:
        await running.aclose()
    assert b"40 100" in output
    assert code == 4


@containers
async def test_exec_of_a_missing_command_fails_with_runcs_message(lab: Lab) -> None:
    started = await lab.run("exec-bad", "sleep", "1000")
    with pytest.raises(RuncError) as caught:
        await lab.runc.exec(
            started.spec.container_id, exec_process(started.spec, ["nosuch"]), tty=False
        )
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert 'exec: "nosuch": executable file not found' in caught.value.message


@containers
async def test_exec_in_an_unknown_container_is_not_found(lab: Lab) -> None:
    spec = lab.spec("never-started", "sleep", "1")
    with pytest.raises(RuncError) as caught:
        await lab.runc.exec(spec.container_id, exec_process(spec, ["true"]), tty=False)
    assert caught.value.code is ErrorCode.NOT_FOUND
    assert spec.container_id in caught.value.message
