"""`levers9` on the user's side: option parsing and formatting (pure), and the commands
against a stand-in controlplane.

The stand-in is the real `wire.service.Service` with scripted task routes
(`FakeControlplane`); it serves HTTP/2 over TLS on loopback with a CA made here, so
`main(argv)` runs exactly as a user's `levers9` does (in a thread, as its own `trio.run`).
The real controlplane's task API is covered by its own tests; here only the CLI's behaviour
is under test.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from control.api.pools import machine_list
from control.cli.client import ControlClient, ControlClientError, open_control_client
from control.cli.exec import FdReader, exec_session
from control.cli.main import main, parse_args
from control.cli.output import (
    TASK_HEADERS,
    Console,
    Progress,
    deadline_message,
    format_details,
    render_table,
    task_details,
    task_outcome,
    task_row,
)
from control.cli.parse import (
    parse_cpu,
    parse_env,
    parse_local,
    parse_memory,
    parse_states,
    parse_volume,
    request_from_args,
)
from control.cli.port import forward_port
from control.cli.tasks import follow_run
from control.cli.usage import UsageError
from control.kube.loop import PoolStatus
from control.kube.planner import Cards, Machine, NotAMachine, WorkerView
from control.models import (
    MachineList,
    TaskList,
    TaskRequest,
    TaskSnapshot,
    TaskState,
    TaskView,
    TaskVolume,
    WorkerState,
)
from sim.configs import make_pki
from wire.client import open_api_client
from wire.connection import Http2Connection
from wire.errors import ApiError, ErrorCode, dumps, loads, unstructure
from wire.h2websocket import H2WebSocket, WebSocketClosed
from wire.service import JsonResponse, Request, Router, Service, StreamResponse, bearer_auth
from wire.tls import TLSStream
from workerapi.exec import parse_request, unframe
from workerapi.models import CardInfo, CardState, ExecExit, ExecRequest, LogLine, PullStatus

TOKEN = "cli-test-token-0123456789"
DIGEST = "sha256:" + "ab" * 32
NOW = 1_800_000_000.0


def view(state: str = "pending", **fields: Any) -> TaskView:
    fields.setdefault("id", "t-1")
    return TaskView(
        workspace="ws", state=TaskState(state), image="busybox", created_at=NOW, **fields
    )


# -- the stand-in controlplane ---------------------------------------------------------------------


@attrs.define
class FakeControlplane:
    """Task routes that play a script: each GET of the task returns the next view (the last
    one again once the script is done); `logs?follow=true` waits until a view served says the
    task started, like the real route, then sends `lines`."""

    script: list[TaskView] = attrs.field(factory=lambda: [view("running")])
    final: TaskView = view("succeeded", exit_code=0)
    lines: list[LogLine] = attrs.field(factory=list)
    exec_exit: int = 0
    requests: list[TaskRequest] = attrs.field(factory=list)
    cancelled: list[str] = attrs.field(factory=list)
    exec_requests: list[ExecRequest] = attrs.field(factory=list)
    started: trio.Event = attrs.field(factory=trio.Event)
    machines: MachineList = MachineList(())
    url: str = ""
    ca: str = ""

    def _serve(self, current: TaskView) -> TaskView:
        if current.state not in ("pending", "starting"):
            self.started.set()
        return current

    def next_view(self) -> TaskView:
        current = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        return self._serve(current)

    def router(self) -> Router:
        router = Router()

        async def create(request: Request) -> JsonResponse:
            self.requests.append(await request.json(TaskRequest))
            return JsonResponse(self._serve(self.script[0]), status=201)

        async def listing(request: Request) -> TaskList:
            states = request.query.get("state", "").split(",")
            shown = [v for v in (view("running", id="t-2"), self.final) if v.state in states]
            return TaskList(tuple(shown if request.query.get("state") else [self.final]))

        async def get(request: Request) -> TaskView:
            if request.params["id"] != "t-1":
                raise ApiError(ErrorCode.NOT_FOUND, f"no task {request.params['id']!r}")
            return self.next_view()

        async def wait(request: Request) -> TaskView:
            return self.final

        async def cancel(request: Request) -> TaskView:
            self.cancelled.append(request.params["id"])
            return view("cancelled", reason="cancelled by the user")

        async def snapshot(request: Request) -> JsonResponse:
            return JsonResponse(TaskSnapshot(DIGEST, 1234, "t-1", "w-1"), status=201)

        async def logs(request: Request) -> StreamResponse:
            follow = request.query.get("follow") == "true"

            async def chunks() -> AsyncGenerator[bytes, None]:
                if follow:
                    await self.started.wait()
                for line in self.lines:
                    yield dumps(line) + b"\n"

            return StreamResponse(chunks, content_type="application/x-ndjson")

        async def exec_(request: Request, ws: H2WebSocket) -> None:
            exec_request = parse_request(await ws.receive_message())
            self.exec_requests.append(exec_request)
            received = b""
            try:
                while True:
                    message = await ws.receive_message()
                    assert isinstance(message, bytes)
                    _, data = unframe(message)
                    if not data:
                        break
                    received += data
                    if exec_request.tty and received.endswith(b"\x04"):
                        break  # a terminal's end of input, as typed
            except WebSocketClosed:
                return
            await ws.send_message(b"\x01" + b"got: " + received)
            await ws.send_message(b"\x02" + b"to stderr\n")
            await ws.send_message(dumps(ExecExit(exit_code=self.exec_exit)).decode())

        async def machines(request: Request) -> MachineList:
            return self.machines

        router.add("GET", "/v1/machines", machines)
        router.add("POST", "/v1/tasks", create)
        router.add("GET", "/v1/tasks", listing)
        router.add("GET", "/v1/tasks/{id}", get)
        router.add("GET", "/v1/tasks/{id}/wait", wait)
        router.add("POST", "/v1/tasks/{id}/cancel", cancel)
        router.add("POST", "/v1/tasks/{id}/snapshot", snapshot)
        router.add("GET", "/v1/tasks/{id}/logs", logs)
        router.add_websocket("/v1/tasks/{id}/exec", exec_)
        return router

    def service(self) -> Service:
        def resolve(name: str, port: int) -> str:
            if name != "t-1":
                raise ApiError(ErrorCode.NOT_FOUND, f"no task {name!r}")
            return "127.0.0.1"

        return Service(
            self.router(),
            # It answers a CONNECT to a task's port itself, as the worker would (the real
            # controlplane relays the worker's answer), so its refusals name the worker.
            program="worker",
            authenticate=bearer_auth(TOKEN),
            resolve_name=resolve,
            name="control",
        )


@pytest.fixture
async def fake(nursery: trio.Nursery, tmp_path: Path) -> FakeControlplane:
    """The stand-in, served over TLS (HTTP/2 by ALPN) on 127.0.0.1."""
    fake = FakeControlplane()
    pki = make_pki(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki.cert_file, pki.key_file)
    context.set_alpn_protocols(["h2"])
    service = fake.service()

    async def handle(tcp: trio.SocketStream) -> None:
        tls = TLSStream(tcp, context, server_side=True)
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError:
            await trio.aclose_forcefully(tls)
            return
        await Http2Connection(tls, client_side=False, handler=service).run()

    serve = functools.partial(trio.serve_tcp, host="127.0.0.1")
    listeners = await nursery.start(serve, handle, 0)
    fake.url = f"https://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    fake.ca = str(pki.ca_file)
    return fake


async def levers9(fake: FakeControlplane, *argv: str) -> int:
    """`levers9 ARGV` against the stand-in, as a user runs it."""
    options = ["--controlplane", fake.url, "--token", TOKEN, "--ca", fake.ca]
    return await trio.to_thread.run_sync(main, [*options, *argv])


@asynccontextmanager
async def memory_client(fake: FakeControlplane) -> AsyncIterator[ControlClient]:
    """A client of the stand-in over an in-memory stream (for the autojump clock)."""
    server_side, client_side = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            Http2Connection(server_side, client_side=False, handler=fake.service()).run
        )
        async with open_api_client(
            client_side, ControlClient, token=TOKEN, authority="cp.test"
        ) as client:
            yield client
        nursery.cancel_scope.cancel()


def text_console(*, err_tty: bool = False) -> tuple[Console, io.BytesIO, io.BytesIO]:
    out, err = io.BytesIO(), io.BytesIO()
    console = Console(
        io.TextIOWrapper(out, write_through=True),
        io.TextIOWrapper(err, write_through=True),
        err_tty,
    )
    return console, out, err


# -- parsing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512Mi", 512 * 2**20),
        ("2Gi", 2 * 2**30),
        ("1.5Gi", 3 * 2**29),
        ("2G", 2 * 10**9),
        ("100k", 100_000),
        ("64KiB", 64 * 1024),
        ("4096", 4096),
    ],
)
def test_memory_sizes(text: str, size: int) -> None:
    assert parse_memory(text) == size


@pytest.mark.parametrize("text", ["", "lots", "2X", "-1Gi", "0", "1.5.2G", "0.1"])
def test_bad_memory_names_the_option(text: str) -> None:
    with pytest.raises(UsageError, match=r"^--memory "):
        parse_memory(text)


@pytest.mark.parametrize(
    ("text", "millis"), [("0.5", 500), ("2", 2000), ("500m", 500), ("1.25", 1250)]
)
def test_cpu_amounts(text: str, millis: int) -> None:
    assert parse_cpu(text) == millis


@pytest.mark.parametrize("text", ["", "half", "0", "0m", "0.0001", "1.5m", "-1"])
def test_bad_cpu_names_the_option(text: str) -> None:
    with pytest.raises(UsageError, match=r"^--cpu "):
        parse_cpu(text)


def test_env_takes_bare_names_from_the_callers_environment() -> None:
    env = parse_env(["A=1", "B=x=y", "HOME", "EMPTY="], {"HOME": "/home/me"})
    assert env == {"A": "1", "B": "x=y", "HOME": "/home/me", "EMPTY": ""}


def test_env_unset_or_nameless_is_refused() -> None:
    with pytest.raises(UsageError, match=r"--env NOPE: NOPE is not set in your environment"):
        parse_env(["NOPE"], {})
    with pytest.raises(UsageError, match=r"^--env '=1' has no variable name"):
        parse_env(["=1"], {})


def test_volumes() -> None:
    assert parse_volume("data:/data") == TaskVolume("data", "/data")
    assert parse_volume("data:/mnt/in:ro") == TaskVolume("data", "/mnt/in", read_only=True)
    assert parse_volume("data:/out:rw") == TaskVolume("data", "/out")
    for bad in ("data", "data:relative", ":/data", "data:"):
        with pytest.raises(UsageError, match=r"^--volume "):
            parse_volume(bad)


def test_local_addresses() -> None:
    assert parse_local(None, 8080) == ("127.0.0.1", 8080)
    assert parse_local("9000", 8080) == ("127.0.0.1", 9000)
    assert parse_local("0", 8080) == ("127.0.0.1", 0)
    assert parse_local("0.0.0.0:9000", 8080) == ("0.0.0.0", 9000)
    assert parse_local("[::1]:9000", 8080) == ("::1", 9000)
    with pytest.raises(UsageError, match=r"^--local "):
        parse_local("localhost:http", 8080)
    with pytest.raises(UsageError, match=r"^--local "):
        parse_local("70000", 8080)


def run_args(*argv: str) -> argparse.Namespace:
    return parse_args(["run", *argv])


def test_run_command_line_becomes_the_request() -> None:
    args = run_args(
        "--gpus", "2", "--cpu", "500m", "--memory", "2Gi", "--env", "A=1", "--env", "HOME",
        "--volume", "data:/data:ro", "--port", "8080", "--port", "9090", "--timeout", "600",
        "--snapshot", DIGEST, "busybox:latest", "--", "sh", "-c", "echo hi",
    )  # fmt: skip
    request = request_from_args(args, {"HOME": "/home/me"})
    assert request == TaskRequest(
        image="busybox:latest",
        command=("sh", "-c", "echo hi"),
        env={"A": "1", "HOME": "/home/me"},
        cards=2,
        cpu_millis=500,
        memory_bytes=2 * 2**30,
        volumes=(TaskVolume("data", "/data", read_only=True),),
        ports=(8080, 9090),
        timeout_s=600.0,
        snapshot=DIGEST,
    )


def test_run_without_a_command_keeps_the_images() -> None:
    request = request_from_args(run_args("busybox"), {})
    assert request == TaskRequest(image="busybox")
    assert request_from_args(run_args("busybox", "--"), {}).command is None


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--gpus", "two"], "--gpus"),
        (["--gpus", "-1"], "--gpus"),
        (["--port", "0"], "--port"),
        (["--port", "80", "--port", "80"], "--port"),
        (["--timeout", "soon"], "--timeout"),
        (["--timeout", "0"], "--timeout"),
        (["--snapshot", "abc"], "--snapshot"),
    ],
)
def test_bad_run_values_name_the_option(argv: list[str], option: str) -> None:
    with pytest.raises(UsageError, match=f"^{option} "):
        request_from_args(run_args(*argv, "busybox"), {})


def test_state_filters_take_the_task_states_words() -> None:
    assert parse_states("running, pending,") == (TaskState.RUNNING, TaskState.PENDING)
    words = "pending,starting,running,succeeded,failed,cancelled,lost"
    assert [s.value for s in parse_states(words)] == words.split(",")
    with pytest.raises(
        UsageError, match=f"--state 'Running' is not a task state; give some of {words}"
    ):
        parse_states("Running")


def test_bad_command_lines_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--memory", "lots", "busybox"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("levers9: --memory 'lots' is not a size") and err.count("\n") == 1
    assert main(["run", "--wait", "-1", "busybox"]) == 2
    assert capsys.readouterr().err.startswith("levers9: --wait '-1'")
    assert main(["run", "busybox", "echo", "hi"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: echo hi" in err and err.count("\n") == 1
    assert main(["task", "list", "--", "x"]) == 2
    assert "'--' and a command only follow" in capsys.readouterr().err
    assert main(["task", "list", "--state", "sleeping"]) == 2
    assert "--state 'sleeping' is not a task state" in capsys.readouterr().err


def test_missing_controlplane_or_token_says_what_to_set(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LEVERS9_CONFIG", str(tmp_path / "no-contexts"))
    monkeypatch.delenv("LEVERS9_CONTROLPLANE", raising=False)
    monkeypatch.delenv("LEVERS9_TOKEN", raising=False)
    assert main(["task", "list"]) == 1
    assert "--controlplane must be an https:// URL" in capsys.readouterr().err
    assert main(["--controlplane", "https://cp.example", "task", "list"]) == 1
    assert "pass --token or set LEVERS9_TOKEN" in capsys.readouterr().err


# -- formatting ------------------------------------------------------------------------------------


def test_task_rows_show_why_a_task_waits_or_ended() -> None:
    waiting = view("pending", waiting="waiting: 2 cards asked, at most 1 free on any worker")
    done = view("failed", id="t-2", worker="w-1", exit_code=137, reason="out of memory", cards=1)
    table = render_table(TASK_HEADERS, [task_row(v, NOW + 75) for v in (waiting, done)])
    header, first, second = table.splitlines()
    assert header.split() == ["ID", "STATE", "IMAGE", "CARDS", "WORKER", "AGE", "EXIT", "REASON"]
    assert first.split()[:7] == ["t-1", "pending", "busybox", "0", "-", "1m15s", "-"]
    assert first.endswith("waiting: 2 cards asked, at most 1 free on any worker")
    assert second.split()[:7] == ["t-2", "failed", "busybox", "1", "w-1", "1m15s", "137"]
    assert second.endswith("out of memory")


def test_task_details_for_people() -> None:
    running = view(
        "running",
        command=("python", "train.py"),
        cards=1,
        card_ids=("GPU-1",),
        cpu_millis=500,
        memory_bytes=2 * 2**30,
        ports=(8080,),
        worker="w-1",
        running_at=NOW + 5,
    )
    text = format_details(task_details(running, NOW + 65))
    lines = dict(line.split(":", 1) for line in text.splitlines())
    assert lines["state"].strip() == "running"
    assert lines["command"].strip() == "python train.py"
    assert lines["cpu"].strip() == "500m"
    assert lines["memory"].strip() == "2Gi"
    assert lines["running"].strip().endswith("(1m0s ago)")
    assert "exit code" not in lines and "reason" not in lines


def test_progress_on_a_pipe_prints_a_line_per_phase() -> None:
    progress = Progress(tty=False)
    pull = PullStatus("downloading", 12_300_000, 45_600_000)
    steps = [
        view("pending", waiting="waiting: no worker has joined yet"),
        view("pending", waiting="waiting: no worker has joined yet"),
        view("starting", worker="w-1", pull=PullStatus("resolving", 0, 0)),
        view("starting", worker="w-1", pull=pull),
        view("starting", worker="w-1", pull=attrs.evolve(pull, done_bytes=40_000_000)),
        view("starting", worker="w-1", pull=PullStatus("done", 45_600_000, 45_600_000)),
    ]
    shown = "".join(progress.update(v) for v in steps) + progress.finish()
    assert shown.splitlines() == [
        "waiting: no worker has joined yet",
        "pulling image: resolving",
        "pulling image: 12.3/45.6 MB",
        "starting the container on w-1",
    ]


def test_progress_on_a_terminal_rewrites_one_line() -> None:
    progress = Progress(tty=True)
    pull = PullStatus("downloading", 12_300_000, 45_600_000)
    assert progress.update(view("starting", pull=pull)) == "\rpulling image: 12.3/45.6 MB\x1b[K"
    assert progress.update(view("starting", pull=pull)) == ""
    moved = attrs.evolve(pull, done_bytes=20_000_000)
    assert progress.update(view("starting", pull=moved)) == "\rpulling image: 20.0/45.6 MB\x1b[K"
    assert progress.finish() == "\r\x1b[K"
    assert progress.finish() == ""


def test_deadline_message_says_the_task_goes_on() -> None:
    waiting = view("pending", waiting="waiting: no worker has joined yet")
    assert deadline_message(waiting, 60) == (
        "DEADLINE_EXCEEDED: task t-1 has not started within 60 s (pending: no worker has "
        "joined yet); it goes on: follow it with 'levers9 task logs -f t-1' or "
        "'levers9 task get t-1'"
    )
    pulling = view("starting", pull=PullStatus("downloading", 1_000_000, 2_000_000))
    assert "(starting: pulling image: 1.0/2.0 MB)" in deadline_message(pulling, 60)


def test_outcomes() -> None:
    assert task_outcome(view("succeeded", exit_code=0)) == (0, None)
    assert task_outcome(view("failed", exit_code=3)) == (3, None)
    assert task_outcome(view("failed", exit_code=137, reason="timed out")) == (
        137,
        "task t-1 failed: timed out",
    )
    assert task_outcome(view("failed", reason="image not found")) == (
        1,
        "task t-1 failed: image not found",
    )
    assert task_outcome(view("lost", reason="worker w-1 went away")) == (
        1,
        "task t-1 lost: worker w-1 went away",
    )
    assert task_outcome(view("cancelled")) == (1, "task t-1 cancelled: no reason given")


# -- the client ------------------------------------------------------------------------------------


async def test_client_reaches_a_controlplane_with_a_private_ca(fake: FakeControlplane) -> None:
    async with open_control_client(fake.url, TOKEN, fake.ca) as client:
        assert await client.task("t-1") == view("running")
        with pytest.raises(ApiError) as err:
            await client.task("t-9")
        assert err.value.code is ErrorCode.NOT_FOUND


async def test_client_connection_errors_say_what_to_do(
    fake: FakeControlplane, tmp_path: Path
) -> None:
    with pytest.raises(ControlClientError, match="pass that CA with --ca FILE"):
        async with open_control_client(fake.url, TOKEN, None):
            pass
    with pytest.raises(ControlClientError, match=r"cannot load the CA file .*LEVERS9_CA"):
        async with open_control_client(fake.url, TOKEN, str(tmp_path / "missing.pem")):
            pass
    with pytest.raises(ControlClientError, match="no API token"):
        async with open_control_client(fake.url, "", fake.ca):
            pass
    with pytest.raises(ControlClientError, match="must be an https:// URL"):
        async with open_control_client("http://127.0.0.1:1", TOKEN, fake.ca):
            pass
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    await listeners[0].aclose()
    with pytest.raises(ControlClientError, match="cannot reach the controlplane"):
        async with open_control_client(f"https://127.0.0.1:{port}", TOKEN, fake.ca):
            pass


async def test_wrong_token_is_reported(
    fake: FakeControlplane, capsys: pytest.CaptureFixture[str]
) -> None:
    options = ["--controlplane", fake.url, "--token", "wrong", "--ca", fake.ca]
    assert await trio.to_thread.run_sync(main, [*options, "task", "get", "t-1"]) == 1
    assert capsys.readouterr().err == "levers9: UNAUTHENTICATED: missing or wrong bearer token\n"


# -- levers9 run -----------------------------------------------------------------------------------


async def test_run_streams_logs_and_exits_with_the_tasks_code(
    fake: FakeControlplane, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.script = [view("running")]
    fake.final = view("succeeded", exit_code=3)
    fake.lines = [
        LogLine("t0", "stdout", "hello"),
        LogLine("t1", "stderr", "warning: careful"),
        LogLine("t2", "stdout", "no newline", partial=True),
        LogLine("t3", "stdout", " yet"),
    ]
    code = await levers9(fake, "run", "--gpus", "1", "busybox", "--", "echo", "hello")
    out, err = capsys.readouterr()
    assert code == 3
    assert out == "hello\nno newline yet\n"
    assert err == "warning: careful\n"
    assert fake.requests == [TaskRequest(image="busybox", command=("echo", "hello"), cards=1)]


async def test_run_reports_a_task_that_failed_to_start(
    fake: FakeControlplane, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.script = [view("failed", reason="image busybox:nope not found")]
    fake.final = fake.script[0]
    assert await levers9(fake, "run", "busybox:nope") == 1
    assert capsys.readouterr().err.endswith(
        "levers9: task t-1 failed: image busybox:nope not found\n"
    )


async def test_run_leaves_a_task_that_does_not_start_in_time(
    fake: FakeControlplane, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.script = [view("pending", waiting="waiting: no worker has joined yet")]
    assert await levers9(fake, "run", "--wait", "0", "busybox") == 124
    err = capsys.readouterr().err
    assert err.endswith(
        "DEADLINE_EXCEEDED: task t-1 has not started within 0 s (pending: no worker has joined "
        "yet); it goes on: follow it with 'levers9 task logs -f t-1' or 'levers9 task get t-1'\n"
    )
    assert fake.cancelled == []


async def test_run_detached_prints_the_task_id(
    fake: FakeControlplane, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.script = [view("pending")]
    assert await levers9(fake, "run", "--detach", "busybox") == 0
    assert capsys.readouterr().out == "t-1\n"


async def test_run_shows_progress_until_the_task_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = FakeControlplane()
    pull = PullStatus("downloading", 5_000_000, 10_000_000)
    fake.script = [
        view("pending", waiting="waiting: no worker is ready (1 draining, 0 not ready)"),
        view("pending", waiting="waiting: no worker is ready (1 draining, 0 not ready)"),
        view("starting", worker="w-1", pull=pull),
        view("starting", worker="w-1", pull=attrs.evolve(pull, done_bytes=9_000_000)),
        view("running", worker="w-1"),
    ]
    fake.final = view("succeeded", exit_code=0)
    fake.lines = [LogLine("t0", "stdout", "epoch 1")]
    console, out, err = text_console()
    async with memory_client(fake) as client:
        created = await client.create_task(TaskRequest(image="busybox"))
        code = await follow_run(client, created, 60.0, console)
    assert code == 0
    assert out.getvalue() == b"epoch 1\n"
    assert err.getvalue().decode().splitlines() == [
        "waiting: no worker is ready (1 draining, 0 not ready)",
        "pulling image: 5.0/10.0 MB",
    ]


async def test_run_gives_up_waiting_after_wait_seconds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = FakeControlplane()
    pull = PullStatus("downloading", 5_000_000, 10_000_000)
    fake.script = [view("pending"), view("starting", pull=pull)]
    console, _, err = text_console(err_tty=True)
    async with memory_client(fake) as client:
        created = await client.create_task(TaskRequest(image="busybox"))
        start = trio.current_time()
        code = await follow_run(client, created, 30.0, console)
        assert trio.current_time() - start == pytest.approx(30.0, abs=0.5)
    assert code == 124
    shown = err.getvalue().decode()
    assert shown.startswith(
        "\rwaiting for a worker\x1b[K\rpulling image: 5.0/10.0 MB\x1b[K\r\x1b[K"
    )
    assert "(starting: pulling image: 5.0/10.0 MB)" in shown


# -- levers9 task ----------------------------------------------------------------------------------


async def test_task_commands(fake: FakeControlplane, capsys: pytest.CaptureFixture[str]) -> None:
    fake.final = view("succeeded", exit_code=0, worker="w-1")
    assert await levers9(fake, "task", "list") == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:2] == ["ID", "STATE"] and row.split()[:2] == ["t-1", "succeeded"]
    assert await levers9(fake, "task", "list", "--state", "running", "--json") == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["id"] == "t-2" and listed["state"] == "running"
    assert await levers9(fake, "task", "get", "t-1", "--json") == 0
    assert json.loads(capsys.readouterr().out) == unstructure(view("running"))
    assert await levers9(fake, "task", "get", "t-1") == 0
    assert "state:     running" in capsys.readouterr().out
    assert await levers9(fake, "task", "cancel", "t-1") == 0
    assert capsys.readouterr().out == "task t-1: cancelled\n"
    assert fake.cancelled == ["t-1"]
    assert await levers9(fake, "task", "snapshot", "t-1") == 0
    assert capsys.readouterr().out == DIGEST + "\n"
    assert await levers9(fake, "task", "get", "t-9") == 1
    assert capsys.readouterr().err == "levers9: NOT_FOUND: no task 't-9'\n"


async def test_task_logs(fake: FakeControlplane, capsys: pytest.CaptureFixture[str]) -> None:
    fake.lines = [LogLine("t0", "stdout", "one"), LogLine("t1", "stderr", "two")]
    fake.started.set()
    assert await levers9(fake, "task", "logs", "-f", "t-1") == 0
    assert capsys.readouterr() == ("one\n", "two\n")


# -- levers9 machine list --------------------------------------------------------------------------

MACHINES = (
    Machine(
        pool="gpu",
        node="node-7",
        hostname="node-7.internal",
        gpu_model="nvidia-tesla-a100",
        cards=Cards(total=4, ours=0, others=1, free=3),
        cpu_free_millis=6000,
        memory_free_bytes=28 << 30,
        worker=WorkerView(WorkerState.READY, 93.7),
    ),
    Machine(
        pool="gpu",
        node="node-8",
        hostname="node-8.internal",
        gpu_model=None,
        cards=Cards(total=2, ours=2, others=0, free=0),
        cpu_free_millis=1500,
        memory_free_bytes=3 << 29,
        worker=None,
    ),
)
PASSES = (
    PoolStatus(
        pool="gpu", machines=MACHINES, skipped=(NotAMachine("node-9", "no cards"),), passed_at=NOW
    ),
    PoolStatus(pool="tpu", error="cannot list nodes: 403 Forbidden"),
)


def with_busy(machine: Machine, busy: int = 0) -> dict[str, Any]:
    """A machine's JSON as the pools' pass makes it, with our cards split into busy and idle,
    and why the cluster refuses its worker's pods (`refused`, null when it does not)."""
    shape = machine.to_json()
    shape["cards"] = {
        **shape["cards"],
        "busy": busy,
        "idle": machine.cards.ours - busy,
        "unhealthy": 0,
        "occupied": 0,
        "refused": 0,
    }
    shape["refused"] = None
    shape["cardProblems"] = []
    return shape


