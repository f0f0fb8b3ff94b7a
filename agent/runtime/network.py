"""Container networking: a network namespace per container, a veth to the host, and our rules.

Each container gets a named network namespace (`/run/netns/l9-<container id>`) with `lo` up and
one veth pair: `eth0` inside, `l9h<8 hex>` on the host. Every pair owns a link-local /30 from a
pool (host .1, container .2, default route via the host), so nothing lands in the private ranges
the node's own networks use. The agent reaches a container's ports at its .2 address through the
veth; nothing is published on the node's interfaces.

One nftables table of our own (`inet levers9`) holds all policy: containers may open connections
to the outside (masqueraded behind the node's address) and get the replies, but never reach the
metadata address (169.254.169.254), another container, the rest of link-local, or the node
itself. The table is replaced whole in one `nft -f` transaction, so installing twice is harmless
and no other table is ever touched.

Design choices:
- Decisions are pure: the next free /30 (`allocate_subnet`), the ruleset (`ruleset`), the
  container's `/etc/hosts` and `/etc/resolv.conf`. The async layer only carries them out.
- The state lives on the system, not in memory, so a restarted agent recovers it: the host
  interface's name encodes its subnet (`l9h` + the /30's network address in hex), and its
  `ifalias` holds the container id. A name being unique also makes it the allocation lock between
  two agents: a taken name fails `ip link add` and we move on to the next /30.
- Speed: a start is measured against bare `runc run -d` (~40-60 ms), so a network is made with
  two processes, one `ip -batch` on the host and one inside the namespace. The second runs under
  `nsenter --net` rather than `ip -n`: `ip -n` also unshares a mount namespace and remounts
  sysfs, which costs it ~10 ms more per call here.
- `ip`, `nsenter` and `nft` are reached only through `_run_tool`, the adapter that turns their
  failures into `NetworkError`.
"""

from __future__ import annotations

import ctypes
import fcntl
import ipaddress
import logging
import os
import re
import socket
import struct
import threading
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path

import attrs
import trio

from wire.errors import ApiError, ErrorCode

log = logging.getLogger("levers9.network")

NETNS_DIR = Path("/run/netns")
"""Where `ip netns` keeps named namespaces; the runtime joins a container's by this path."""

METADATA_ADDRESS = ipaddress.IPv4Address("169.254.169.254")
LINK_LOCAL = ipaddress.IPv4Network("169.254.0.0/16")
DEFAULT_POOL = ipaddress.IPv4Network("169.254.128.0/17")
SUBNET_PREFIX = 30
CONTAINER_IFNAME = "eth0"

_SYSFS_NET = Path("/sys/class/net")
_IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
_FALLBACK_MTU = 1500
# A name taken by another agent (or a racing create) sends us to the next /30; this bounds that.
_CREATE_ATTEMPTS = 8
# Cleanup after a failed or cancelled create runs shielded; this bounds it.
_CLEANUP_TIMEOUT_S = 10.0

_CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")
_TABLE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")
# Interface names are at most 15 characters: prefix + "h" + 8 hex digits.
_PREFIX = re.compile(r"[a-z][a-z0-9]{0,5}")
_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


class NetworkError(ApiError):
    """A container network could not be made, found or removed; the message says which and why."""


@attrs.frozen
class ContainerNetwork:
    """One container's network: its namespace and the veth pair's two ends."""

    container_id: str
    netns: str
    netns_path: str
    host_ifname: str
    host_address: str
    address: str
    prefix: int = SUBNET_PREFIX

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Interface(f"{self.address}/{self.prefix}").network


# -- pure decisions -------------------------------------------------------------------------------


