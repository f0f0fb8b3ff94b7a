"""`levers9-control serve --config FILE [--config FILE ...]`: the controlplane process."""

from __future__ import annotations

import argparse
import functools
import os
import sys

import trio

from agent.logs import setup_logging
from agent.models import ApiError
from control.config import ConfigError, load_files


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
    from control.server import serve_controlplane

    try:
        trio.run(run_until_signalled, functools.partial(serve_controlplane, config))
    except ApiError as exc:
        print(f"levers9-control: {exc.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
