"""`levers9-agent`: the worker image's entrypoint.

`run` is the daemon (settings from the environment the worker Job sets); `self-check` prints
a table of checks (`--json` for scripts) and exits 1 when any fails.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import trio

from agent import __version__
from agent.daemon.config import ConfigError, load_config
from agent.wire.extras import missing_extra
from agent.wire.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="levers9-agent", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="serve the worker API (settings from LEVERS9_* variables)")
    check = sub.add_parser("self-check", help="check this node can run a worker")
    check.add_argument("--json", action="store_true", help="print JSON")
    args, rest = parser.parse_known_args(argv)
    missing = missing_extra("levers9-agent", "agent")
    if missing is not None:
        print(f"levers9-agent: {missing}", file=sys.stderr)
        return 2
    if args.command == "self-check":
        from agent.daemon.selfcheck import main_self_check

        return main_self_check((["--json"] if args.json else []) + rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    setup_logging(os.environ.get("LEVERS9_LOG_LEVEL", "INFO"))
    try:
        config = load_config()
    except ConfigError as exc:
        print(f"levers9-agent: {exc}", file=sys.stderr)
        return 2
    from agent.daemon.run import run_agent
    from agent.wire.allocator import tune_malloc
    from agent.wire.signals import run_until_signalled

    tune_malloc()
    trio.run(run_until_signalled, functools.partial(run_agent, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
