"""HTTP/2 floods against the real listeners and a real tunnel, as an attacker sends them.

The floods are `bench.floods`'s (raw frames over TLS on loopback). Each must end in a GOAWAY
that says why, answer no more PINGs than the limit allows, leave memory where it was, and
leave the listener answering the next normal request at once.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import h2.errors
import pytest
import trio

from bench.floods import LIMIT_OF, TARGETS, attacker_context, flood, open_targets, rss_mb
from control.api.server import Controlplane
from sim.configs import control_config, make_pki
from sim.controlplane import run_controlplane
from wire.http2 import Http2Settings

ErrorCodes = h2.errors.ErrorCodes


@pytest.mark.parametrize("target", TARGETS)
async def test_every_flood_ends_in_goaway_and_the_listener_keeps_serving(
    tmp_path: Path, target: str
) -> None:
    settings = Http2Settings()
    async with open_targets(tmp_path) as targets:
        assert await targets.served()
        before = rss_mb()
        for kind in TARGETS[target]:
            with trio.fail_after(30):
                async with targets.open(target) as stream:
                    result = await flood(stream, kind, client_side=target != "tunnel")
            # h2's own cap on CONTINUATION frames per header block (64) may come first.
            allowed = {ErrorCodes.ENHANCE_YOUR_CALM}
            if kind == "empty-continuation":
                allowed.add(ErrorCodes.PROTOCOL_ERROR)
            assert result.goaway_code in allowed, (kind, result)
            limit = getattr(settings, LIMIT_OF[kind])
            assert result.sent > limit // 2, (kind, result)
            if kind == "ping":
                assert result.pings_answered <= limit, result
            assert await targets.served(), f"not served right after the {kind} flood"
        grown = rss_mb() - before
    print(f"{target}: RSS grew {grown:.1f} MB over {len(TARGETS[target])} floods")
    assert grown < 50, f"RSS grew {grown:.1f} MB over the floods"


async def test_the_controlplane_holds_the_limits_its_values_set(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    config = control_config(make_pki(tmp_path))
    config = attrs.evolve(config, http2=attrs.evolve(config.http2, max_pings_per_window=10))
    control: Controlplane = await nursery.start(run_controlplane, config)
    tcp = await trio.open_tcp_stream("127.0.0.1", control.port)
    tls = trio.SSLStream(tcp, attacker_context(), server_hostname="127.0.0.1")
    await tls.do_handshake()
    with trio.fail_after(30):
        result = await flood(tls, "ping")
    assert result.goaway_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert result.pings_answered <= 10
