"""`levers9-control serve --config FILE [--config FILE ...]`: the controlplane process."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys

import trio

from agent.logs import setup_logging
from agent.models import ApiError
from control.config import ConfigError, ControlConfig, load_files

log = logging.getLogger("levers9.control")


async def serve_and_reload(paths: list[str], config: ControlConfig) -> None:
    """Serve; on SIGHUP read the values files again and apply their pools (a removed pool's
    workers are deleted). Other settings take effect at the next start."""
    from control.pools import load_pools
    from control.server import serve_controlplane

    async with trio.open_nursery() as nursery:
        control = await nursery.start(serve_controlplane, config)
        with trio.open_signal_receiver(signal.SIGHUP) as hangups:
            async for _ in hangups:
                try:
                    pools = load_pools(load_files(paths).worker.pools).pools
                except ConfigError as exc:
                    log.error("reload refused, the running pools stay: %s", exc)
                    continue
                await control.set_pools(pools)
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
    setup_logging(os.environ.get("LEVERS9_LOG_LEVEL", "INFO"))
    try:
        config = load_files(args.config)
    except ConfigError as exc:
        print(f"levers9-control: {exc}", file=sys.stderr)
        return 2
    from agent.signals import run_until_signalled

    try:
        trio.run(run_until_signalled, functools.partial(serve_and_reload, args.config, config))
    except ApiError as exc:
        print(f"levers9-control: {exc.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
