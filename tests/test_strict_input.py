"""Strict input at the edge: each JSON kind only for its own type, no non-finite numbers in or
out, a bound on nesting, a body over the limit answered (not a bare reset), POSIX env names,
bucket mount targets compared in their canonical spelling by both programs, and a CLI that
never prints a stored control character raw."""

from __future__ import annotations

import json
import sqlite3
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from agent.runtime.spec import validate_spec as validate_container
from agent.volumes.specs import validate_volume
from control.api.server import Controlplane
from control.cli.client import open_control_client
from control.cli.main import main
from control.cli.output import format_details, render_table, task_details, visible
from control.config import parse
from control.models import TaskRequest, TaskState, TaskView
from control.tasks.store import TaskSpec
from sim.configs import Pki, make_pki
from sim.controlplane import run_controlplane
from wire.errors import ApiError, decode_json, dumps, loads, too_deep
from wire.service import MAX_JSON_BODY_BYTES
from workerapi.models import ContainerSpec, S3Credentials, VolumeSpec
from workerapi.validation import (
    MIN_CPU_MILLIS,
    MIN_MEMORY_BYTES,
    canonical_mount_path,
    check_env_name,
)

TOKEN = "strict-input-token-0123456789"
S3_KEYS = {"accessKeyId": "AKIDEXAMPLE", "secretAccessKey": "bucket-secret-9999"}
ESC = "\x1b"

# -- the pure functions ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "canonical"),
    [
        ("/data", "/data"),
        ("/data/", "/data"),
        ("//data//set/", "/data/set"),
        ("/var/data", "/var/data"),
        ("/tmp/scratch", "/tmp/scratch"),
        ("/workspace/etc", "/workspace/etc"),
    ],
)
def test_a_mount_path_has_one_spelling(path: str, canonical: str) -> None:
    assert canonical_mount_path(path) == canonical


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("//etc", "system directory"),
        ("//dev", "system directory"),
        ("/etc/", "system directory"),
        ("///proc/self", "system directory"),
        ("/usr/local/lib", "system directory"),
        ("/var/run/secrets", "system directory"),
        ("/lib64", "system directory"),
        ("/", "system directory"),
        ("//", "system directory"),
        ("/tmp", "system directory"),
        ("/a/../etc", "'..'"),
        ("/data/./x", "'..'"),
        ("/data\x00/etc", "NUL"),
        ("/data\x1b[2J", "control"),
        ("data", "absolute"),
        ("", "absolute"),
    ],
)
def test_a_mount_path_over_the_system_or_oddly_spelt_is_refused(path: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        canonical_mount_path(path)


def s3_volume(mount_path: str) -> VolumeSpec:
    return VolumeSpec(
        workspace="ws",
        url="s3://bucket-a/data",
        mount_path=mount_path,
        s3=S3Credentials("AKIDEXAMPLE", "secret", endpoint="https://s3.example.test"),
    )


@pytest.mark.parametrize("path", ["//etc", "//dev", "//proc/1", "/data/../etc"])
def test_the_worker_refuses_a_system_directory_however_it_is_spelt(path: str) -> None:
    with pytest.raises(ApiError) as volume:
        validate_volume(s3_volume(path))
    assert volume.value.field == "mountPath"
    spec = ContainerSpec(image="busybox", volumes=(s3_volume(path),))
    with pytest.raises(ApiError) as container:
        validate_container(spec, node_memory_bytes=1 << 30)
    assert container.value.field == "volumes[0].mountPath"


def test_the_worker_counts_two_spellings_of_one_path_as_one() -> None:
    spec = ContainerSpec(image="busybox", volumes=(s3_volume("/data"), s3_volume("//data/")))
    with pytest.raises(ApiError, match="used by another volume") as refused:
        validate_container(spec, node_memory_bytes=1 << 30)
    assert refused.value.field == "volumes[1].mountPath"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"env": {f"A{ESC}]0;x": "1"}}, "env"),
        ({"env": {"A.B": "1"}}, "env"),
        ({"env": {"9A": "1"}}, "env"),
        ({"env": {"A": "x\x00y"}}, "env"),
        ({"command": ("sh", "-c\x00id")}, "command"),
        ({"args": ("\x00",)}, "args"),
        ({"workdir": "/w\x00"}, "workdir"),
    ],
)
def test_the_worker_refuses_what_a_process_cannot_be_given(
    changes: dict[str, Any], field: str
) -> None:
    spec = attrs.evolve(ContainerSpec(image="busybox"), **changes)
    with pytest.raises(ApiError) as refused:
        validate_container(spec, node_memory_bytes=1 << 30)
    assert refused.value.field == field


