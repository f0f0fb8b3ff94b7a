"""Shared set-up for tests that run a controlplane and agents for real on loopback.

A CA made at test time (trustme) signs the controlplane's certificate; agents are given that
CA, as the worker Job gives them the controlplane's. Everything listens on 127.0.0.1, port 0.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import trio
import trustme

from agent.config import AgentConfig, TunnelConfig
from agent.connection import KeepaliveConfig
from control.config import ControlConfig, parse


@attrs.frozen
class Pki:
    ca_file: Path
    cert_file: Path
    key_file: Path


def make_pki(directory: Path) -> Pki:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca_file, cert_file, key_file = (directory / n for n in ("ca.pem", "cp.pem", "cp-key.pem"))
    ca.cert_pem.write_to_path(str(ca_file))
    cert.private_key_pem.write_to_path(str(key_file))
    cert_file.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    return Pki(ca_file, cert_file, key_file)


WORKER_TOKENS = {"w-direct": "tok-direct-0123456789", "w-tunnel": "tok-tunnel-0123456789"}
API_TOKEN = "api-token-0123456789"


def control_config(pki: Pki, *, port: int = 0, ping_interval_s: float = 15.0) -> ControlConfig:
    return parse(
        {
            "config": {
                "publicUrl": f"https://127.0.0.1:{port}",
                "listen": f"127.0.0.1:{port}",
                "tls": {"certFile": str(pki.cert_file), "keyFile": str(pki.key_file)},
                "apiTokens": [{"name": "tests", "token": API_TOKEN}],
                "worker": {
                    "tokens": [{"workerId": k, "token": v} for k, v in WORKER_TOKENS.items()]
                },
                "tunnel": {"pingIntervalS": ping_interval_s, "pingTimeoutS": ping_interval_s},
                "database": {"path": str(pki.ca_file.parent / "tasks.db")},
            }
        }
    )


def agent_config(
    pki: Pki,
    controlplane_port: int,
    *,
    mode: str,
    worker_id: str | None = None,
    token: str | None = None,
    max_age_s: float = 3600.0,
    ping_interval_s: float = 15.0,
) -> AgentConfig:
    worker_id = worker_id or f"w-{mode}"
    return AgentConfig(
        worker_id=worker_id,
        token=token or WORKER_TOKENS[worker_id],
        mode=mode,
        controlplane_url=f"https://127.0.0.1:{controlplane_port}",
        controlplane_ca_file=str(pki.ca_file),
        listen_host="127.0.0.1",
        listen_port=0,
        advertise_host="127.0.0.1",
        register_interval_s=0.5,
        keepalive=KeepaliveConfig(ping_interval_s=ping_interval_s, ping_timeout_s=ping_interval_s),
        tunnel=TunnelConfig(
            max_age_s=max_age_s,
            drain_s=5.0,
            backoff_initial_s=0.05,
            backoff_cap_s=0.5,
            backoff_stable_s=2.0,
        ),
    )


async def read_line(stream: trio.abc.ReceiveStream) -> bytes:
    """One line from a child's stdout (a pipe may hand it over in pieces)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = await stream.receive_some(64)
        if not chunk:
            break
        line += chunk
    return line
