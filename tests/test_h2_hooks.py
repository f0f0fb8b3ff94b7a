"""The names of h2, hyperframe and hpack that `wire/http2.py` relies on beyond their documented
API, checked against the installed versions.

`wire.http2.H2_HOOKS` lists them; pyproject.toml pins the versions they were written against.
A new release that renames a private method, changes its parameters or drops an attribute
fails here, where bumping the pin would otherwise fail a connection. The last two tests keep
the list honest: an override or a private name used in `wire/http2.py` and missing from the
list fails too.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h2.connection
import h2.frame_buffer
import h2.stream
import hpack
import hyperframe.frame
import pytest

from wire import http2
from wire.http2 import H2_HOOKS, Hook

ROOT = Path(__file__).resolve().parent.parent

INSTANCES: dict[type, Callable[[], Any]] = {
    h2.connection.H2Connection: h2.connection.H2Connection,
    h2.frame_buffer.FrameBuffer: lambda: h2.frame_buffer.FrameBuffer(server=True),
    h2.connection.H2ConnectionStateMachine: h2.connection.H2ConnectionStateMachine,
    h2.stream.H2StreamStateMachine: lambda: h2.stream.H2StreamStateMachine(1),
    hpack.Encoder: hpack.Encoder,
    hyperframe.frame.DataFrame: lambda: hyperframe.frame.DataFrame(1),
}
"""How to make an instance of each owner, to see the attributes its `__init__` sets."""


def _hook_id(hook: Hook) -> str:
    return f"{hook.owner.__name__}.{hook.name}"


def check_hook(hook: Hook) -> str | None:
    """What is wrong with `hook` in the installed versions, or None."""
    where = f"{hook.owner.__module__}.{hook.owner.__qualname__}.{hook.name}"
    if hook.parameters is None:
        make = INSTANCES.get(hook.owner)
        if make is None:
            return f"add to INSTANCES how to make a {hook.owner.__qualname__}"
        if not hasattr(make(), hook.name):
            return f"{where} is gone (an instance attribute wire/http2.py uses)"
        return None
    method = inspect.getattr_static(hook.owner, hook.name, None)
    if method is None or not callable(method):
        return f"{where} is gone (a method wire/http2.py overrides or calls)"
    parameters = tuple(inspect.signature(method).parameters)
    if parameters != ("self", *hook.parameters):
        return (
            f"{where} takes {parameters[1:]}, not {hook.parameters}: re-check wire/http2.py's "
            "use of it before moving the pin"
        )
    return None


@pytest.mark.parametrize("hook", H2_HOOKS, ids=_hook_id)
def test_hooked_name_is_there_with_the_shape_we_rely_on(hook: Hook) -> None:
    assert check_hook(hook) is None, check_hook(hook)


@pytest.mark.parametrize(
    "hook",
    [
        Hook(h2.connection.H2Connection, "_prepare_for_sending", ("frames", "extra"), "x"),
        Hook(h2.connection.H2Connection, "_prepare_to_send", ("frames",), "x"),
        Hook(h2.frame_buffer.FrameBuffer, "_gone", None, "x"),
        Hook(h2.stream.H2Stream, "state_machine", None, "x"),
    ],
    ids=["reshaped", "renamed", "attribute-gone", "no-instance"],
)
def test_check_hook_reports_a_missing_or_reshaped_name(hook: Hook) -> None:
    assert check_hook(hook) is not None


def test_the_data_frame_repr_patch_is_applied() -> None:
    frame = hyperframe.frame.DataFrame(1, data=b"x" * 100_000)
    assert repr(frame).endswith("<100000 bytes>")


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [(http2._H2Connection, h2.connection.H2Connection), (http2._Encoder, hpack.Encoder)],
)
def test_every_override_is_listed(ours: type, theirs: type) -> None:
    hooked = {(hook.owner, hook.name) for hook in H2_HOOKS}
    overrides = {
        name
        for name, value in vars(ours).items()
        if callable(value) and not name.startswith("__") and hasattr(theirs, name)
    }
    assert overrides, "the override scan found nothing: it no longer looks where it should"
    missing = sorted(name for name in overrides if (theirs, name) not in hooked)
    assert not missing, f"add these overrides to wire.http2.H2_HOOKS: {missing}"


def _private_names_of_theirs() -> set[str]:
    names: set[str] = set()
    for owner, make in INSTANCES.items():
        for name in {*dir(owner), *vars(make())}:
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


def test_every_private_name_used_is_listed() -> None:
    """An attribute of ours that shares a name with a private one of theirs is listed too:
    cheaper than telling the two apart, and the list stays the place to look."""
    tree = ast.parse((ROOT / "wire" / "http2.py").read_text())
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    used |= {
        node.args[1].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "setattr"
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    }
    hooked = {hook.name for hook in H2_HOOKS}
    missing = sorted((used & _private_names_of_theirs()) - hooked)
    assert not missing, f"add these names of h2's to wire.http2.H2_HOOKS: {missing}"


def test_only_the_protocol_reaches_into_h2() -> None:
    """The code that runs an `Http2Protocol` goes through its methods, which the sans-IO tests
    cover, never through its `h2` attribute."""
    reach = re.compile(r"\bproto(col)?\.h2\b|\._proto\.h2\b")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("wire", "workerapi", "agent", "control", "sim")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != ROOT / "wire" / "http2.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if reach.search(line)
    ]
    assert not offenders, f"call an Http2Protocol method instead of .h2 at {offenders}"
