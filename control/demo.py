"""`make demo`: a controlplane and two workers on loopback, one reached directly, one through
its tunnel, each answering a request and carrying a byte stream.

Everything is real and local: the controlplane's public endpoint with a certificate made for
the demo, two `levers9-agent run` processes configured the way a worker Job configures them
(environment only) on nodes described to the stand-in NVML library (built here from C; pynvml
runs its real code path), the `levers9` CLI as a user runs it, and a TCP service on the workers'
side that the controlplane reaches through each worker's CONNECT stream. The demo stops all
it started, also when it fails.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import trio

from agent.tls import make_self_signed
from control.config import parse
from control.server import Controlplane, serve_controlplane
from nvml.standin import build_standin, nvlinked_node, standin_environ, write_node

WORKERS = {"w-direct": "direct", "w-tunnel": "tunnel"}
# Each worker's node, as the stand-in NVML library describes it (no GPU on this machine).
CARDS = {"w-direct": 4, "w-tunnel": 2}
STREAM_BYTES = 64 * 1024 * 1024


def _say(text: str) -> None:
    print(text, flush=True)


async def open_hash_service(nursery: trio.Nursery) -> int:
    """A TCP service on loopback (the workers' side) that answers the SHA-256 of everything
    it was sent; returns its port. Tests use it too."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def handle(stream: trio.SocketStream) -> None:
        digest = hashlib.sha256()
        async with stream:
            while data := await stream.receive_some(1 << 20):
                digest.update(data)
            await stream.send_all(digest.hexdigest().encode())

    await nursery.start(trio.serve_listeners, handle, listeners)
    return int(listeners[0].socket.getsockname()[1])


async def check_through_hash_service(
    stream: trio.abc.HalfCloseableStream, total_bytes: int
) -> bool:
    """Send `total_bytes` of random data to the hash service over `stream`, then compare
    the SHA-256 it answers with our own; closes the stream."""
    block = os.urandom(1 << 20)
    expected = hashlib.sha256()
    for _ in range(total_bytes // len(block)):
        await stream.send_all(block)
        expected.update(block)
    await stream.send_eof()
    answer = b""
    while data := await stream.receive_some():
        answer += data
    await stream.aclose()
    return answer.decode() == expected.hexdigest()


async def run_demo(workdir: Path) -> None:
    cert = make_self_signed("levers9-demo-controlplane", ["127.0.0.1", "localhost"])
    ca_file = workdir / "controlplane.pem"
    key_file = workdir / "controlplane-key.pem"
    ca_file.write_bytes(cert.cert_pem)
    key_file.touch(mode=0o600)
    key_file.write_bytes(cert.key_pem)
    tokens = {wid: os.urandom(16).hex() for wid in WORKERS}
    api_token = os.urandom(16).hex()
    config = parse(
        {
            "config": {
                "publicUrl": "https://127.0.0.1:0",
                "listen": "127.0.0.1:0",
                "tls": {"certFile": str(ca_file), "keyFile": str(key_file)},
                "apiTokens": [{"name": "demo", "token": api_token}],
                "worker": {"tokens": [{"workerId": k, "token": v} for k, v in tokens.items()]},
            }
        }
    )
    library = build_standin(workdir / "nvml")
    agents: list[trio.Process] = []
    async with trio.open_nursery() as nursery:
        control: Controlplane = await nursery.start(serve_controlplane, config)
        url = f"https://127.0.0.1:{control.port}"
        _say(f"controlplane   {url} (certificate made for this demo)")
        try:
            for worker_id, mode in WORKERS.items():
                env = dict(os.environ)
                node = write_node(workdir / f"{worker_id}.json", nvlinked_node(CARDS[worker_id]))
                env.update(standin_environ(library, node))
                env.update(
                    NVIDIA_VISIBLE_DEVICES="all",
                    LEVERS9_NODE_NAME=f"gpu-node-{worker_id.removeprefix('w-')}",
                )
                env.update(
                    LEVERS9_WORKER_ID=worker_id,
                    LEVERS9_WORKER_TOKEN=tokens[worker_id],
                    LEVERS9_MODE=mode,
                    LEVERS9_CONTROLPLANE_URL=url,
                    LEVERS9_CONTROLPLANE_CA=str(ca_file),
                    LEVERS9_LISTEN="127.0.0.1:0",
                    LEVERS9_ADVERTISE_HOST="127.0.0.1",
                    LEVERS9_LOG_LEVEL="WARNING",
                    LEVERS9_CONTAINERS="off",
                )
                agents.append(
                    await trio.lowlevel.open_process(
                        [sys.executable, "-m", "agent.cli", "run"], env=env
                    )
                )
                _say(f"worker         {worker_id}: levers9-agent run, {mode} mode")
            service_port = await open_hash_service(nursery)
            for worker_id, mode in WORKERS.items():
                with trio.fail_after(20):
                    client = await control.registry.client_for(worker_id)
                    health = await client.health()
                    info = await client.worker()
                _say(
                    f"\n[{mode}] GET /v1/health -> {health.status}; GET /v1/worker -> "
                    f"{info.worker_id} v{info.version} on {info.node}, up {info.uptime_s:.1f} s"
                )
                for card in info.cards:
                    _say(
                        f"[{mode}]   card {card.index} {card.model} "
                        f"{card.memory_total_bytes >> 30} GiB: {card.state}"
                    )
                started = time.perf_counter()
                with trio.fail_after(60):
                    stream = await client.connect_tcp("127.0.0.1", service_port)
                    matches = await check_through_hash_service(stream, STREAM_BYTES)
                elapsed = time.perf_counter() - started
                verdict = "matches" if matches else "DIFFERS"
                _say(
                    f"[{mode}] CONNECT 127.0.0.1:{service_port} on the worker: "
                    f"{STREAM_BYTES >> 20} MiB in {elapsed:.2f} s "
                    f"({STREAM_BYTES / elapsed / 1e6:.0f} MB/s), SHA-256 {verdict}"
                )
                if verdict != "matches":
                    raise SystemExit("the byte stream arrived changed")
            _say("\n$ levers9 worker list")
            cli_env = dict(
                os.environ,
                LEVERS9_CONTROLPLANE=url,
                LEVERS9_TOKEN=api_token,
                LEVERS9_CA=str(ca_file),
            )
            result = await trio.run_process(
                [sys.executable, "-m", "control.cli", "worker", "list"],
                env=cli_env,
                capture_stdout=True,
                check=False,
            )
            _say(result.stdout.decode().rstrip())
            if result.returncode != 0:
                raise SystemExit("levers9 worker list failed")
            _say("\ndemo finished: both workers answered and carried a byte stream")
        finally:
            with trio.CancelScope(shield=True):
                for process in agents:
                    process.terminate()
                for process in agents:
                    with trio.move_on_after(5) as scope:
                        await process.wait()
                    if scope.cancelled_caught:
                        process.kill()
                        await process.wait()
            nursery.cancel_scope.cancel()


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="levers9-demo-") as workdir:
        trio.run(run_demo, Path(workdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
