"""HTTP/2 floods against our listeners, as an attacker would send them, and what they cost.

A raw HTTP/2 peer (hyperframe frames, HPACK by `hpack`, no h2 state machine to keep it
honest) floods one kind of frame that costs the receiver work but carries nothing, and
watches for the GOAWAY. Three targets, all real and on loopback with TLS: the controlplane's
listener and a direct agent's listener (the attacker is a client), and the controlplane's end
of a tunnel (the attacker is an agent holding a worker token, so the server of the HTTP/2
connection inside the WebSocket).

For each flood: the frames sent before the GOAWAY arrived, the GOAWAY's code, how many PINGs
were answered (a PING limit must hold at its number), the process's RSS before and after, and
whether a normal request on a new connection is answered right after. The anchor of each is
the limit configured for that kind of frame: ``ratios.<target>.<kind>.sent_vs_limit`` near 1
means the limit held where it was set (frames in flight when the GOAWAY left count too).

``python -m bench.floods [--json FILE]``; the tests run the same floods (`flood`) and assert
the GOAWAY and the request served after it.
"""

from __future__ import annotations

import argparse
import ssl
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import h2.errors
import hpack
import psutil
import trio
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from agent.daemon.config import AgentConfig
from agent.daemon.register import open_controlplane_tls
from agent.daemon.run import run_agent
from agent.daemon.tunnel import upgrade_to_tunnel
from bench.report import Results, publish
from control.api.server import Controlplane
from control.cli.client import open_control_client
from sim.configs import API_TOKEN, Pki, control_config, make_pki
from sim.controlplane import run_controlplane
from sim.workers import agent_config
from wire.http2 import PREFACE, Http2Settings

KINDS = (
    "ping",
    "settings",
    "rapid-reset",
    "priority",
    "unknown-type",
    "empty-data",
    "empty-continuation",
    "window-update-connection",
    "window-update-stream",
    "data-on-closed-stream",
)
SERVER_KINDS = ("ping", "settings", "priority", "unknown-type", "window-update-connection")
"""What a peer that is the server of its connection (an agent inside its tunnel) can send."""

LIMIT_OF = {
    "ping": "max_pings_per_window",
    "settings": "max_settings_per_window",
    "rapid-reset": "max_resets_per_window",
    "priority": "max_priority_per_window",
    "unknown-type": "max_unknown_frames_per_window",
    "empty-data": "max_empty_frames_per_window",
    "empty-continuation": "max_empty_frames_per_window",
    "window-update-connection": "max_window_updates_per_window",
    "window-update-stream": "max_window_updates_per_window",
    "data-on-closed-stream": "max_frames_on_closed_streams_per_window",
}
MAX_FRAMES = 200_000
"""A flood that has not been stopped after this many frames is reported as not stopped."""
BATCH = 100
REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"https"),
    (b":authority", b"flood"),
    (b":path", b"/v1/objects"),
]


@attrs.frozen
class FloodResult:
    kind: str
    sent: int
    """Flood frames written before the GOAWAY (or the end of the connection) was seen."""
    goaway_code: int | None
    pings_answered: int