def test_env_names_have_the_posix_shape() -> None:
    for name in ("PATH", "_x", "a1_B"):
        check_env_name(name)
    for name in ("", "1A", "A-B", "A=B", f"A{ESC}", "Ä"):
        with pytest.raises(ValueError, match="POSIX"):
            check_env_name(name)


def refusal(body: Any, cls: type[Any] = TaskRequest) -> ApiError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ApiError) as refused:
        loads(raw, cls)
    return refused.value


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"image": "x", "command": "sh -c id"}, "command", "expected a list of strings, not a "),
        ({"image": 123}, "image", "expected a string, not an integer"),
        ({"image": "x", "cards": "1"}, "cards", "expected an integer, not a string"),
        ({"image": "x", "cards": True}, "cards", "expected an integer, not true"),
        ({"image": "x", "cards": 1.5}, "cards", "expected an integer, not a number"),
        ({"image": "x", "ports": {"80": 1}}, "ports", "expected a list of integers"),
        ({"image": "x", "env": {"A": 1}}, "env['A']", "expected a string"),
        ({"image": "x", "env": ["A=1"]}, "env", "expected an object of strings, not a list"),
        ({"image": "x", "timeoutS": "5"}, "timeoutS", "expected a number"),
        ({"image": "x", "timeoutS": False}, "timeoutS", "expected a number, not false"),
        (
            {"image": "x", "volumes": [{"bucket": "b", "mountPath": "/d", "readOnly": "yes"}]},
            "volumes[0].readOnly",
            "expected true or false",
        ),
        ({"image": "x", "volumes": ["b:/d"]}, "volumes[0]", "expected an object, not a string"),
    ],
)
def test_each_type_is_taken_only_from_its_own_json_kind(
    body: dict[str, Any], field: str, words: str
) -> None:
    refused = refusal(body)
    assert refused.field == field
    assert words in refused.message
    assert refused.message.startswith(f"field {field!r}: ")


def test_what_is_right_is_still_taken() -> None:
    asked = loads(b'{"image":"x","command":["sh","-c","id"],"timeoutS":5,"cards":2}', TaskRequest)
    assert asked.command == ("sh", "-c", "id") and asked.timeout_s == 5.0 and asked.cards == 2
    view = TaskView(id="t-1", workspace="w", state=TaskState.RUNNING, image="x", created_at=1)
    again = loads(dumps(view), TaskView)
    assert again == view and again.state is TaskState.RUNNING


@pytest.mark.parametrize(
    ("body", "field", "constant"),
    [
        (b'{"image":"x","timeoutS":Infinity}', "timeoutS", "Infinity"),
        (b'{"image":"x","timeoutS":-Infinity}', "timeoutS", "-Infinity"),
        (b'{"image":"x","timeoutS":NaN}', "timeoutS", "NaN"),
        (b'{"image":"x","timeoutS":1e999}', "timeoutS", "1e999"),
        (b'{"image":"x","volumes":[{"bucket":NaN}]}', "volumes[0].bucket", "NaN"),
    ],
)
def test_non_finite_numbers_are_refused_naming_the_field(
    body: bytes, field: str, constant: str
) -> None:
    refused = refusal(body)
    assert refused.field == field
    assert constant in refused.message


def test_a_non_finite_number_is_never_written() -> None:
    with pytest.raises(ValueError):
        dumps({"timeoutS": float("inf")})


