"""Pytest fixtures: real docker-registry processes on loopback with the test images pushed.

Load them with `pytest_plugins = ["tests.registry_fixtures"]`; import `sim.registry` for the
image builders and `push`. `registry` is one anonymous registry per session holding
busybox, layered, multi (an index) and dockerv2: tests that push their own images there use
repository names of their own. `basic_registry` and `token_registry` hold busybox behind
htpasswd and bearer-token auth, with the credentials that may pull it and some that may not.
`registry_factory` starts private registries a test may stop.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from agent.runtime.images.auth import RegistryCredentials
from sim.registry import (
    Image,
    Index,
    RunningRegistry,
    TokenAuth,
    TokenServer,
    busybox_image,
    dockerv2_image,
    htpasswd,
    layered_image,
    multi_index,
    running_registry,
    running_token_server,
    start_registry,
)

RegistryFactory = Callable[..., RunningRegistry]


@attrs.frozen
class SharedRegistry:
    """The session's anonymous registry and the references of its images."""

    server: RunningRegistry
    busybox: str
    layered: str
    multi: str
    dockerv2: str
    images: dict[str, Image | Index]
    """name (`busybox`, ...) -> what was pushed as `name:latest`."""

    @property
    def host(self) -> str:
        return self.server.host

    @property
    def url(self) -> str:
        return self.server.url


@attrs.frozen
class AuthRegistry:
    """A registry behind auth holding `busybox:latest`.

    `credentials` may pull; `wrong` has a wrong password; `denied` (token auth only) is a
    real user with no access to any repository."""

    server: RunningRegistry
    busybox: str
    credentials: RegistryCredentials
    wrong: RegistryCredentials
    denied: RegistryCredentials | None = None
    token_server: TokenServer | None = None


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedRegistry]:
    images: dict[str, Image | Index] = {
        "busybox": busybox_image(),
        "layered": layered_image(),
        "multi": multi_index(),
        "dockerv2": dockerv2_image(),
    }
    with running_registry(tmp_path_factory.mktemp("registry")) as server:
        for name, image in images.items():
            server.push(name, "latest", image)
        yield SharedRegistry(
            server=server,
            images=images,
            **{name: server.ref(f"{name}:latest") for name in images},
        )


@pytest.fixture(scope="module")
def basic_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthRegistry]:
    directory = tmp_path_factory.mktemp("basic-registry")
    password = secrets.token_urlsafe(16)
    users = htpasswd(directory / "htpasswd", {"alice": password})
    auth = {"htpasswd": {"realm": "levers9-test", "path": str(users)}}
    with running_registry(
        directory, auth=auth, push_auth=httpx.BasicAuth("alice", password)
    ) as server:
        server.push("busybox", "latest", busybox_image())
        yield AuthRegistry(
            server=server,
            busybox=server.ref("busybox:latest"),
            credentials=RegistryCredentials("alice", password),
            wrong=RegistryCredentials("alice", secrets.token_urlsafe(16)),
        )


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthRegistry]:
    directory = tmp_path_factory.mktemp("token-registry")
    password = secrets.token_urlsafe(16)
    bob_password = secrets.token_urlsafe(16)
    users = {
        "alice": (password, frozenset({"pull", "push"})),
        "bob": (bob_password, frozenset[str]()),
    }
    with running_token_server(directory / "tokens", users) as tokens:
        with running_registry(
            directory / "registry",
            auth=tokens.registry_auth(),
            push_auth=TokenAuth("alice", password),
        ) as server:
            server.push("busybox", "latest", busybox_image())
            yield AuthRegistry(
                server=server,
                busybox=server.ref("busybox:latest"),
                credentials=RegistryCredentials("alice", password),
                wrong=RegistryCredentials("alice", secrets.token_urlsafe(16)),
                denied=RegistryCredentials("bob", bob_password),
                token_server=tokens,
            )


@pytest.fixture
def registry_factory(tmp_path: Path) -> Iterator[RegistryFactory]:
    """Start private registries (`factory(**start_registry options)`); all are stopped at
    the end of the test, and a test may `stop()` one earlier."""
    started: list[RunningRegistry] = []

    def factory(**options: Any) -> RunningRegistry:
        server = start_registry(tmp_path / f"registry-{len(started)}", **options)
        started.append(server)
        return server

    try:
        yield factory
    finally:
        for server in started:
            server.stop()