def route_as_it_was(statuses: Sequence[PoolStatus]) -> dict[str, Any]:
    """`GET /v1/machines` as the route built it by hand before it had models, with what was
    added since: each node's last failed write (`error`, null when none), our cards busy and
    idle."""
    return {
        "machines": [with_busy(m) for status in statuses for m in status.machines],
        "pools": [
            {
                "pool": status.pool,
                "passedAt": status.passed_at,
                "error": status.error,
                "skipped": [
                    {"node": n.node, "reason": n.reason, "error": None} for n in status.skipped
                ],
            }
            for status in statuses
        ],
    }


@pytest.mark.parametrize("worker", [None, "pending", "ready", "stopping"])
def test_the_machine_list_on_the_wire_is_the_json_it_always_was(worker: str | None) -> None:
    machine = attrs.evolve(
        MACHINES[0], worker=None if worker is None else WorkerView(WorkerState(worker), 12.5)
    )
    statuses = [attrs.evolve(PASSES[0], machines=(machine, MACHINES[1])), PASSES[1]]
    body = dumps(machine_list(statuses))
    assert body == dumps(route_as_it_was(statuses))
    assert dumps(loads(body, MachineList)) == body


async def test_machine_list(fake: FakeControlplane, capsys: pytest.CaptureFixture[str]) -> None:
    fake.machines = machine_list(PASSES, busy={"node-8": 1})
    assert await levers9(fake, "machine", "list", "--json") == 0
    out, err = capsys.readouterr()
    expected = [with_busy(MACHINES[0]), with_busy(MACHINES[1], busy=1)]
    assert out == json.dumps(expected, indent=2) + "\n"
    assert err == ""
    assert await levers9(fake, "machine", "list") == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "POOL  NODE    GPU                CARDS T/BUSY/IDLE/BAD/OTHERS/FREE  "
        "CPU FREE  MEM FREE  WORKER  AGE",
        "gpu   node-7  nvidia-tesla-a100  4/0/0/0/1/3                        "
        "6000m     28.0Gi    ready   93s",
        "gpu   node-8  -                  2/1/1/0/0/0                        "
        "1500m     1.5Gi     -       -",
    ]
    assert err == "pool tpu: last pass failed: cannot list nodes: 403 Forbidden\n"