def test_nesting_is_bounded_before_decoding() -> None:
    assert not too_deep(b"[" * 32 + b"]" * 32)
    assert too_deep(b"[" * 33 + b"]" * 33)
    assert too_deep(b'{"a":' * 40 + b"1" + b"}" * 40)
    assert too_deep(b"[" * 100_000)  # never closed: still too deep, not the decoder's stack
    assert not too_deep(b'["' + b"[" * 1000 + b'"]')  # brackets in a string do not nest
    assert not too_deep(b'["\\"' + b"{" * 1000 + b'"]')
    for body in (b"[" * 1000 + b"]" * 1000, b"[" * 100_000):
        with pytest.raises(ApiError, match="deeper than 32 levels"):
            decode_json(body)


def test_control_characters_are_shown_escaped() -> None:
    assert visible(f"a{ESC}]0;pwned\x07b\x9b") == "a\\x1b]0;pwned\\x07b\\x9b"
    assert visible("tab\there\nline") == "tab\\x09here\\x0aline"
    assert visible("two\nlines", lines=True) == "two\nlines"
    view = TaskView(
        id="t-1",
        workspace="w",
        state=TaskState.FAILED,
        image="busybox",
        created_at=0,
        command=(f"{ESC}[2J",),
        reason=f"{ESC}]0;title\x07",
    )
    assert ESC not in format_details(task_details(view, 0))
    assert ESC not in render_table(["reason"], [[view.reason or ""]])


# -- through a served controlplane -------------------------------------------------------------


@attrs.frozen
class Served:
    control: Controlplane
    pki: Pki
    database: Path

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.control.port}"

    def client(self) -> httpx.AsyncClient:
        context = ssl.create_default_context(cafile=str(self.pki.ca_file))
        return httpx.AsyncClient(
            http2=True,
            verify=context,
            base_url=self.url,
            headers={"authorization": f"Bearer {TOKEN}"},
        )


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    pki = make_pki(tmp_path)
    database = tmp_path / "tasks.db"
    config = parse(
        {
            "config": {
                "publicUrl": "https://127.0.0.1:0",
                "listen": "127.0.0.1:0",
                "tls": {"certFile": str(pki.cert_file), "keyFile": str(pki.key_file)},
                "database": {"path": str(database)},
                "workspaces": [
                    {
                        "name": "team",
                        "tokens": [{"name": "t", "token": TOKEN}],
                        "buckets": [{"name": "data", "url": "s3://bucket-a", "s3": S3_KEYS}],
                    }
                ],
            }
        }
    )
    async with trio.open_nursery() as nursery:
        control: Controlplane = await nursery.start(run_controlplane, config)
        yield Served(control, pki, database)
        nursery.cancel_scope.cancel()


