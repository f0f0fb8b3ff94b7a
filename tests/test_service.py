"""The shared `Service` names the program that serves it in its errors.

Both programs serve their API with `wire.service.Service`: a handler that fails must tell a
controlplane user that the controlplane failed, not a worker; the shared client, likewise,
calls its peer a worker only when it is one. Both run over memory streams here; the last test
checks that each program builds its services with its own name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import trio
import trio.testing

from wire.client import ApiClient, WorkerUnavailable, open_api_client
from wire.connection import Http2Connection
from wire.errors import ApiError, ErrorCode
from wire.service import Request, Router, Service, bearer_auth
from workerapi.client import WorkerClient

TOKEN = "service-s3cr3t-token"
ROOT = Path(__file__).resolve().parent.parent


async def _fail(request: Request) -> None:
    raise RuntimeError("a bug in the handler")


@pytest.mark.parametrize(
    ("program", "other"), [("controlplane", "worker"), ("worker", "controlplane")]
)
async def test_a_failing_handler_answers_with_an_error_naming_its_own_program(
    nursery: trio.Nursery, program: str, other: str, caplog: pytest.LogCaptureFixture
) -> None:
    router = Router()
    router.add("GET", "/v1/broken", _fail)
    service = Service(router, program=program, authenticate=bearer_auth(TOKEN))
    server_side, client_side = trio.testing.memory_stream_pair()
    nursery.start_soon(Http2Connection(server_side, client_side=False, handler=service).run)
    async with open_api_client(client_side, ApiClient, token=TOKEN, authority="api") as client:
        with pytest.raises(ApiError) as failed:
            await client.call("GET", "/v1/broken")
    assert failed.value.code is ErrorCode.INTERNAL
    assert failed.value.message == f"the {program} failed to handle the request"
    assert other not in failed.value.message
    # The cause stays in the serving program's log, not in the answer.
    assert "a bug in the handler" not in failed.value.message
    assert any("a bug in the handler" in str(r.exc_info and r.exc_info[1]) for r in caplog.records)


@pytest.mark.parametrize(
    ("client_class", "named", "not_named"),
    [(ApiClient, "server w-1 unreachable", "worker"), (WorkerClient, "worker w-1 unreachable", "")],
)
async def test_a_client_names_what_it_could_not_reach(
    nursery: trio.Nursery, client_class: type[ApiClient], named: str, not_named: str
) -> None:
    """The shared client says "worker" only when it talks to one (`WorkerClient`): the agent
    reaches the controlplane with the plain one."""
    service = Service(Router(), program="worker", authenticate=bearer_auth(TOKEN))
    server_side, client_side = trio.testing.memory_stream_pair()
    server = Http2Connection(server_side, client_side=False, handler=service)
    nursery.start_soon(server.run)
    async with open_api_client(client_side, client_class, token=TOKEN, authority="w-1") as client:
        await server.aclose()
        with pytest.raises(WorkerUnavailable) as failed:
            await client.call("GET", "/v1/health")
    assert named in failed.value.message
    assert not not_named or not_named not in failed.value.message


def _programs_named(folder: str) -> list[tuple[str, object]]:
    """(where, the `program=` given) for every `Service(...)` built under `folder`."""
    found: list[tuple[str, object]] = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "Service"
            ):
                continue
            given = next((k.value for k in node.keywords if k.arg == "program"), None)
            name = given.value if isinstance(given, ast.Constant) else given
            found.append((f"{path.relative_to(ROOT)}:{node.lineno}", name))
    return found


@pytest.mark.parametrize(("folder", "program"), [("agent", "worker"), ("control", "controlplane")])
def test_each_program_builds_its_service_with_its_own_name(folder: str, program: str) -> None:
    found = _programs_named(folder)
    assert found, f"no Service built under {folder}/: the check looks in the wrong place"
    wrong = [(where, name) for where, name in found if name != program]
    assert not wrong, f"these Services in {folder}/ must pass program={program!r}: {wrong}"
