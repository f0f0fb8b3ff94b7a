"""Pytest fixtures: a real PostgreSQL 15 server (Debian's), started once per session by the
harness with initdb in a temp dir, password authentication on, listening on loopback only
(`sim.postgres`).

Load them with `pytest_plugins = ["tests.postgres_fixtures"]`. `postgres_server` is the server
(run as the `postgres` user, as PostgreSQL refuses root); `postgres_database` is a fresh,
empty database on it per test, as `DatabaseSettings` the controlplane would be given (URL
without the password, the password beside it), dropped after the test.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest

from control.config import DatabaseSettings
from sim.postgres import PG_BIN, PostgresServer, running_postgres

__all__ = ["PostgresServer", "postgres_database", "postgres_server"]


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    if not (PG_BIN / "initdb").exists():
        pytest.fail("PostgreSQL 15 is not installed: run `make deps` (Debian's postgresql-15)")
    if os.geteuid() != 0:
        pytest.skip(reason="the harness starts PostgreSQL as the postgres user, which needs root")
    with running_postgres() as server:
        yield server


@pytest.fixture
def postgres_database(postgres_server: PostgresServer) -> Iterator[DatabaseSettings]:
    name = f"test_{secrets.token_hex(6)}"
    with postgres_server.admin() as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield postgres_server.settings(name)
    finally:
        with postgres_server.admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
