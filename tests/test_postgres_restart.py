"""PostgreSQL outages on command (`sim.postgres.PostgresServer.restart`, `stop`, `start`), as a
fault campaign brings them on: every connection open before is dropped, the server comes back
on the same port with the same options, and what was committed is still there."""

from __future__ import annotations

import psycopg
import pytest

from control.config import DatabaseSettings
from sim.postgres import PostgresServer

pytest_plugins = ["tests.postgres_fixtures"]

Connection = psycopg.Connection[tuple[object, ...]]


def connect(settings: DatabaseSettings) -> Connection:
    assert settings.url is not None
    return psycopg.connect(
        settings.url, password=settings.password, autocommit=True, connect_timeout=5
    )


def write_row(settings: DatabaseSettings) -> Connection:
    """A connection that wrote (and committed) one row, left open."""
    conn = connect(settings)
    conn.execute("CREATE TABLE kept (id int PRIMARY KEY, note text)")
    conn.execute("INSERT INTO kept VALUES (1, 'before the outage')")
    return conn


def check_back(server: PostgresServer, settings: DatabaseSettings) -> None:
    """A new connection works, sees the row, and the server runs with its first options."""
    with connect(settings) as conn:
        assert conn.execute("SELECT id, note FROM kept").fetchall() == [(1, "before the outage")]
        shown = {
            name: conn.execute(f"SHOW {name}").fetchone()
            for name in ("port", "listen_addresses", "unix_socket_directories", "fsync")
        }
    assert shown == {
        "port": (str(server.port),),
        "listen_addresses": ("127.0.0.1",),
        "unix_socket_directories": (str(server.data_dir.parent),),
        "fsync": ("off",),
    }


def test_a_restart_drops_open_connections_and_keeps_the_data(
    postgres_server: PostgresServer, postgres_database: DatabaseSettings
) -> None:
    before = write_row(postgres_database)
    with before:
        pid = before.info.backend_pid
        postgres_server.restart()
        with pytest.raises(psycopg.OperationalError):
            before.execute("SELECT 1")
    check_back(postgres_server, postgres_database)
    with connect(postgres_database) as after:
        assert after.info.backend_pid != pid


def test_stop_keeps_every_client_out_until_start(
    postgres_server: PostgresServer, postgres_database: DatabaseSettings
) -> None:
    before = write_row(postgres_database)
    with pytest.raises(ValueError, match="immediate"):
        postgres_server.stop(mode="abrupt")
    with before:
        before.execute("SELECT 1")  # a wrong mode stopped nothing
        postgres_server.stop(mode="fast")
        try:
            with pytest.raises(psycopg.OperationalError):
                before.execute("SELECT 1")
            with pytest.raises(psycopg.OperationalError):
                connect(postgres_database)
        finally:
            postgres_server.start()
    check_back(postgres_server, postgres_database)
