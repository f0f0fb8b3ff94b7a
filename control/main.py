"""`levers9-control serve --config FILE [--config FILE ...]`: the controlplane process."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys

import trio

from control.config import ConfigError, ControlConfig, load_files
from proc.extras import missing_extra
from proc.logs import setup_logging
from wire.errors import ApiError

log = logging.getLogger("levers9.control")


async def serve_and_reload(paths: list[str], config: ControlConfig) -> None:
    """Serve; on SIGHUP read the values files again and apply their pools (a removed pool's
    workers are deleted; other settings take effect at the next start); on SIGTERM or SIGINT
    drain (`Controlplane.drain`, for `config.drainS`), then stop."""
    from control.api.server import open_controlplane
    from control.kube.pools import load_pools
    from wire.admission import raise_open_files_limit

    raise_open_files_limit(config.connections.max_total)
    async with open_controlplane(config) as control:
        with trio.open_signal_receiver(signal.SIGHUP, signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if signum != signal.SIGHUP:
                    # Stopped (the pod is being replaced): drain, then leaving the block
                    # cancels the rest.
                    await control.drain(config.drain_s)
                    return
                try:
                    worker = load_files(paths).worker
                    pools = load_pools(worker.pools, worker.pool_credentials).pools
                except ConfigError as exc:
                    log.error("reload refused, the running pools stay: %s", exc)
                    continue
                await control.runner.set_config_pools(pools)
                log.info("reloaded: %d pool(s)", len(pools))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="levers9-control")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the controlplane")
    serve.add_argument(
        "--config",
        action="append",
        required=True,
        metavar="FILE",
        help="values file (YAML); later files merge over earlier ones",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    missing = missing_extra("levers9-control", "control")
    if missing is not None:
        print(f"levers9-control: {missing}", file=sys.stderr)
        return 2
    setup_logging(os.environ.get("LEVERS9_LOG_LEVEL", "INFO"))
    from control.kube.joined import own_cluster
    from control.kube.pools import load_pools

    try:
        config = load_files(args.config)
        # Everything the config names is checked before anything starts.
        load_pools(config.worker.pools, config.worker.pool_credentials)
        if config.joined_pools is not None:
            own_cluster(config.joined_pools)
    except ConfigError as exc:
        print(f"levers9-control: {exc}", file=sys.stderr)
        return 2
    from proc.malloc import tune_malloc
    from proc.signals import run_until_signalled
    from wire.errors import exception_leaves as _leaves

    tune_malloc()
    messages: list[str] = []
    try:
        trio.run(run_until_signalled, functools.partial(serve_and_reload, args.config, config))
    except* ApiError as group:
        messages += [e.message for e in _leaves(group) if isinstance(e, ApiError)]
    except* ConfigError as group:
        messages += [str(e) for e in _leaves(group)]
    for message in messages:
        print(f"levers9-control: {message}", file=sys.stderr)
    return 2 if messages else 0


if __name__ == "__main__":
    sys.exit(main())
