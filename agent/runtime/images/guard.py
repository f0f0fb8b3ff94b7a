"""Registries on the node are refused before they are dialled.

An image reference names whatever host a workspace likes, and with hostNetwork the worker's
loopback is the node's: pulling `127.0.0.1:10250/x` (or a name resolving there, or a token
realm or redirect pointing there) would let a task probe the node's ports and read from its
reason whether one is open. Every connection the puller makes goes through `GuardedBackend`:
the host is resolved once, every address is judged (`local_registry_refusal`: loopback,
link-local, the metadata server, the node's own addresses), and only then is a checked
address dialled, so a name cannot resolve elsewhere between check and dial. The refusal is the
same whatever listens on the port. `LEVERS9_ALLOW_LOCAL_REGISTRIES=1` (a pool's
`allowLocalRegistries: true`) turns the guard off, for a registry mirror on each node and for
the simulated installation.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpcore
import trio

from wire.errors import ErrorCode
from workerapi.reference import ImageError, local_registry_refusal


def parse_fib_trie(text: str) -> set[str]:
    """The IPv4 addresses /proc/net/fib_trie lists as this host's own (`/32 host LOCAL`)."""
    out: set[str] = set()
    last = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("|--"):
            last = stripped[3:].strip()
        elif stripped.endswith("host LOCAL") and last:
            out.add(last)
    return out


def parse_if_inet6(text: str) -> set[str]:
    """The IPv6 addresses /proc/net/if_inet6 lists (one per line, 32 hex digits first)."""
    out: set[str] = set()
    for line in text.splitlines():
        word = line.split(maxsplit=1)[0] if line.strip() else ""
        if len(word) == 32:
            out.add(str(ipaddress.IPv6Address(int(word, 16))))
    return out


def node_addresses(proc: Path = Path("/proc/net")) -> set[str]:
    """This host's own addresses (with hostNetwork, the node's)."""
    out: set[str] = set()
    for name, parse in (("fib_trie", parse_fib_trie), ("if_inet6", parse_if_inet6)):
        try:
            out |= parse((proc / name).read_text())
        except OSError:
            continue
    return out


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, resolving and judging each host before it dials."""

    def __init__(
        self,
        inner: httpcore.AsyncNetworkBackend,
        own: Callable[[], Iterable[str]] = node_addresses,
    ) -> None:
        self._inner = inner
        self._own = own

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's signature)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise httpcore.ConnectError(f"cannot resolve {host}: {exc}") from None
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        named = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        refused = local_registry_refusal(
            named, addresses, await trio.to_thread.run_sync(lambda: set(self._own()))
        )
        if refused is not None:
            raise ImageError(ErrorCode.PERMISSION_DENIED, refused, field="image")
        failure: httpcore.ConnectError | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except httpcore.ConnectError as exc:
                failure = exc
        raise failure or httpcore.ConnectError(f"{host} has no address")

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's signature)
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return await self._inner.connect_unix_socket(path, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)
