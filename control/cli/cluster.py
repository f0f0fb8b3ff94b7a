"""`levers9 cluster join|list|leave`."""

from __future__ import annotations

import argparse
import json
import sys

from control.cli.common import client_from_args, timed
from control.cli.output import POOL_HEADERS, pool_row, show_list
from control.cli.parse import POOL_NAME, parse_selector
from control.cli.usage import CliError, UsageError
from wire.errors import unstructure


def _join_checks(args: argparse.Namespace) -> None:
    if not POOL_NAME.fullmatch(args.name):
        raise UsageError(
            f"pool name {args.name!r} must be a DNS label (lowercase letters, digits, '-')"
        )
    if not POOL_NAME.fullmatch(args.namespace):
        raise UsageError(f"--namespace {args.namespace!r} must be a DNS label")
    if not args.host_network and not args.tunnel:
        raise UsageError(
            "--no-host-network needs --tunnel: nothing outside the cluster can dial a pod address"
        )
    if args.endpoint is not None and not args.endpoint.startswith("https://"):
        raise UsageError(f"--endpoint must be an https:// URL, not {args.endpoint!r}")


async def cluster_join(args: argparse.Namespace) -> None:
    from control.kube.join import JoinError, open_cluster_side, pool_block

    _join_checks(args)
    selector = parse_selector(args.selector)
    async with client_from_args(args) as client:
        # The operator token and the name are checked before the cluster is touched.
        known = await timed(client.pools())
        if not known.joined_pools:
            raise CliError(
                "this controlplane keeps no joined pools: set config.joinedPools (the Helm "
                "chart does by default), or add the pool's block to config.worker.pools"
            )
        for view in known.pools:
            if view.name == args.name and view.source == "config":
                raise CliError(
                    f"pool {args.name} comes from config.worker.pools; join under another name"
                )
        try:
            async with open_cluster_side(args.kubeconfig, args.context) as side:
                joined = await side.apply(args.namespace, args.name)
        except JoinError as exc:
            raise CliError(str(exc)) from None
        for step in joined.steps:
            print(step, file=sys.stderr)
        block = pool_block(
            name=args.name,
            flavor=args.flavor,
            endpoint=args.endpoint or joined.endpoint,
            ca_pem=joined.ca_pem,
            token=joined.token,
            namespace=args.namespace,
            selector=selector,
            tunnel=args.tunnel,
            host_network=args.host_network,
            image=args.image,
            driver_path=args.driver_path,
        )
        view = await timed(client.put_pool(args.name, block))
    if args.json:
        print(json.dumps(unstructure(view), indent=2))
        return
    print(
        f"pool {view.name} joined: {view.endpoint}, namespace {view.namespace}, "
        f"selector {view.selector or '(every node with cards)'}"
        f"{', tunnel' if view.tunnel else ''}"
    )
    print("its nodes show up in 'levers9 machine list' within a reconcile (about 15 s)")


async def cluster_list(args: argparse.Namespace) -> None:
    async with client_from_args(args) as client:
        listing = await timed(client.pools())
    show_list(args.json, listing.pools, POOL_HEADERS, pool_row)


async def cluster_leave(args: argparse.Namespace) -> None:
    from control.kube.join import JoinError, open_cluster_side

    async with client_from_args(args) as client:
        known = await timed(client.pools())
        leaving = next((p for p in known.pools if p.name == args.name), None)
        if leaving is None:
            raise CliError(f"no pool {args.name}; `levers9 cluster list` shows the pools")
        others = [p for p in known.pools if p.name != args.name]
        # Other joined pools of the same cluster and namespace hold the same ServiceAccount.
        shared_with = [
            p.name
            for p in others
            if p.source == "joined"
            and p.namespace == leaving.namespace
            and p.endpoint == leaving.endpoint
        ]
        try:
            if args.delete_namespace and not args.keep_access:
                # Checked before anything is removed: a refusal changes nothing.
                sharing = [
                    f"{p.name} ({p.source})" for p in others if p.namespace == leaving.namespace
                ]
                async with open_cluster_side(args.kubeconfig, args.context) as side:
                    await side.check_namespace_removal(leaving.namespace, args.name, sharing)
            view = await timed(client.delete_pool(args.name))
            print(f"pool {view.name} left: its workers were removed", file=sys.stderr)
            if args.keep_access:
                return
            async with open_cluster_side(args.kubeconfig, args.context) as side:
                steps = await side.remove(
                    view.namespace,
                    delete_namespace=args.delete_namespace,
                    shared_with=shared_with,
                )
        except JoinError as exc:
            raise CliError(str(exc)) from None
    for step in steps:
        print(step, file=sys.stderr)
