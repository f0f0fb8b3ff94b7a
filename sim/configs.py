"""The simulated installation's certificates, tokens and controlplane config, on loopback.

A CA made at start (trustme) signs the controlplane's certificate; agents are given that CA,
as the worker Job gives them the controlplane's. Everything listens on 127.0.0.1, port 0.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import trio
import trustme

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


async def read_line(stream: trio.abc.ReceiveStream) -> bytes:
    """One line from a child's stdout (a pipe may hand it over in pieces)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = await stream.receive_some(64)
        if not chunk:
            break
        line += chunk
    return line