def _frames(kind: str, encoder: hpack.Encoder) -> Iterator[bytes]:
    """The flood's frames one by one; the first may carry what opens its stream."""
    if kind == "ping":
        for n in range(MAX_FRAMES):
            yield PingFrame(0, opaque_data=n.to_bytes(8, "big")).serialize()
    elif kind == "settings":
        for _ in range(MAX_FRAMES):
            yield SettingsFrame(0, settings={4: 65_535}).serialize()
    elif kind == "rapid-reset":
        for n in range(MAX_FRAMES):
            sid = 2 * n + 1
            headers = HeadersFrame(sid, data=encoder.encode(REQUEST), flags=["END_HEADERS"])
            yield headers.serialize() + RstStreamFrame(sid, error_code=8).serialize()
    elif kind == "priority":
        for n in range(MAX_FRAMES):
            yield PriorityFrame(2 * n + 1, depends_on=0, stream_weight=15).serialize()
    elif kind == "unknown-type":
        for _ in range(MAX_FRAMES):
            yield b"\x00\x00\x04\x20\x00\x00\x00\x00\x00abcd"
    elif kind in ("empty-data", "window-update-stream", "data-on-closed-stream"):
        opening = HeadersFrame(1, data=encoder.encode(REQUEST), flags=["END_HEADERS"])
        body = {
            "empty-data": DataFrame(1, data=b""),
            "window-update-stream": WindowUpdateFrame(1, window_increment=1),
            "data-on-closed-stream": DataFrame(1, data=b"x"),
        }[kind].serialize()
        if kind == "data-on-closed-stream":
            opening_bytes = opening.serialize() + RstStreamFrame(1, error_code=8).serialize()
        else:
            opening_bytes = opening.serialize()
        yield opening_bytes + body
        for _ in range(MAX_FRAMES - 1):
            yield body
    elif kind == "empty-continuation":
        block = encoder.encode(REQUEST)
        yield HeadersFrame(1, data=block[:1]).serialize() + ContinuationFrame(1).serialize()
        for _ in range(MAX_FRAMES - 1):
            yield ContinuationFrame(1).serialize()
    elif kind == "window-update-connection":
        for _ in range(MAX_FRAMES):
            yield WindowUpdateFrame(0, window_increment=1).serialize()
    else:
        raise ValueError(f"unknown flood kind {kind!r}; one of {', '.join(KINDS)}")


def _parse(buffer: bytearray) -> Iterator[Frame]:
    while len(buffer) >= 9:
        frame, length = Frame.parse_frame_header(memoryview(buffer)[:9])
        if len(buffer) < 9 + length:
            return
        frame.parse_body(memoryview(bytes(buffer[9 : 9 + length])))
        del buffer[: 9 + length]
        yield frame


async def flood(stream: trio.abc.Stream, kind: str, *, client_side: bool = True) -> FloodResult:
    """Speak raw HTTP/2 on `stream` and flood it with `kind` until a GOAWAY or the end."""
    sent = 0
    pings = 0
    goaway: int | None = None
    done = trio.Event()
    opening = (PREFACE if client_side else b"") + SettingsFrame(0).serialize()
    await stream.send_all(opening)

    async def read() -> None:
        nonlocal pings, goaway
        buffer = bytearray()
        preface = 0 if client_side else len(PREFACE)  # a client's preface comes to a server
        try:
            while data := await stream.receive_some(65_536):
                buffer += data
                if preface:
                    skipped = min(preface, len(buffer))
                    del buffer[:skipped]
                    preface -= skipped
                for frame in _parse(buffer):
                    if isinstance(frame, PingFrame) and "ACK" in frame.flags:
                        pings += 1
                    elif isinstance(frame, GoAwayFrame):
                        goaway = frame.error_code
                        done.set()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        frames = _frames(kind, hpack.Encoder())
        try:
            while not done.is_set() and sent < MAX_FRAMES:
                batch = [frame for frame, _ in zip(frames, range(BATCH), strict=False)]
                if not batch:
                    break
                await stream.send_all(b"".join(batch))
                sent += len(batch)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        with trio.move_on_after(5):
            await done.wait()
        nursery.cancel_scope.cancel()
    with trio.move_on_after(1):
        await stream.aclose()
    return FloodResult(kind, sent, goaway, pings)


