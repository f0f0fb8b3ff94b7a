"""`levers9 worker list|get` and `levers9 machine list`."""

from __future__ import annotations

import argparse
import json
import sys

from agent.wire.errors import unstructure
from control.cli.common import _client, _timed
from control.cli.output import WORKER_HEADERS, _gib, _table, show_list, worker_row


async def worker_list(args: argparse.Namespace) -> None:
    async with _client(args) as client:
        result = await _timed(client.workers())
    show_list(args.json, result.workers, WORKER_HEADERS, worker_row)


async def worker_get(args: argparse.Namespace) -> None:
    async with _client(args) as client:
        info = await _timed(client.worker(args.worker_id))
    if args.json:
        print(json.dumps(unstructure(info), indent=2))
        return
    print(
        _table(
            ["worker", "mode", "version", "uptime"],
            [[info.worker_id, info.mode, info.version, f"{info.uptime_s:.0f}s"]],
        )
    )


async def machine_list(args: argparse.Namespace) -> None:
    async with _client(args) as client:
        listing = await _timed(client.machines())
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
