"""`levers9`: the operator's and user's command line, speaking the controlplane's API.

Global options `--controlplane URL` and `--token TOKEN` (or `LEVERS9_CONTROLPLANE`,
`LEVERS9_TOKEN`; `LEVERS9_CA` names a CA file for a controlplane whose certificate is not
signed by a public CA). Listings print a table for people and JSON with `--json`. Errors are
one line that says what to do, and exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

import trio

from agent import __version__, models
from agent.client import ApiClient, open_api_client
from agent.models import ApiError, WorkerInfo
from agent.tls import TLSStream, verifying_client_context
from control.server import WorkerList

CALL_TIMEOUT_S = 30.0


class CliError(Exception):
    pass


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


async def _call(args: argparse.Namespace, method: str, path: str, cls: type[Any]) -> Any:
    url = urllib.parse.urlsplit(args.controlplane)
    if url.scheme != "https" or not url.hostname:
        raise CliError(
            f"--controlplane must be an https:// URL, not {args.controlplane!r}"
            " (or set LEVERS9_CONTROLPLANE)"
        )
    if not args.token:
        raise CliError("no API token: pass --token or set LEVERS9_TOKEN")
    context = verifying_client_context(cafile=args.ca, alpn=("h2",))
    with trio.fail_after(CALL_TIMEOUT_S):
        try:
            tcp = await trio.open_tcp_stream(url.hostname, url.port or 443)
        except OSError as exc:
            raise CliError(
                f"cannot reach the controlplane at {args.controlplane}: {exc.strerror or exc}"
            ) from None
        tls = TLSStream(tcp, context, server_side=False, server_hostname=url.hostname)
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError as exc:
            raise CliError(
                f"TLS with {args.controlplane} failed ({exc.__cause__ or exc}); "
                "pass its CA with LEVERS9_CA if it is private"
            ) from None
        async with open_api_client(
            tls, ApiClient, token=args.token, authority=url.netloc
        ) as client:
            return await client.call(method, path, response_type=cls)


def _age(since: float | None) -> str:
    if since is None:
        return "-"
    seconds = int(time.time() - since)
    return f"{seconds // 60}m{seconds % 60}s" if seconds >= 60 else f"{seconds}s"


async def worker_list(args: argparse.Namespace) -> None:
    result: WorkerList = await _call(args, "GET", "/v1/workers", WorkerList)
    if args.json:
        print(json.dumps(models.unstructure(result)["workers"], indent=2))
        return
    rows = [
        [
            w.worker_id,
            w.mode,
            "yes" if w.connected else "no",
            w.node or "-",
            str(w.cards),
            w.address or "-",
            w.version or "-",
            _age(w.registered_at),
        ]
        for w in result.workers
    ]
    print(
        _table(["worker", "mode", "connected", "node", "cards", "address", "version", "age"], rows)
    )


async def worker_get(args: argparse.Namespace) -> None:
    info: WorkerInfo = await _call(
        args, "GET", f"/v1/workers/{urllib.parse.quote(args.worker_id)}", WorkerInfo
    )
    if args.json:
        print(json.dumps(models.unstructure(info), indent=2))
        return
    print(
        _table(
            ["worker", "mode", "version", "uptime"],
            [[info.worker_id, info.mode, info.version, f"{info.uptime_s:.0f}s"]],
        )
    )


def _gib(value: int) -> str:
    return f"{value / (1 << 30):.1f}Gi"


async def machine_list(args: argparse.Namespace) -> None:
    listing = await _call(args, "GET", "/v1/machines", dict)
    machines = listing.get("machines", [])
    if args.json:
        print(json.dumps(machines, indent=2))
        return
    rows = []
    for m in machines:
        cards = m["cards"]
        worker = m.get("worker")
        rows.append(
            [
                m["pool"],
                m["node"],
                m.get("gpuModel") or "-",
                f"{cards['total']}/{cards['ours']}/{cards['others']}/{cards['free']}",
                f"{m['cpuFreeMillis']}m",
                _gib(m["memoryFreeBytes"]),
                worker["state"] if worker else "-",
                f"{int(worker['ageSeconds'])}s" if worker else "-",
            ]
        )
    print(
        _table(
            [
                "POOL",
                "NODE",
                "GPU",
                "CARDS T/OURS/OTHERS/FREE",
                "CPU FREE",
                "MEM FREE",
                "WORKER",
                "AGE",
            ],
            rows,
        )
    )
    for pool in listing.get("pools", []):
        if pool.get("error"):
            print(f"pool {pool['pool']}: last pass failed: {pool['error']}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="levers9", description="levers9 command line")
    parser.add_argument("--version", action="version", version=__version__)
    parser.add_argument("--controlplane", default=os.environ.get("LEVERS9_CONTROLPLANE", ""))
    parser.add_argument("--token", default=os.environ.get("LEVERS9_TOKEN", ""))
    parser.add_argument("--ca", default=os.environ.get("LEVERS9_CA") or None)
    sub = parser.add_subparsers(dest="group", required=True)
    worker = sub.add_parser("worker", help="workers known to the controlplane")
    wsub = worker.add_subparsers(dest="action", required=True)
    ls = wsub.add_parser("list", help="list workers")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=worker_list)
    get = wsub.add_parser("get", help="ask one worker about itself (through its connection)")
    get.add_argument("worker_id")
    get.add_argument("--json", action="store_true")
    get.set_defaults(func=worker_get)
    machine = sub.add_parser("machine", help="machines: the pools' nodes that can take work")
    msub = machine.add_subparsers(dest="action", required=True)
    mls = msub.add_parser("list", help="list machines with their free cards, CPU and memory")
    mls.add_argument("--json", action="store_true")
    mls.set_defaults(func=machine_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        trio.run(args.func, args)
    except CliError as exc:
        print(f"levers9: {exc}", file=sys.stderr)
        return 1
    except ApiError as exc:
        print(f"levers9: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    except trio.TooSlowError:
        print(f"levers9: DEADLINE_EXCEEDED: no answer within {CALL_TIMEOUT_S:g} s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