SICK = CardInfo(
    uuid="GPU-2222",
    index=2,
    model="A100",
    memory_total_bytes=40 << 30,
    state=CardState.UNHEALTHY,
    reason="XID 79 at 12:03:01: the GPU has fallen off the bus",
)
SQUATTED = CardInfo(
    uuid="GPU-1111",
    index=1,
    model="A100",
    memory_total_bytes=40 << 30,
    state=CardState.OCCUPIED,
    reason="used by a process outside levers9: pid 4242, 1024 MiB",
)


async def test_machine_list_names_the_cards_that_take_no_task(
    fake: FakeControlplane, capsys: pytest.CaptureFixture[str]
) -> None:
    machine = attrs.evolve(MACHINES[0], cards=Cards(total=4, ours=4, others=0, free=0))
    status = attrs.evolve(PASSES[0], machines=(machine,))
    fake.machines = machine_list(
        [status], busy={"node-7": 1}, problems={"node-7": (SQUATTED, SICK)}
    )
    assert await levers9(fake, "machine", "list", "--json") == 0
    (shown,) = json.loads(capsys.readouterr().out)
    assert shown["cards"] == {
        "total": 4, "ours": 4, "others": 0, "free": 0, "busy": 1, "idle": 1,
        "unhealthy": 1, "occupied": 1, "refused": 0,
    }  # fmt: skip
    assert [(p["index"], p["state"]) for p in shown["cardProblems"]] == [
        (1, "occupied"),
        (2, "unhealthy"),
    ]
    assert await levers9(fake, "machine", "list") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[3] == "4/1/1/2/0/0"
    assert out[2:] == [
        "pool gpu: node node-7: card 1 (GPU-1111): used by a process outside levers9: "
        "pid 4242, 1024 MiB",
        "pool gpu: node node-7: card 2 (GPU-2222): unhealthy: XID 79 at 12:03:01: the GPU has "
        "fallen off the bus",
    ]


