"""Pytest fixtures: a real S3 server (moto over TLS, credentials and IAM policies enforced).

Load them with `pytest_plugins = ["tests.s3_fixtures"]`. `s3_server` is one server per test
session with workspaces `a` and `b`: users `user-a` and `user-b`, each allowed only its own
bucket (`bucket-a`, `bucket-b`), and an admin allowed everything. Tests that take rights away
or fill a bucket make a workspace of their own with `s3_workspace()`; tests that stop the
server start one of their own with `s3_server_factory`. `s3_credentials(server, user)` turns a user
into the `S3Credentials` a volume spec carries; `S3Server.client(user=...)` is a boto3 client.
Test modules import those helpers from `sim.s3`, so this plugin module is imported by
pytest alone.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sim.s3 import S3Server, S3User, s3_credentials, start_s3_server

__all__ = ["S3Server", "S3User", "s3_credentials"]


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_s3_server(tmp_path_factory.mktemp("s3"), ("a", "b"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_workspace(s3_server: S3Server) -> Callable[[], S3User]:
    """Makes a fresh workspace (bucket and user) on the session's server."""

    def make() -> S3User:
        return s3_server.add_workspace(f"w{secrets.token_hex(4)}")

    return make


@pytest.fixture
def s3_server_factory(tmp_path: Path) -> Iterator[Callable[[], S3Server]]:
    """Starts private servers (workspace `a` only) that a test may stop; all are stopped after."""
    servers: list[S3Server] = []

    def make() -> S3Server:
        server = start_s3_server(tmp_path / f"s3-{len(servers)}", ("a",))
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()
