"""Test hosts of our own, each in a network namespace, for the container networking tests.

The networking tests must never send a packet off this machine, yet they have to show that the
metadata address is blocked and that outbound traffic is masqueraded. So the "outside" is a
namespace we make here: a test host on its own veth, holding the address a container would try
to reach, running a tiny TCP server that answers every connection with the peer address it saw.
Routes and policy rules to it are added for the test's duration and deleted exactly.

Probes and servers are small Python programs started in a namespace with `nsenter --net`, so
what they see is what a container's process would see.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence

import attrs
import trio

_SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(64)
print(s.getsockname()[1], flush=True)
while True:
    c, peer = s.accept()
    c.sendall(peer[0].encode())
    c.close()
"""

_PROBE = """
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
timeout, source, targets = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
def probe(target):
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection(
            (host, int(port)), timeout=timeout, source_address=(source, 0) if source else None
        ) as c:
            data = b""
            while chunk := c.recv(100):
                data += chunk
            return data.decode()
    except OSError:
        return None
with ThreadPoolExecutor(len(targets)) as pool:
    print(json.dumps(dict(zip(targets, pool.map(probe, targets)))))
"""

PROBE_TIMEOUT_S = 1.0
"""How long a probe waits for a connection: a dropped SYN looks like this much silence."""


def _in_netns(netns: str | None, argv: Sequence[str]) -> list[str]:
    if netns is None:
        return list(argv)
    return ["nsenter", f"--net=/run/netns/{netns}", *argv]


async def sh(*argv: str, stdin: str = "") -> str:
    """Run a command; its stdout, or AssertionError with its stderr."""
    result = await trio.run_process(
        list(argv), stdin=stdin.encode(), capture_stdout=True, capture_stderr=True, check=False
    )
    if result.returncode != 0:
        raise AssertionError(f"{argv} failed: {result.stderr.decode(errors='replace')}")
    return result.stdout.decode()