def test_a_machine_without_our_worker_shows_no_card_problems() -> None:
    status = attrs.evolve(PASSES[0], machines=(MACHINES[1],))
    (view,) = machine_list([status], problems={"node-8": (SICK,)}).machines
    assert view.card_problems == () and view.cards.unhealthy == 0


# -- levers9 exec ----------------------------------------------------------------------------------


async def test_exec_without_a_terminal_exits_with_the_remote_code(
    fake: FakeControlplane, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.exec_exit = 7
    assert await levers9(fake, "exec", "t-1", "--", "cat", "-") == 7
    assert capsys.readouterr() == ("got: ", "to stderr\n")
    (request,) = fake.exec_requests
    assert request.command == ("cat", "-") and request.tty is False


async def test_exec_carries_stdin_from_a_pipe(fake: FakeControlplane) -> None:
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, b"hello from stdin")
        os.close(write_fd)
        write_fd = -1
        console, out, err = text_console()
        async with open_control_client(fake.url, TOKEN, fake.ca) as client:
            code = await exec_session(
                client,
                "t-1",
                ExecRequest(command=("cat",)),
                console,
                stdin=FdReader(read_fd),
                watch_resizes=False,
            )
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
    assert code == 0
    assert out.getvalue() == b"got: hello from stdin"
    assert err.getvalue() == b"to stderr\n"