def attacker_context() -> ssl.SSLContext:
    """An attacker checks no certificate."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    return context


@asynccontextmanager
async def open_tunnel_as(config: AgentConfig) -> AsyncIterator[trio.abc.Stream]:
    """The byte stream inside a tunnel opened with `config`'s worker token, to speak raw
    HTTP/2 in as the agent would (the server's side)."""
    tls = await open_controlplane_tls(config, ("http/1.1",))
    ws = await upgrade_to_tunnel(config, tls)
    try:
        yield ws
    finally:
        await trio.aclose_forcefully(ws)


def rss_mb() -> float:
    return float(psutil.Process().memory_info().rss) / 2**20


@attrs.frozen
class Targets:
    """The three places a flood is sent: two listeners and the controlplane's tunnel end."""

    control: Controlplane
    pki: Pki
    direct_port: int
    tunnel_config: AgentConfig

    @asynccontextmanager
    async def open(self, target: str) -> AsyncIterator[trio.abc.Stream]:
        """A raw byte stream to `target` (one of TARGETS), TLS done, HTTP/2 not started."""
        if target == "tunnel":
            async with open_tunnel_as(self.tunnel_config) as stream:
                yield stream
            return
        port = self.control.port if target == "controlplane" else self.direct_port
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        tls = trio.SSLStream(tcp, attacker_context(), server_hostname="127.0.0.1")
        try:
            await tls.do_handshake()
            yield tls
        finally:
            with trio.move_on_after(1):
                await tls.aclose()

    async def served(self) -> bool:
        """Whether a normal request to each listener is answered (within 5 s)."""
        with trio.move_on_after(5):
            client = await self.control.registry.client_for("w-direct")
            health = await client.health()
            url = f"https://127.0.0.1:{self.control.port}"
            async with open_control_client(url, API_TOKEN, str(self.pki.ca_file)) as control:
                await control.machines()
            return health.status == "ok"
        return False


TARGETS = {"controlplane": KINDS, "direct-agent": KINDS, "tunnel": SERVER_KINDS}


@asynccontextmanager
async def open_targets(directory: Path) -> AsyncIterator[Targets]:
    """A controlplane and a direct agent in this process; the tunnel worker's token."""
    pki = make_pki(directory)
    async with trio.open_nursery() as nursery:
        control: Controlplane = await nursery.start(run_controlplane, control_config(pki))
        nursery.start_soon(run_agent, agent_config(pki, control.port, mode="direct"))
        with trio.fail_after(30):
            await control.registry.client_for("w-direct")
        entry = control.registry.entry("w-direct")
        address = entry.address if entry is not None else None
        assert address is not None, "the direct agent registered no address"
        port = int(address.rpartition(":")[2])
        yield Targets(control, pki, port, agent_config(pki, control.port, mode="tunnel"))
        nursery.cancel_scope.cancel()


async def run_benchmark(directory: Path) -> Results:
    settings = Http2Settings()
    figures: dict[str, float] = {}
    anchors = {f"{kind}.limit": float(getattr(settings, LIMIT_OF[kind])) for kind in KINDS}
    ratios: dict[str, float] = {}
    async with open_targets(directory) as targets:
        for target, kinds in TARGETS.items():
            for kind in kinds:
                before = rss_mb()
                async with targets.open(target) as stream:
                    result = await flood(stream, kind, client_side=target != "tunnel")
                name = f"{target}.{kind}"
                figures[f"{name}.sent"] = float(result.sent)
                if kind == "ping":
                    figures[f"{name}.pings_answered"] = float(result.pings_answered)
                figures[f"{name}.rss_before_mb"] = before
                figures[f"{name}.rss_after_mb"] = rss_mb()
                figures[f"{name}.served_after"] = float(await targets.served())
                ratios[f"{name}.sent_vs_limit"] = result.sent / anchors[f"{kind}.limit"]
                code = "none" if result.goaway_code is None else error_name(result.goaway_code)
                print(f"{name}: {result.sent} frames sent, GOAWAY {code}", flush=True)
    return Results(figures=figures, anchors=anchors, ratios=ratios)


def error_name(code: int) -> str:
    try:
        return h2.errors.ErrorCodes(code).name
    except ValueError:
        return str(code)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.floods",
        description="HTTP/2 floods against the controlplane, a direct agent and a tunnel.",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="levers9-bench-floods-") as tmp:
        results = trio.run(run_benchmark, Path(tmp))
    publish(
        results,
        {"max_frames": float(MAX_FRAMES)},
        args.json,
        target="target: every flood ends in GOAWAY(ENHANCE_YOUR_CALM) near its limit",
    )


if __name__ == "__main__":
    main()
