"""Debian's Chromium for the dashboard's tests and benchmark, on a network of its own.

Every container a simulated node starts or stops adds or removes a veth with an address on
this host, and Chromium fails whatever is in flight when the host's addresses change
(`net::ERR_NETWORK_CHANGED`): a page load or a form post then ends on Chromium's error page.
A user's browser is on another machine, whose interfaces do not follow the node's containers;
here the browser gets the same: a network namespace holding only `lo`, where a forwarder
listens on the controlplane's own address and port and carries each connection to the
controlplane on the host's loopback. The URL, and so the origin and its cookies, stay the same.

Needs root (`ip netns`, `setns`), as the tests that start a cluster already do.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import hashlib
import os
import secrets
import socket
import subprocess
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import trio
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from wire.service import splice

CHROMIUM = "/usr/bin/chromium"
_CLONE_NEWNET = 0x40000000


def spki_pin(cert_file: Path) -> str:
    """What Chromium's --ignore-certificate-errors-spki-list takes: base64 SHA-256 of the
    certificate's public key, so only this one certificate is accepted without a CA."""
    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    spki = cert.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


def _listen_inside(netns_path: str, host: str, port: int) -> socket.socket:
    """A listening socket made inside `netns_path`, on a thread of its own that ends there (a
    thread's network namespace is its own; the socket keeps the namespace it was made in)."""
    made: list[socket.socket] = []
    failure: list[BaseException] = []

    def work() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(netns_path, "rb") as target:
                if libc.setns(target.fileno(), _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {netns_path} failed")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(64)
            made.append(sock)
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=work, name="browser-netns", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return made[0]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.asynccontextmanager
async def open_browser_network(url: str) -> AsyncIterator[str]:
    """A network namespace from which `url` (https://127.0.0.1:PORT) reaches the same server;
    yields the path of a Chromium launcher that runs the browser inside it. The namespace,
    the launcher and the forwarder are gone on exit."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 443
    name = f"l9browser-{secrets.token_hex(4)}"
    await trio.to_thread.run_sync(_ip, "netns", "add", name)
    try:
        await trio.to_thread.run_sync(_ip, "-n", name, "link", "set", "lo", "up")
        sock = _listen_inside(f"/run/netns/{name}", host, port)
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))

        async def carry(inbound: trio.SocketStream) -> None:
            async with inbound:
                with contextlib.suppress(OSError, trio.BrokenResourceError):
                    async with await trio.open_tcp_stream(host, port) as outbound:
                        await splice(inbound, outbound)

        with tempfile.TemporaryDirectory(prefix="l9browser-") as tmp:
            launcher = Path(tmp) / "chromium"
            launcher.write_text(
                f'#!/bin/sh\nexec nsenter --net=/run/netns/{name} {CHROMIUM} "$@"\n'
            )
            os.chmod(launcher, 0o755)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.serve_listeners, carry, [listener])
                try:
                    yield str(launcher)
                finally:
                    nursery.cancel_scope.cancel()
    finally:
        await trio.to_thread.run_sync(_ip, "netns", "delete", name)


__all__ = ["CHROMIUM", "open_browser_network", "spki_pin"]