def test_exec_needs_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--controlplane", "https://cp.example", "--token", "x", "exec", "t-1"]) == 2
    assert "exec needs a command after '--'" in capsys.readouterr().err


# -- levers9 port ----------------------------------------------------------------------------------


async def test_port_forwards_each_connection(fake: FakeControlplane, nursery: trio.Nursery) -> None:
    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            while data := await stream.receive_some():
                await stream.send_all(b"echo:" + data)

    echo_listeners = await nursery.start(
        functools.partial(trio.serve_tcp, host="127.0.0.1"), echo, 0
    )
    task_port = echo_listeners[0].socket.getsockname()[1]
    console, _, err = text_console()
    async with open_control_client(fake.url, TOKEN, fake.ca) as client:
        async with trio.open_nursery() as inner:
            bound: Sequence[tuple[str, int]] = await inner.start(
                forward_port, client, "t-1", task_port, "127.0.0.1", 0, console
            )
            ((host, local_port),) = bound
            first = await trio.open_tcp_stream(host, local_port)
            second = await trio.open_tcp_stream(host, local_port)
            async with first, second:
                await first.send_all(b"one")
                await second.send_all(b"two")
                assert await second.receive_some() == b"echo:two"
                assert await first.receive_some() == b"echo:one"
            inner.cancel_scope.cancel()
    assert err.getvalue().decode() == f"forwarding 127.0.0.1:{local_port} -> t-1:{task_port}\n"


