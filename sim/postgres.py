"""A real PostgreSQL 15 server (Debian's) on loopback, for the tests and the benchmarks: initdb
in a temp dir, password authentication (SCRAM) on, listening on 127.0.0.1 only, run as the
`postgres` user (PostgreSQL refuses root), stopped and removed on the way out. A fault test
restarts it (`PostgresServer.restart`, or `stop` and `start` for a longer outage): the same port
and options come back, and every client connection is dropped, as a database failover does.

Why here and not in the tests: `bench.ha` runs the controlplane replicas over it too, and the
simulated installation is where the other real servers' runners live (`sim.registry`).
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
import psycopg

from control.config import DatabaseSettings

__all__ = ["PG_BIN", "PostgresServer", "PostgresUnavailable", "running_postgres"]


class PostgresUnavailable(RuntimeError):
    """PostgreSQL cannot be started here (not installed, or not root)."""


PG_BIN = Path("/usr/lib/postgresql/15/bin")
PG_USER = "postgres"
START_TIMEOUT_S = 60


STOP_MODES = ("smart", "fast", "immediate")


@attrs.frozen
class PostgresServer:
    """A running server; `data_dir` lies in the server's own directory, beside its socket
    directory and its log (`<root>/data`, `<root>`, `<root>/log`)."""

    host: str
    port: int
    user: str
    password: str = attrs.field(repr=False)
    data_dir: Path

    def url(self, database: str) -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{database}"

    def settings(self, database: str, **kw: object) -> DatabaseSettings:
        return DatabaseSettings(url=self.url(database), password=self.password, **kw)  # type: ignore[arg-type]

    def admin(self, database: str = "postgres") -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.url(database), password=self.password, autocommit=True)

    # Outages, for fault tests. Every client connection is dropped by the stop; the server
    # comes back on the same port with the same options, and with every committed row.

    def restart(self, *, mode: str = "immediate") -> None:
        """Stops the server (`pg_ctl stop -m mode`: "immediate" as a crash, the next start
        recovers from the WAL) and starts it again; returns once it accepts connections."""
        self.stop(mode=mode)
        self.start()

    def stop(self, *, mode: str = "immediate") -> None:
        """Stops the server (`pg_ctl stop -m mode`) and waits until it is gone."""
        if mode not in STOP_MODES:
            raise ValueError(f"stop mode must be one of {', '.join(STOP_MODES)}, got {mode!r}")
        _stop(self.data_dir, mode)

    def start(self) -> None:
        """Starts the stopped server as `running_postgres` did; returns once it accepts
        connections."""
        _start(self.data_dir, self.port)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres(*args: str) -> None:
    subprocess.run(
        ["runuser", "-u", PG_USER, "--", *args],
        check=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=START_TIMEOUT_S,
    )


def _start(data: Path, port: int) -> None:
    """`pg_ctl start` (waiting until it accepts connections) with the one set of options the
    server ever runs with; its socket directory and log are beside `data`."""
    root = data.parent
    options = f"-k {root} -c listen_addresses=127.0.0.1 -p {port} -c fsync=off"
    _as_postgres(
        str(PG_BIN / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(root / "log"), "-w",
        "-t", str(START_TIMEOUT_S), "start",
    )  # fmt: skip


def _stop(data: Path, mode: str) -> None:
    _as_postgres(
        str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", mode, "-w", "-t", str(START_TIMEOUT_S),
        "stop",
    )  # fmt: skip


def _running(data: Path) -> bool:
    status = subprocess.run(
        ["runuser", "-u", PG_USER, "--", str(PG_BIN / "pg_ctl"), "-D", str(data), "status"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=START_TIMEOUT_S,
        check=False,
    )
    return status.returncode == 0


@contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    if not (PG_BIN / "initdb").exists():
        raise PostgresUnavailable(
            "PostgreSQL 15 is not installed: run `make deps` (Debian's postgresql-15)"
        )
    if os.geteuid() != 0:
        raise PostgresUnavailable("starting PostgreSQL as the postgres user needs root")
    account = pwd.getpwnam(PG_USER)
    root = Path(tempfile.mkdtemp(prefix="levers9-postgres-"))
    password = secrets.token_urlsafe(18)
    try:
        os.chown(root, account.pw_uid, account.pw_gid)
        pwfile = root / "pw"
        pwfile.write_text(password + "\n")
        os.chown(pwfile, account.pw_uid, account.pw_gid)
        pwfile.chmod(0o600)
        data = root / "data"
        _as_postgres(
            str(PG_BIN / "initdb"),
            "-D",
            str(data),
            "-U",
            PG_USER,
            "-A",
            "scram-sha-256",
            f"--pwfile={pwfile}",
            "-E",
            "UTF8",
            "--no-sync",
        )
        pwfile.unlink()
        port = _free_port()
        _start(data, port)
        try:
            yield PostgresServer("127.0.0.1", port, PG_USER, password, data)
        finally:
            # A test may have left it stopped (`PostgresServer.stop`).
            if _running(data):
                _stop(data, "fast")
    finally:
        shutil.rmtree(root, ignore_errors=True)
