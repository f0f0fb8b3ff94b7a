"""Container networking: the pure decisions, then the real namespaces, veths and nftables rules.

The integration tests use their own prefix, pool and table, so they neither see nor disturb the
networks of an agent or of other tests on the node, and every packet they send ends at a test
host of their own (tests/netns_hosts.py). Where a test shows that something is blocked it first
shows, with our table removed, that the same probe gets through: the block is what stops it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from agent.runtime.network import (
    DEFAULT_POOL,
    METADATA_ADDRESS,
    ContainerNetwork,
    NetworkError,
    Networking,
    allocate_subnet,
    host_ifname,
    hosts_file,
    resolv_conf,
    subnet_of_ifname,
    uplink_mtu,
)
from tests.netns_hosts import (
    node_addresses,
    open_test_host,
    own_table,
    policy_route,
    probe,
    route_dev,
    serve,
    sh,
    table_names,
)
from wire.errors import ErrorCode

TEST_PREFIX = "l9q"
TEST_POOL = "169.254.96.0/22"
TEST_TABLE = "levers9test"
# The routing table and rule priority of the metadata test's policy route.
TEST_ROUTE_TABLE = 7919
TEST_RULE_PRIORITY = 7919

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "nft", "nsenter")),
    reason="needs root with ip, nft and nsenter",
)


def net30(text: str) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(text)


# -- allocation (pure) ----------------------------------------------------------------------------


def test_allocation_takes_the_lowest_free_subnet() -> None:
    assert allocate_subnet(set()) == net30("169.254.128.0/30")
    used = {net30("169.254.128.0/30"), net30("169.254.128.8/30")}
    assert allocate_subnet(used) == net30("169.254.128.4/30")


def test_allocation_skips_anything_a_wider_used_network_covers() -> None:
    used = {ipaddress.IPv4Network("169.254.128.0/28")}
    assert allocate_subnet(used) == net30("169.254.128.16/30")


def test_allocation_never_hands_out_the_metadata_subnet() -> None:
    pool = ipaddress.IPv4Network("169.254.169.240/28")
    used = {net30("169.254.169.240/30"), net30("169.254.169.244/30"), net30("169.254.169.248/30")}
    with pytest.raises(NetworkError) as caught:
        allocate_subnet(used, pool=pool)
    assert caught.value.code is ErrorCode.RESOURCE_EXHAUSTED
    # Only .252/30, which holds 169.254.169.254, was left: the pool counts as full.
    assert "169.254.169.240/28" in caught.value.message


def test_an_exhausted_pool_says_which_pool_and_what_to_do() -> None:
    pool = ipaddress.IPv4Network("169.254.130.0/29")
    with pytest.raises(NetworkError) as caught:
        allocate_subnet({net30("169.254.130.0/30"), net30("169.254.130.4/30")}, pool=pool)
    assert caught.value.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "169.254.130.0/29" in caught.value.message
    assert "larger pool" in caught.value.message


@given(st.sets(st.integers(min_value=0, max_value=63), max_size=63))
def test_allocation_is_the_lowest_subnet_that_is_free(taken: set[int]) -> None:
    pool = ipaddress.IPv4Network("169.254.169.0/24")
    subnets = list(pool.subnets(new_prefix=30))
    used = {subnets[i] for i in taken}
    subnet = allocate_subnet(used, pool=pool)
    assert subnet in subnets
    assert subnet not in used
    assert METADATA_ADDRESS not in subnet
    free = [s for s in subnets if s not in used and METADATA_ADDRESS not in s]
    assert subnet == free[0]


def test_a_host_interface_name_encodes_its_subnet_and_fits_the_kernel_limit() -> None:
    last = list(DEFAULT_POOL.subnets(new_prefix=30))[-1]
    name = host_ifname("l9", last)
    assert name == "l9ha9fefffc"
    assert len(host_ifname("abcdef", last)) <= 15
    assert subnet_of_ifname("l9", name) == last
    assert subnet_of_ifname("l9", "l9hello") is None
    assert subnet_of_ifname("l9", "eth0") is None
    assert subnet_of_ifname("l9", "l9qha9fe6000") is None


# -- files and settings (pure) --------------------------------------------------------------------


def test_hosts_file_names_localhost_and_the_container() -> None:
    text = hosts_file("web-1.example", "169.254.128.2")
    lines = [line.split() for line in text.splitlines()]
    assert ["127.0.0.1", "localhost"] in lines
    assert ["169.254.128.2", "web-1.example", "web-1"] in lines


def test_hosts_file_refuses_a_hostname_that_would_break_the_file() -> None:
    with pytest.raises(NetworkError) as caught:
        hosts_file("bad name\n10.0.0.1 evil", "169.254.128.2")
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert caught.value.field == "hostname"


def test_resolv_conf_keeps_reachable_nameservers_and_the_rest() -> None:
    node = "# generated\nnameserver 127.0.0.53\nnameserver 10.96.0.10\nsearch svc.local\n"
    assert resolv_conf(node) == "# generated\nnameserver 10.96.0.10\nsearch svc.local\n"


def test_resolv_conf_is_empty_when_only_loopback_nameservers_remain() -> None:
    assert resolv_conf("nameserver 127.0.0.53\nnameserver ::1\noptions edns0\n") == ""
    assert resolv_conf("") == ""


def test_veth_mtu_follows_the_default_route_interface() -> None:
    routes = (
        "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n"
        "eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\n"
        "eth1\t000012AC\t00000000\t0001\t0\t0\t0\t0000FFFF\n"
    )
    assert uplink_mtu(routes, {"eth0": 1400, "eth1": 9000}) == 1400
    assert uplink_mtu("Iface\tDestination\n", {}) == 1500


def test_settings_that_cannot_work_are_refused_naming_the_setting() -> None:
    for kwargs, field in (
        ({"table": "bad table"}, "table"),
        ({"pool": "10.0.0.0/33"}, "pool"),
        ({"pool": "169.254.1.0/31"}, "pool"),
        ({"prefix": "toolongx"}, "prefix"),
    ):
        with pytest.raises(NetworkError) as caught:
            Networking(**kwargs)  # type: ignore[arg-type]
        assert caught.value.code is ErrorCode.INVALID_ARGUMENT
        assert caught.value.field == field


# -- real namespaces and rules --------------------------------------------------------------------


@pytest.fixture
async def net() -> AsyncIterator[Networking]:
    networking = Networking(table=TEST_TABLE, pool=TEST_POOL, prefix=TEST_PREFIX)
    await networking.sweep(())  # what a killed run left
    try:
        yield networking
    finally:
        with trio.CancelScope(shield=True):
            await networking.sweep(())
            await networking.uninstall()


async def in_container(cn: ContainerNetwork, *argv: str) -> str:
    return await sh("nsenter", f"--net={cn.netns_path}", *argv)


def host_link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def forwarding() -> str:
    return Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()


@pytest.mark.root
@needs_root
async def test_container_namespace_has_lo_eth0_and_a_default_route(net: Networking) -> None:
    cn = await net.create("c-basic")
    assert netns_exists(cn.netns)
    links = {link["ifname"]: link for link in json.loads(await in_container(cn, "ip", "-j", "a"))}
    assert set(links) == {"lo", "eth0"}
    assert "UP" in links["lo"]["flags"]
    assert "UP" in links["eth0"]["flags"]
    inet = [
        (a["local"], a["prefixlen"]) for a in links["eth0"]["addr_info"] if a["family"] == "inet"
    ]
    assert inet == [(cn.address, 30)]
    routes = json.loads(await in_container(cn, "ip", "-j", "route", "show", "default"))
    assert [r["gateway"] for r in routes] == [cn.host_address]
    assert ipaddress.IPv4Address(cn.address) in ipaddress.IPv4Network(TEST_POOL)
    assert host_link_exists(cn.host_ifname)


@pytest.mark.root
@needs_root
async def test_the_node_reaches_a_container_port_and_delete_removes_everything(
    net: Networking,
) -> None:
    await net.install()
    cn = await net.create("c-port")
    async with serve(cn.netns, "0.0.0.0") as port:
        target = f"{cn.address}:{port}"
        # The server tells us who connected: the host's end of this container's veth.
        assert (await probe(None, [target]))[target] == cn.host_address
    await net.delete(cn)
    assert not netns_exists(cn.netns)
    assert not host_link_exists(cn.host_ifname)
    await net.delete(cn)
    await net.delete("c-port")
    assert await net.existing() == []


@pytest.mark.root
@needs_root
async def test_each_container_gets_its_own_subnet_and_a_second_create_is_refused(
    net: Networking,
) -> None:
    a = await net.create("c-a")
    b = await net.create("c-b")
    assert not a.subnet.overlaps(b.subnet)
    assert a.host_ifname != b.host_ifname
    with pytest.raises(NetworkError) as caught:
        await net.create("c-a")
    assert caught.value.code is ErrorCode.ALREADY_EXISTS
    assert netns_exists(a.netns) and host_link_exists(a.host_ifname)
    await net.delete("c-a")
    assert not netns_exists(a.netns) and not host_link_exists(a.host_ifname)
    assert netns_exists(b.netns) and host_link_exists(b.host_ifname)


@pytest.mark.root
@needs_root
async def test_a_restarted_agent_finds_its_networks_and_allocates_around_them(
    net: Networking,
) -> None:
    a = await net.create("c-r1")
    b = await net.create("c-r2")
    restarted = Networking(table=TEST_TABLE, pool=TEST_POOL, prefix=TEST_PREFIX)
    assert {n.container_id: n for n in await restarted.existing()} == {"c-r1": a, "c-r2": b}
    c = await restarted.create("c-r3")
    assert c.subnet not in {a.subnet, b.subnet}
    await restarted.delete("c-r1")
    d = await restarted.create("c-r4")
    assert d.subnet == a.subnet  # a freed /30 is handed out again
    assert d.host_ifname == a.host_ifname
    # Deleting by a stale object removes nothing of the container that now owns its /30.
    await restarted.delete(a)
    assert host_link_exists(d.host_ifname) and netns_exists(d.netns)


@pytest.mark.root
@needs_root
async def test_sweep_removes_networks_of_gone_containers_even_half_made_ones(
    net: Networking,
) -> None:
    keep = await net.create("c-keep")
    gone = await net.create("c-gone")
    # A create that died between its steps: a namespace with no veth, and a veth with no name.
    await sh("ip", "netns", "add", f"{TEST_PREFIX}-c-half")
    orphan = host_ifname(TEST_PREFIX, ipaddress.IPv4Network("169.254.99.252/30"))
    await sh("ip", "link", "add", orphan, "type", "veth", "peer", "name", f"{TEST_PREFIX}peer")
    assert await net.sweep({"c-keep"}) == ["c-gone", "c-half"]
    assert not host_link_exists(orphan)
    assert not netns_exists(gone.netns) and not host_link_exists(gone.host_ifname)
    assert not netns_exists(f"{TEST_PREFIX}-c-half")
    assert await net.existing() == [keep]


@pytest.mark.root
@needs_root
async def test_a_failed_create_leaves_nothing_behind() -> None:
    broken = Networking(table=TEST_TABLE, pool=TEST_POOL, prefix=TEST_PREFIX, mtu=10)
    with pytest.raises(NetworkError) as caught:
        await broken.create("c-fail")
    assert caught.value.code is ErrorCode.INTERNAL
    assert "mtu" in caught.value.message
    assert not netns_exists(f"{TEST_PREFIX}-c-fail")
    assert await broken.existing() == []
    with pytest.raises(NetworkError) as caught:
        await broken.create("../escape")
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert caught.value.field == "container_id"


@pytest.mark.root
@needs_root
async def test_install_is_idempotent_and_uninstall_leaves_other_tables_alone(
    net: Networking,
) -> None:
    async with own_table("l9tdummy"):
        dummy = await sh("nft", "list", "table", "inet", "l9tdummy")
        await net.install()
        once = await sh("nft", "list", "table", "inet", TEST_TABLE)
        await net.install()
        assert await sh("nft", "list", "table", "inet", TEST_TABLE) == once
        assert forwarding() == "1"
        await net.uninstall()
        await net.uninstall()
        tables = await table_names()
        assert f"inet {TEST_TABLE}" not in tables
        assert "inet l9tdummy" in tables
        assert await sh("nft", "list", "table", "inet", "l9tdummy") == dummy


async def open_the_gate(net: Networking) -> None:
    """Forwarding on and our table gone: the state in which a probe must get through."""
    await net.install()
    await net.uninstall()


@pytest.mark.root
@needs_root
async def test_containers_cannot_reach_the_metadata_address_but_the_node_can(
    net: Networking,
) -> None:
    target = f"{METADATA_ADDRESS}:80"
    async with (
        open_test_host(
            "l9t-meta", "l9tmeta0", "198.18.1.0/30", extra=[str(METADATA_ADDRESS)]
        ) as meta,
        policy_route(
            f"{METADATA_ADDRESS}/32",
            meta.host_ifname,
            sources=[meta.host_address, TEST_POOL],
            table=TEST_ROUTE_TABLE,
            priority=TEST_RULE_PRIORITY,
        ),
    ):
        cn = await net.create("c-meta")
        await open_the_gate(net)
        # Before any packet: both the node's and the container's go to our test host only.
        route = (str(METADATA_ADDRESS),)
        assert await route_dev(*route, source=meta.host_address) == meta.host_ifname
        assert await route_dev(*route, source=cn.address, iif=cn.host_ifname) == meta.host_ifname
        async with serve(meta.netns, str(METADATA_ADDRESS), 80):
            assert (await probe(cn.netns, [target]))[target] == cn.address
            await net.install()
            assert (await probe(cn.netns, [target]))[target] is None
            seen = await probe(None, [target], source=meta.host_address)
            assert seen[target] == meta.host_address


@pytest.mark.root
@needs_root
async def test_outbound_connections_leave_with_the_node_address(net: Networking) -> None:
    async with open_test_host("l9t-out", "l9tout0", "198.18.0.0/30") as out:
        cn = await net.create("c-out")
        await open_the_gate(net)
        assert await route_dev(out.address, source=cn.address, iif=cn.host_ifname) == "l9tout0"
        async with serve(out.netns, out.address) as port:
            target = f"{out.address}:{port}"
            # Without our table the test host sees the container's own address...
            assert (await probe(cn.netns, [target]))[target] == cn.address
            await net.install()
            # ...with it, the node's address on the way out.
            assert (await probe(cn.netns, [target]))[target] == out.host_address


@pytest.mark.root
@needs_root
async def test_node_services_are_unreachable_from_containers(net: Networking) -> None:
    cn = await net.create("c-node")
    async with serve(None, "0.0.0.0") as port:
        targets = [f"{a}:{port}" for a in (cn.host_address, *await node_addresses())]
        await open_the_gate(net)
        assert await probe(cn.netns, targets) == {t: cn.address for t in targets}
        await net.install()
        assert await probe(cn.netns, targets) == {t: None for t in targets}
        assert None not in (await probe(None, targets)).values()


@pytest.mark.root
@needs_root
async def test_containers_cannot_reach_each_other(net: Networking) -> None:
    a = await net.create("c-from")
    b = await net.create("c-to")
    async with serve(b.netns, "0.0.0.0") as port:
        target = f"{b.address}:{port}"
        await open_the_gate(net)
        assert (await probe(a.netns, [target]))[target] == a.address
        await net.install()
        assert (await probe(a.netns, [target]))[target] is None
        assert (await probe(None, [target]))[target] == b.host_address