async def post_task(served: Served, body: bytes) -> httpx.Response:
    async with served.client() as client:
        return await client.post(
            "/v1/tasks", content=body, headers={"content-type": "application/json"}
        )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"image":"busybox","timeoutS":Infinity}', "timeoutS"),
        (b'{"image":"busybox","timeoutS":NaN}', "timeoutS"),
        (b'{"image":"busybox","command":"sh -c id"}', "command"),
        (b'{"image":"busybox","cards":"1"}', "cards"),
        (b'{"image":"busybox","cards":true}', "cards"),
        (b'{"image":"busybox","cards":1.5}', "cards"),
        (b'{"image":"busybox","env":{"A\\u001b]0;x\\u0007":"1"}}', "env"),
        (
            b'{"image":"busybox","volumes":[{"bucket":"data","mountPath":"//etc"}]}',
            "volumes[0].mountPath",
        ),
        (
            b'{"image":"busybox","volumes":[{"bucket":"data","mountPath":"/data/../proc"}]}',
            "volumes[0].mountPath",
        ),
    ],
)
async def test_the_api_refuses_loose_input_naming_the_field(
    served: Served, body: bytes, field: str
) -> None:
    answer = await post_task(served, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert (error["code"], error["field"]) == ("INVALID_ARGUMENT", field)
    assert await served.control.dispatcher.store.list("team", None, 10, None) == ()


@pytest.mark.parametrize(
    ("body", "field", "minimum"),
    [
        (b'{"image":"busybox","memoryBytes":1}', "memoryBytes", MIN_MEMORY_BYTES),
        (b'{"image":"busybox","cpuMillis":1}', "cpuMillis", MIN_CPU_MILLIS),
    ],
)
async def test_a_limit_no_worker_can_start_is_refused_at_create(
    served: Served, body: bytes, field: str, minimum: int
) -> None:
    # Once accepted (201), placed, and failed on the worker: now refused before it is stored.
    answer = await post_task(served, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert (error["code"], error["field"]) == ("INVALID_ARGUMENT", field)
    assert f"at least {minimum} " in error["message"]
    assert await served.control.dispatcher.store.list("team", None, 10, None) == ()
    least = f'{{"image":"busybox","memoryBytes":{MIN_MEMORY_BYTES},"cpuMillis":{MIN_CPU_MILLIS}}}'
    assert (await post_task(served, least.encode())).status_code == 201


async def test_a_snapshot_that_is_no_digest_is_refused_naming_where_digests_come_from(
    served: Served,
) -> None:
    answer = await post_task(served, b'{"image":"busybox","snapshot":"sha256:abc"}')
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert (error["code"], error["field"]) == ("INVALID_ARGUMENT", "snapshot")
    assert "'sha256:abc' is not a digest" in error["message"]
    assert "levers9 task snapshot" in error["message"]
    assert await served.control.dispatcher.store.list("team", None, 10, None) == ()


async def test_deep_json_is_a_400_not_a_500(served: Served) -> None:
    answer = await post_task(served, b"[" * 1000 + b"]" * 1000)
    assert answer.status_code == 400
    assert "deeper than" in answer.json()["message"]


async def test_a_mount_path_is_stored_in_its_canonical_spelling(served: Served) -> None:
    body = b'{"image":"busybox","volumes":[{"bucket":"data","mountPath":"//data//set/"}]}'
    answer = await post_task(served, body)
    assert answer.status_code == 201, answer.text
    record = await served.control.dispatcher.store.get("team", answer.json()["id"])
    assert [v.mount_path for v in record.spec.volumes] == ["/data/set"]


async def test_a_body_over_the_limit_is_answered_with_the_limit(served: Served) -> None:
    body = b'{"image":"busybox","args":["' + b"x" * (MAX_JSON_BODY_BYTES + 1) + b'"]}'
    async with open_control_client(served.url, TOKEN, str(served.pki.ca_file)) as client:
        response = await client.open("POST", "/v1/tasks", body, content_type="application/json")
        answer = json.loads(await response.read())
    assert response.status == 400
    assert answer["code"] == "INVALID_ARGUMENT"
    assert str(MAX_JSON_BODY_BYTES) in answer["message"]


async def test_a_stored_non_finite_number_still_lists_as_valid_json(served: Served) -> None:
    store = served.control.dispatcher.store
    record = await store.create("team", TaskSpec(image="busybox", timeout_s=5.5))
    # As a record written before the API refused them: Infinity in the stored spec.
    with sqlite3.connect(served.database) as db:
        (spec,) = db.execute("SELECT spec FROM tasks WHERE id=?", (record.id,)).fetchone()
        assert '"timeoutS":5.5' in spec
        db.execute(
            "UPDATE tasks SET spec=? WHERE id=?",
            (spec.replace('"timeoutS":5.5', '"timeoutS":Infinity'), record.id),
        )
    async with served.client() as client:
        listing = await client.get("/v1/tasks")
        one = await client.get(f"/v1/tasks/{record.id}")
    for answer in (listing, one):
        assert answer.status_code == 200
        assert "Infinity" not in answer.text
        json.loads(answer.text, parse_constant=lambda c: pytest.fail(f"{c} was written"))
    assert listing.json()["tasks"][0]["timeoutS"] is None


async def test_task_get_and_list_never_print_a_stored_escape_raw(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    store = served.control.dispatcher.store
    record = await store.create(
        "team",
        TaskSpec(image="busybox", command=(f"{ESC}]0;pwned{ESC}\\", f"{ESC}[2J"), args=(ESC,)),
    )
    options = ["--controlplane", served.url, "--token", TOKEN, "--ca", str(served.pki.ca_file)]
    shown = {}
    for argv in (["task", "get", record.id], ["task", "list"]):
        code = await trio.to_thread.run_sync(main, [*options, *argv])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert record.id in out
        assert ESC not in out and ESC not in err
        shown[argv[1]] = out
    assert "\\x1b]0;pwned\\x1b\\ \\x1b[2J" in shown["get"]