async def quietly(*argv: str, stdin: str = "") -> None:
    """Run a cleanup command whose failure (the thing is already gone) does not matter."""
    await trio.run_process(
        list(argv),
        stdin=stdin.encode(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )


async def probe(
    netns: str | None, targets: Sequence[str], *, source: str = ""
) -> dict[str, str | None]:
    """Connect to every "host:port" at once from `netns` (None: the host); for each, what the
    server answered (the peer address it saw), or None when no connection was made."""
    out = await sh(
        *_in_netns(netns, [sys.executable, "-c", _PROBE, str(PROBE_TIMEOUT_S), source, *targets])
    )
    result: dict[str, str | None] = json.loads(out)
    return result


@contextlib.asynccontextmanager
async def serve(netns: str | None, address: str, port: int = 0) -> AsyncIterator[int]:
    """A TCP server in `netns` (None: the host) that tells each client its peer address;
    yields its port and stops it on exit."""
    process = await trio.lowlevel.open_process(
        _in_netns(netns, [sys.executable, "-c", _SERVER, address, str(port)]),
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(10):
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive_some(64)
                if not chunk:
                    raise AssertionError(f"server on {address} in {netns} did not start")
                line += chunk
        yield int(line)
    finally:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
            if process.stdout is not None:
                await process.stdout.aclose()


@attrs.frozen
class TestHost:
    """A namespace joined to the host by a veth: `host_address` on the host end,
    `address` (and any `extra` addresses) inside; its default route points back at the host."""

    __test__ = False

    netns: str
    host_ifname: str
    host_address: str
    address: str
    extra: tuple[str, ...] = ()


async def _remove_host(netns: str, host_ifname: str) -> None:
    await quietly("ip", "link", "del", "dev", host_ifname)
    await quietly("ip", "netns", "del", netns)


@contextlib.asynccontextmanager
async def open_test_host(
    netns: str,
    host_ifname: str,
    link: str,
    *,
    extra: Sequence[str] = (),
) -> AsyncIterator[TestHost]:
    """Make a test host on the /30 `link` (host end .1, test host .2) holding also the `extra`
    /32 addresses; a leftover of the same name from a killed run is removed first."""
    net = ipaddress.IPv4Network(link)
    host, peer = (str(a) for a in list(net.hosts())[:2])
    await _remove_host(netns, host_ifname)
    try:
        await sh(
            "ip",
            "-batch",
            "-",
            stdin=(
                f"netns add {netns}\n"
                f"link add {host_ifname} type veth peer name eth0 netns {netns}\n"
                f"addr add {host}/{net.prefixlen} dev {host_ifname}\n"
                f"link set dev {host_ifname} up\n"
            ),
        )
        inside = [
            "link set dev lo up",
            f"addr add {peer}/{net.prefixlen} dev eth0",
            *(f"addr add {address}/32 dev eth0" for address in extra),
            "link set dev eth0 up",
            f"route add default via {host} dev eth0",
        ]
        await sh(*_in_netns(netns, ["ip", "-batch", "-"]), stdin="\n".join(inside) + "\n")
        yield TestHost(netns, host_ifname, host, peer, tuple(extra))
    finally:
        with trio.CancelScope(shield=True):
            await _remove_host(netns, host_ifname)


async def route_dev(destination: str, *, source: str = "", iif: str = "") -> str:
    """The interface the host would send a packet to `destination` out of (as `ip route get`
    says), for a packet from `source` arriving on `iif` when given."""
    argv = ["ip", "-j", "route", "get", destination]
    if source:
        argv += ["from", source]
    if iif:
        argv += ["iif", iif]
    routes = json.loads(await sh(*argv))
    dev: str = routes[0]["dev"]
    return dev


@contextlib.asynccontextmanager
async def policy_route(
    destination: str, dev: str, *, sources: Sequence[str], table: int, priority: int
) -> AsyncIterator[None]:
    """Send packets from `sources` to `destination` out of `dev`, through rules and a routing
    table of the test's own; every other packet on the node keeps its route, and on exit exactly
    these rules and this table's route are deleted.

    A plain route in the main table would take the address from every process on the node for
    the test's duration and could collide with (or have to displace) a route the node has.
    """
    shown = await trio.run_process(
        ["ip", "route", "show", "table", str(table)],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    # A table that does not exist yet makes `ip` fail, which is as good as empty.
    if shown.stdout.strip():
        raise AssertionError(f"routing table {table} is in use; pick another for the test")
    rules = [
        ["from", source, "to", destination, "lookup", str(table), "priority", str(priority)]
        for source in sources
    ]
    added: list[list[str]] = []
    route = ["ip", "route", "add", destination, "dev", dev, "table", str(table)]
    try:
        await sh(*route)
        for rule in rules:
            await sh("ip", "rule", "add", *rule)
            added.append(rule)
        yield
    finally:
        with trio.CancelScope(shield=True):
            for rule in added:
                await quietly("ip", "rule", "del", *rule)
            await quietly("ip", "route", "del", destination, "dev", dev, "table", str(table))


@contextlib.asynccontextmanager
async def own_table(name: str) -> AsyncIterator[None]:
    """An nftables table of the test's own (with a chain and a rule), deleted on exit."""
    await sh(
        "nft",
        "-f",
        "-",
        stdin=(
            f"table inet {name}\ndelete table inet {name}\n"
            f"table inet {name} {{\n  chain c {{\n    tcp dport 9 counter\n  }}\n}}\n"
        ),
    )
    try:
        yield
    finally:
        with trio.CancelScope(shield=True):
            await quietly("nft", "delete", "table", "inet", name)


async def table_names() -> set[str]:
    """`family name` of every nftables table on the node."""
    out = await sh("nft", "-j", "list", "tables")
    return {
        f"{item['table']['family']} {item['table']['name']}"
        for item in json.loads(out)["nftables"]
        if "table" in item
    }


async def node_addresses() -> list[str]:
    """The node's own IPv4 addresses outside loopback, link-local and the test range."""
    found = []
    for link in json.loads(await sh("ip", "-j", "-4", "addr", "show")):
        for info in link.get("addr_info", []):
            address = ipaddress.IPv4Address(info["local"])
            benchmark = address in ipaddress.IPv4Network("198.18.0.0/15")
            if not (address.is_loopback or address.is_link_local or benchmark):
                found.append(str(address))
    return found
