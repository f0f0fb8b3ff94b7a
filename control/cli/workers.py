"""`levers9 worker list|get` and `levers9 machine list`."""

from __future__ import annotations

import argparse
import json
import sys

from control.cli.common import client_from_args, timed
from control.cli.output import (
    MACHINE_HEADERS,
    WORKER_HEADERS,
    card_problem_lines,
    machine_row,
    render_table,
    show_list,
    worker_row,
)
from wire.errors import unstructure


async def worker_list(args: argparse.Namespace) -> None:
    async with client_from_args(args) as client:
        result = await timed(client.workers())
    show_list(args.json, result.workers, WORKER_HEADERS, worker_row)


async def worker_get(args: argparse.Namespace) -> None:
    async with client_from_args(args) as client:
        info = await timed(client.worker(args.worker_id))
    if args.json:
        print(json.dumps(unstructure(info), indent=2))
        return
    print(
        render_table(
            ["worker", "mode", "version", "uptime"],
            [[info.worker_id, info.mode, info.version, f"{info.uptime_s:.0f}s"]],
        )
    )


async def machine_list(args: argparse.Namespace) -> None:
    async with client_from_args(args) as client:
        listing = await timed(client.machines())
    if args.json:
        print(json.dumps(unstructure(listing.machines), indent=2))
        return
    print(render_table(MACHINE_HEADERS, [machine_row(m) for m in listing.machines]))
    for m in listing.machines:
        for line in card_problem_lines(m):
            print(line)
    for pool in listing.pools:
        if pool.error:
            print(f"pool {pool.pool}: last pass failed: {pool.error}", file=sys.stderr)
    failing = [(m.pool, m.node, m.error) for m in listing.machines if m.error]
    failing += [(p.pool, s.node, s.error) for p in listing.pools for s in p.skipped if s.error]
    for pool_name, node, error in failing:
        print(f"pool {pool_name}: node {node}: last write failed: {error}", file=sys.stderr)
    for m in listing.machines:
        if m.refused:
            print(f"pool {m.pool}: node {m.node}: {m.refused}", file=sys.stderr)