def allocate_subnet(
    used: set[ipaddress.IPv4Network],
    *,
    pool: ipaddress.IPv4Network = DEFAULT_POOL,
) -> ipaddress.IPv4Network:
    """The lowest /30 of `pool` that overlaps nothing in `used` and does not hold the metadata
    address (a container must never sit next to it)."""
    if pool.prefixlen > SUBNET_PREFIX:
        raise NetworkError(
            ErrorCode.INVALID_ARGUMENT,
            f"the container address pool {pool} is smaller than one /{SUBNET_PREFIX}; "
            "configure a pool of /30 or larger",
            field="pool",
        )
    size = 1 << (32 - SUBNET_PREFIX)
    first = int(pool.network_address)
    count = pool.num_addresses // size
    taken: set[int] = set()
    for net in (*used, ipaddress.IPv4Network(METADATA_ADDRESS)):
        if not net.overlaps(pool):
            continue
        low = max(int(net.network_address), first)
        high = min(int(net.broadcast_address), first + pool.num_addresses - 1)
        taken.update(range((low - first) // size, (high - first) // size + 1))
    for index in range(count):
        if index not in taken:
            return ipaddress.IPv4Network((first + index * size, SUBNET_PREFIX))
    raise NetworkError(
        ErrorCode.RESOURCE_EXHAUSTED,
        f"no free /{SUBNET_PREFIX} left in the container address pool {pool} "
        f"({len(taken)} of {count} taken); remove networks of containers that are gone, "
        "or configure a larger pool",
    )


def host_ifname(prefix: str, subnet: ipaddress.IPv4Network) -> str:
    """The host end's name: the prefix, "h", and the subnet's network address in hex."""
    return f"{prefix}h{int(subnet.network_address):08x}"


def subnet_of_ifname(prefix: str, name: str) -> ipaddress.IPv4Network | None:
    """The subnet a host end's name encodes, or None when the name is not one of ours."""
    head = f"{prefix}h"
    digits = name[len(head) :]
    if not name.startswith(head) or not re.fullmatch(r"[0-9a-f]{8}", digits):
        return None
    try:
        return ipaddress.IPv4Network((int(digits, 16), SUBNET_PREFIX))
    except ValueError:
        return None


def ruleset(
    table: str,
    *,
    pool: ipaddress.IPv4Network = DEFAULT_POOL,
    ifname_prefix: str = "l9",
) -> str:
    """The whole `nft -f` script that replaces our table (and only ours) in one transaction.

    Declaring the table before deleting it makes the delete succeed when it did not exist.
    """
    containers = f'"{ifname_prefix}h*"'
    return f"""\
table inet {table}
delete table inet {table}
table inet {table} {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr {pool} oifname != {containers} masquerade
    }}
    chain forward {{
        type filter hook forward priority filter; policy accept;
        iifname {containers} jump from_container
        oifname {containers} ct state established,related accept
        oifname {containers} drop
    }}
    chain from_container {{
        ip daddr {METADATA_ADDRESS} drop
        oifname {containers} drop
        ip saddr != {pool} drop
        ip daddr {LINK_LOCAL} drop
        ip daddr {pool} drop
        meta nfproto ipv6 drop
        accept
    }}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname {containers} ct state established,related accept
        iifname {containers} drop
    }}
}}
"""


def removal(table: str) -> str:
    """The `nft -f` script that deletes our table whether or not it exists."""
    return f"table inet {table}\ndelete table inet {table}\n"


def hosts_file(hostname: str, address: str) -> str:
    """The container's /etc/hosts: localhost and its own hostname at its address."""
    check_hostname(hostname)
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise NetworkError(
            ErrorCode.INVALID_ARGUMENT,
            f"address {address!r} is not an IP address; pass the container's address",
            field="address",
        ) from None
    names = hostname
    short = hostname.partition(".")[0]
    if short != hostname:
        names += f" {short}"
    return (
        "127.0.0.1\tlocalhost\n"
        "::1\tlocalhost ip6-localhost ip6-loopback\n"
        "ff02::1\tip6-allnodes\n"
        "ff02::2\tip6-allrouters\n"
        f"{ip}\t{names}\n"
    )


def check_hostname(hostname: str) -> None:
    """Refuse a hostname that is not RFC 1123 (dot-separated labels of letters, digits, '-')."""
    labels = hostname.split(".")
    if len(hostname) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise NetworkError(
            ErrorCode.INVALID_ARGUMENT,
            f"hostname {hostname!r} is not a valid host name; use letters, digits and '-' in "
            "dot-separated labels of at most 63 characters",
            field="hostname",
        )


def resolv_conf(node_resolv: str) -> str:
    """The container's /etc/resolv.conf: the node's, less loopback nameservers.

    A loopback nameserver (systemd-resolved's 127.0.0.53, a local dnsmasq) is the container's
    own loopback inside its namespace, where nothing answers. With no nameserver left the file
    is empty: the resolver's own default would be loopback as well.
    """
    kept: list[str] = []
    nameservers = 0
    for line in node_resolv.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            try:
                server = ipaddress.ip_address(words[1].partition("%")[0])
            except ValueError:
                continue
            if server.is_loopback:
                continue
            nameservers += 1
        kept.append(line)
    if nameservers == 0:
        return ""
    return "\n".join(kept) + "\n"


def uplink_mtu(proc_net_route: str, mtus: dict[str, int]) -> int:
    """The smallest MTU among the interfaces of the node's IPv4 default routes.

    A veth with a larger MTU than the way out would send packets that the uplink has to
    fragment or drop; matching it keeps the containers' traffic whole.
    """
    found = []
    for line in proc_net_route.splitlines()[1:]:
        fields = line.split()
        is_default = len(fields) >= 8 and fields[1] == "00000000" and fields[7] == "00000000"
        if is_default and fields[0] in mtus:
            found.append(mtus[fields[0]])
    return min(found, default=_FALLBACK_MTU)


# -- the adapter for ip, nsenter and nft ----------------------------------------------------------


class ToolFailed(NetworkError):
    """`ip`, `nsenter` or `nft` exited non-zero: `line` is the failing batch line (1-based, when
    the tool said), `reason` what it printed."""

    def __init__(self, message: str, *, line: int | None, reason: str) -> None:
        super().__init__(ErrorCode.INTERNAL, message)
        self.line = line
        self.reason = reason


_FAILED_LINE = re.compile(r"^Command failed -:(\d+)$", re.MULTILINE)


async def _run_tool(argv: Sequence[str], script: str, *, what: str) -> None:
    """Run one tool with `script` on stdin; its failures become `NetworkError`s."""
    try:
        result = await trio.run_process(
            list(argv),
            stdin=script.encode(),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    except FileNotFoundError:
        raise NetworkError(
            ErrorCode.FAILED_PRECONDITION,
            f"cannot {what}: {argv[0]} is not installed; install iproute2, util-linux and "
            "nftables on the node image",
        ) from None
    except OSError as exc:
        raise NetworkError(
            ErrorCode.INTERNAL, f"cannot {what}: starting {argv[0]} failed: {exc}"
        ) from None
    if result.returncode == 0:
        return
    stderr = result.stderr.decode(errors="replace")
    match = _FAILED_LINE.search(stderr)
    line = int(match.group(1)) if match else None
    reason = _FAILED_LINE.sub("", stderr).strip() or f"exit status {result.returncode}"
    where = ""
    lines = script.splitlines()
    if line is not None and 0 < line <= len(lines):
        where = f" at {lines[line - 1].strip()!r}"
    raise ToolFailed(f"cannot {what}: {argv[0]} failed{where}: {reason}", line=line, reason=reason)


async def _ip_batch(
    lines: Iterable[str], *, what: str, netns_path: str | None = None, force: bool = False
) -> None:
    """Run `ip` commands in one process (in `netns_path`'s namespace when given); with `force`
    it carries on past failing lines and fails at the end."""
    script = "".join(f"{line}\n" for line in lines)
    argv = ["ip", *(["-force"] if force else []), "-batch", "-"]
    if netns_path is not None:
        argv = ["nsenter", f"--net={netns_path}", *argv]
    await _run_tool(argv, script, what=what)


# ioctl numbers and flags from <linux/sockios.h>, <net/if.h>, <net/route.h>.
_SIOCGIFFLAGS, _SIOCSIFFLAGS = 0x8913, 0x8914
_SIOCSIFADDR, _SIOCSIFNETMASK = 0x8916, 0x891C
_SIOCADDRT = 0x890B
_IFF_UP = 0x1
_RTF_UP, _RTF_GATEWAY = 0x1, 0x2
_CLONE_NEWNET = 0x40000000


def _sockaddr_in(address: str) -> bytes:
    return struct.pack("=HH4s8x", socket.AF_INET, 0, socket.inet_aton(address))


def _ifreq(name: str, payload: bytes = b"") -> bytes:
    return struct.pack("16s", name.encode()) + payload.ljust(24, b"\0")


def _set_up(sock: socket.socket, name: str) -> None:
    flags = struct.unpack_from("H", fcntl.ioctl(sock, _SIOCGIFFLAGS, _ifreq(name)), 16)[0]
    fcntl.ioctl(sock, _SIOCSIFFLAGS, _ifreq(name, struct.pack("H", flags | _IFF_UP)))


def _default_route(gateway: str) -> bytes:
    """A `struct rtentry` (x86_64 / aarch64 layout) for `default via gateway`."""
    zero = _sockaddr_in("0.0.0.0")
    return struct.pack(
        "=Q16s16s16sHh4xQQh6xQQQH6x",
        0,
        zero,
        _sockaddr_in(gateway),
        zero,
        _RTF_UP | _RTF_GATEWAY,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
    )


def _configure_inside(
    netns_path: str, address: str, gateway: str, prefix: int, container_id: str
) -> None:
    """Inside the container's namespace: `lo` up, `eth0` with its address, up, and the default
    route, by ioctl. This saves starting a process (`nsenter ip -batch`, ~6 ms) on every
    container start. It runs on a thread of its own, made and ended here: a thread's network
    namespace is per thread, and a pooled thread must never be left in a container's."""
    failure: list[BaseException] = []

    def work() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(netns_path, "rb") as target:
            if libc.setns(target.fileno(), _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {netns_path} failed")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            _set_up(sock, "lo")
            fcntl.ioctl(sock, _SIOCSIFADDR, _ifreq(CONTAINER_IFNAME, _sockaddr_in(address)))
            mask = str(ipaddress.IPv4Network(f"0.0.0.0/{prefix}").netmask)
            fcntl.ioctl(sock, _SIOCSIFNETMASK, _ifreq(CONTAINER_IFNAME, _sockaddr_in(mask)))
            _set_up(sock, CONTAINER_IFNAME)
            fcntl.ioctl(sock, _SIOCADDRT, _default_route(gateway))

    def guarded() -> None:
        try:
            work()
        except BaseException as exc:
            failure.append(exc)

    # The thread ends in the container's namespace and is thrown away with it.
    thread = threading.Thread(target=guarded, name=f"netns-{container_id}", daemon=True)
    thread.start()
    thread.join()
    if failure:
        exc = failure[0]
        raise ToolFailed(
            f"could not configure the network namespace of container {container_id}: {exc}",
            line=None,
            reason=exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc),
        ) from None


async def _nft(script: str, *, what: str) -> None:
    await _run_tool(["nft", "-f", "-"], script, what=what)


# -- the system's state, read without starting a process ------------------------------------------


@attrs.frozen
class _HostLink:
    name: str
    subnet: ipaddress.IPv4Network
    container_id: str


def _read_alias(name: str) -> str:
    try:
        return (_SYSFS_NET / name / "ifalias").read_text().strip()
    except OSError:
        return ""


def _host_links(prefix: str) -> list[_HostLink]:
    """Our host ends in this namespace, with the subnet their name encodes and the container id
    their alias holds ("" for one whose create died before naming it)."""
    links = []
    for _, name in socket.if_nameindex():
        subnet = subnet_of_ifname(prefix, name)
        if subnet is not None:
            links.append(_HostLink(name, subnet, _read_alias(name)))
    return links


def _used_subnets(prefix: str) -> set[ipaddress.IPv4Network]:
    used = set()
    for _, name in socket.if_nameindex():
        subnet = subnet_of_ifname(prefix, name)
        if subnet is not None:
            used.add(subnet)
    return used


def _netns_names(prefix: str) -> list[str]:
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(f"{prefix}-"))


def _read_uplink_mtu() -> int:
    try:
        routes = Path("/proc/net/route").read_text()
    except OSError:
        return _FALLBACK_MTU
    mtus = {}
    for _, name in socket.if_nameindex():
        try:
            mtus[name] = int((_SYSFS_NET / name / "mtu").read_text())
        except (OSError, ValueError):
            continue
    return uplink_mtu(routes, mtus)


def _enable_forwarding() -> None:
    if _IP_FORWARD.read_text().strip() != "1":
        _IP_FORWARD.write_text("1\n")


# -- the async layer ------------------------------------------------------------------------------


class Networking:
    """Makes, finds and removes containers' networks, and owns our nftables table.

    `prefix` names what we create (`<prefix>-<id>` namespaces, `<prefix>h<hex>` host ends);
    two agents (or a test and an agent) on one node need different prefixes, tables and pools.
    `mtu` defaults to the MTU of the node's default-route interface.
    """

    def __init__(
        self,
        *,
        table: str = "levers9",
        pool: str = str(DEFAULT_POOL),
        prefix: str = "l9",
        mtu: int | None = None,
    ) -> None:
        if not _TABLE.fullmatch(table):
            raise NetworkError(
                ErrorCode.INVALID_ARGUMENT,
                f"nftables table name {table!r} is not valid; use a letter, then letters, "
                "digits or '_' (32 at most)",
                field="table",
            )
        if not _PREFIX.fullmatch(prefix):
            raise NetworkError(
                ErrorCode.INVALID_ARGUMENT,
                f"interface prefix {prefix!r} is not valid; use a lowercase letter then up to "
                "5 lowercase letters or digits (interface names have 15 characters at most)",
                field="prefix",
            )
        try:
            self.pool = ipaddress.IPv4Network(pool)
        except ValueError:
            raise NetworkError(
                ErrorCode.INVALID_ARGUMENT,
                f"container address pool {pool!r} is not an IPv4 network; give one like "
                f"{DEFAULT_POOL}",
                field="pool",
            ) from None
        if self.pool.prefixlen > SUBNET_PREFIX:
            raise NetworkError(
                ErrorCode.INVALID_ARGUMENT,
                f"container address pool {pool} is smaller than one /{SUBNET_PREFIX}",
                field="pool",
            )
        self.table = table
        self.prefix = prefix
        self._mtu = mtu
        # Serialises choosing a /30 and claiming its name, so two creates never pick the same.
        self._allocating = trio.Lock()

    def netns_name(self, container_id: str) -> str:
        return f"{self.prefix}-{container_id}"

    async def install(self) -> None:
        """Turn on IPv4 forwarding and (re)install our table; safe to call again."""
        try:
            await trio.to_thread.run_sync(_enable_forwarding)
        except OSError as exc:
            raise NetworkError(
                ErrorCode.FAILED_PRECONDITION,
                f"cannot turn on IPv4 forwarding ({_IP_FORWARD}): {exc}; the agent needs root "
                "in the node's network namespace",
            ) from None
        await _nft(
            ruleset(self.table, pool=self.pool, ifname_prefix=self.prefix),
            what=f"install the nftables table inet {self.table}",
        )
        log.info("installed nftables table inet %s for pool %s", self.table, self.pool)

    async def uninstall(self) -> None:
        """Delete our table (only ours); forwarding stays on, as other software may need it."""
        await _nft(removal(self.table), what=f"delete the nftables table inet {self.table}")

    async def create(self, container_id: str) -> ContainerNetwork:
        """Make `container_id`'s namespace and veth pair; ALREADY_EXISTS if it has one."""
        if not _CONTAINER_ID.fullmatch(container_id):
            raise NetworkError(
                ErrorCode.INVALID_ARGUMENT,
                f"container id {container_id!r} cannot name a network namespace; use letters, "
                "digits, '_', '.' and '-' (200 at most), starting with a letter or digit",
                field="container_id",
            )
        netns = self.netns_name(container_id)
        netns_path = str(NETNS_DIR / netns)
        if self._mtu is None:
            self._mtu = await trio.to_thread.run_sync(_read_uplink_mtu)
        mtu = self._mtu
        try:
            async with self._allocating:
                subnet = await self._claim(container_id, netns, mtu)
            host, peer = (str(a) for a in list(subnet.hosts())[:2])
            await trio.to_thread.run_sync(
                _configure_inside, netns_path, peer, host, SUBNET_PREFIX, container_id
            )
        except NetworkError as exc:
            # ALREADY_EXISTS means the namespace is another network's: leave it alone.
            if exc.code is not ErrorCode.ALREADY_EXISTS:
                await self._undo_create(container_id)
            raise
        except BaseException:
            await self._undo_create(container_id)
            raise
        return ContainerNetwork(
            container_id=container_id,
            netns=netns,
            netns_path=netns_path,
            host_ifname=host_ifname(self.prefix, subnet),
            host_address=host,
            address=peer,
        )

    async def _claim(self, container_id: str, netns: str, mtu: int) -> ipaddress.IPv4Network:
        """Create the namespace and the veth pair on a free /30; the host end's name is the
        claim, so a /30 someone else took meanwhile fails `link add` and we try the next."""
        if (NETNS_DIR / netns).exists():
            raise NetworkError(
                ErrorCode.ALREADY_EXISTS,
                f"container {container_id} already has a network (namespace {netns}); "
                "delete it first",
                field="container_id",
            )
        refused: set[ipaddress.IPv4Network] = set()
        netns_made = False
        for _ in range(_CREATE_ATTEMPTS):
            used = await trio.to_thread.run_sync(_used_subnets, self.prefix)
            subnet = allocate_subnet(used | refused, pool=self.pool)
            name = host_ifname(self.prefix, subnet)
            host = next(iter(subnet.hosts()))
            lines = [] if netns_made else [f"netns add {netns}"]
            lines += [
                f"link add {name} mtu {mtu} type veth peer name {CONTAINER_IFNAME} "
                f"mtu {mtu} netns {netns}",
                f"link set dev {name} alias {container_id} up",
                f"addr add {host}/{SUBNET_PREFIX} dev {name}",
            ]
            try:
                await _ip_batch(lines, what=f"create the network of container {container_id}")
            except ToolFailed as exc:
                netns_line = 0 if netns_made else 1
                if exc.line == netns_line and "File exists" in exc.reason:
                    raise NetworkError(
                        ErrorCode.ALREADY_EXISTS,
                        f"container {container_id} already has a network (namespace {netns}); "
                        "delete it first",
                        field="container_id",
                    ) from None
                netns_made = True
                if exc.line == netns_line + 1 and "File exists" in exc.reason:
                    refused.add(subnet)
                    continue
                raise
            return subnet
        raise NetworkError(
            ErrorCode.UNAVAILABLE,
            f"could not claim a /{SUBNET_PREFIX} for container {container_id} in "
            f"{_CREATE_ATTEMPTS} tries: each was taken meanwhile; retry",
        )

    async def delete(self, net: ContainerNetwork | str) -> None:
        """Remove a container's veth pair and namespace; nothing to do if they are gone."""
        container_id = net if isinstance(net, str) else net.container_id
        netns = self.netns_name(container_id)
        links = await trio.to_thread.run_sync(_host_links, self.prefix)
        # By alias, not by the name a caller holds: a /30 freed earlier may now be another's.
        names = [link.name for link in links if link.container_id == container_id]
        await self._remove(names, [netns] if (NETNS_DIR / netns).exists() else [])

    async def _remove(self, links: Sequence[str], netns: Sequence[str]) -> None:
        # Deleting the host end takes the pair down now, even if a stray process still holds
        # the namespace (which would otherwise keep both alive).
        lines = [f"link del dev {name}" for name in links]
        lines += [f"netns del {name}" for name in netns]
        if not lines:
            return
        try:
            await _ip_batch(lines, what="delete container networks", force=True)
        except ToolFailed as exc:
            # Something may have gone meanwhile (a racing delete); only what is left counts.
            present = {name for _, name in socket.if_nameindex()}
            left = [n for n in links if n in present]
            left += [n for n in netns if (NETNS_DIR / n).exists()]
            if left:
                raise NetworkError(
                    ErrorCode.INTERNAL, f"cannot delete {', '.join(left)}: {exc.reason}"
                ) from None

    async def _undo_create(self, container_id: str) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(_CLEANUP_TIMEOUT_S):
            try:
                await self.delete(container_id)
            except NetworkError as exc:
                log.warning(
                    "could not clean up the network of container %s after a failed create: %s",
                    container_id,
                    exc.message,
                )

    async def existing(self) -> list[ContainerNetwork]:
        """Our container networks found on the system (a namespace and its host end)."""
        names, links = await trio.to_thread.run_sync(self._scan)
        by_id = {link.container_id: link for link in links if link.container_id}
        found = []
        for netns in names:
            container_id = netns[len(self.prefix) + 1 :]
            link = by_id.get(container_id)
            if link is None:
                continue
            host, peer = (str(a) for a in list(link.subnet.hosts())[:2])
            found.append(
                ContainerNetwork(
                    container_id=container_id,
                    netns=netns,
                    netns_path=str(NETNS_DIR / netns),
                    host_ifname=link.name,
                    host_address=host,
                    address=peer,
                )
            )
        return found

    async def sweep(self, keep: Collection[str]) -> list[str]:
        """Remove every network of ours whose container is not in `keep`, half-made ones too
        (a namespace without its veth, a veth without its namespace); returns their ids."""
        names, links = await trio.to_thread.run_sync(self._scan)
        keep = set(keep)
        stale_netns = [n for n in names if n[len(self.prefix) + 1 :] not in keep]
        stale_links = [link for link in links if link.container_id not in keep]
        gone = {n[len(self.prefix) + 1 :] for n in stale_netns}
        gone |= {link.container_id for link in stale_links if link.container_id}
        await self._remove([link.name for link in stale_links], stale_netns)
        return sorted(gone)

    def _scan(self) -> tuple[list[str], list[_HostLink]]:
        return _netns_names(self.prefix), _host_links(self.prefix)


__all__ = [
    "DEFAULT_POOL",
    "METADATA_ADDRESS",
    "NETNS_DIR",
    "ContainerNetwork",
    "NetworkError",
    "Networking",
    "ToolFailed",
    "allocate_subnet",
    "check_hostname",
    "host_ifname",
    "hosts_file",
    "removal",
    "resolv_conf",
    "ruleset",
    "subnet_of_ifname",
    "uplink_mtu",
]