async def test_port_carries_bytes_sent_at_once_and_says_why_a_connection_is_refused(
    fake: FakeControlplane, nursery: trio.Nursery
) -> None:
    # The local client speaks first, before the controlplane has answered the CONNECT; a
    # port nobody listens on closes the local connection with the controlplane's reason.
    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            while data := await stream.receive_some():
                await stream.send_all(b"echo:" + data)

    open_port = (await nursery.start(functools.partial(trio.serve_tcp, host="127.0.0.1"), echo, 0))[
        0
    ].socket.getsockname()[1]
    closed = await trio.open_tcp_listeners(0, host="127.0.0.1")
    closed_port = closed[0].socket.getsockname()[1]
    await closed[0].aclose()
    console, _, err = text_console()
    async with open_control_client(fake.url, TOKEN, fake.ca) as client:
        async with trio.open_nursery() as inner:
            ((host, to_open),) = await inner.start(
                forward_port, client, "t-1", open_port, "127.0.0.1", 0, console
            )
            ((_, to_closed),) = await inner.start(
                forward_port, client, "t-1", closed_port, "127.0.0.1", 0, console
            )
            with trio.fail_after(10):
                async with await trio.open_tcp_stream(host, to_open) as stream:
                    await stream.send_all(b"at once")
                    assert await stream.receive_some() == b"echo:at once"
                async with await trio.open_tcp_stream(host, to_closed) as stream:
                    await stream.send_all(b"to nobody")
                    assert await stream.receive_some() == b""
            inner.cancel_scope.cancel()
    said = err.getvalue().decode()
    assert f"levers9: cannot forward a connection to t-1:{closed_port}: " in said
    assert f"cannot reach 127.0.0.1:{closed_port} on the worker" in said
    assert "Connection refused" in said


async def test_port_of_an_ended_task_is_refused(
    fake: FakeControlplane, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.script = [view("succeeded", exit_code=0)]
    assert await levers9(fake, "port", "t-1", "8080", "--local", "0") == 1
    assert capsys.readouterr().err == (
        "levers9: task t-1 has ended (succeeded); forward ports of a running task\n"
    )


async def test_port_not_declared_by_the_task_is_refused_before_listening(
    fake: FakeControlplane, capsys: pytest.CaptureFixture[str]
) -> None:
    fake.script = [view("running", ports=(8080,))]
    assert await levers9(fake, "port", "t-1", "9000", "--local", "0") == 1
    err = capsys.readouterr().err
    assert err == (
        "levers9: task t-1 declares no port 9000 (its ports: 8080); only declared ports are "
        "reachable: run the task with --port\n"
    )
    assert "forwarding" not in err
