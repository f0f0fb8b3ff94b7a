"""`levers9-agent`: the worker image's entrypoint.

`run` is the daemon (settings from the environment the worker Job sets); `self-check` prints
a table of checks (`--json` for scripts) and exits 1 when any fails. Run as the program, `run`
first starts itself again without the worker token in its environment (`hide_token`).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import trio

from agent.daemon.config import (
    MAX_TOKEN_BYTES,
    TOKEN_FD_VARIABLE,
    TOKEN_VARIABLE,
    ConfigError,
    environ_for_reexec,
    load_config,
)
from proc.extras import missing_extra
from proc.logs import setup_logging
from workerapi import __version__


def hide_token() -> None:
    """Start this program again (`os.execve`: same PID, same arguments) without the worker
    token in its environment, handing it over through a pipe instead; see `agent.daemon.config`
    for why. Returns only when there is nothing to hide (no token, or already handed over)."""
    token = os.environ.get(TOKEN_VARIABLE)
    if not token or TOKEN_FD_VARIABLE in os.environ or not sys.executable:
        return
    data = os.fsencode(token)
    if len(data) > MAX_TOKEN_BYTES:
        raise ConfigError(
            TOKEN_VARIABLE, f"{TOKEN_VARIABLE} is longer than {MAX_TOKEN_BYTES} bytes"
        )
    read, write = os.pipe()  # both ends close on exec but for the one made inheritable
    try:
        os.write(write, data)  # the pipe holds it all: far below a pipe's capacity
    finally:
        os.close(write)
    os.set_inheritable(read, True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environ_for_reexec(os.environ, read))


def main(argv: list[str] | None = None) -> int:
    # Called as the program (not by a test with arguments of its own): `run` may start again.
    whole_process = argv is None
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
    if whole_process:
        try:
            hide_token()
        except ConfigError as exc:
            print(f"levers9-agent: {exc}", file=sys.stderr)
            return 2
    setup_logging(os.environ.get("LEVERS9_LOG_LEVEL", "INFO"))
    try:
        config = load_config()
    except ConfigError as exc:
        print(f"levers9-agent: {exc}", file=sys.stderr)
        return 2
    from agent.daemon.run import run_agent
    from proc.malloc import tune_malloc
    from proc.signals import run_until_signalled

    tune_malloc()
    trio.run(run_until_signalled, functools.partial(run_agent, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
