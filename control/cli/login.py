"""`levers9 login URL` and `levers9 context list|use|delete`: the contexts file's commands.

`login` reads the token where no other process can see it (a prompt without echo on a
terminal, else one line of stdin, so `pass show cp | levers9 login URL` works), checks it with
one authenticated call that both operator and workspace tokens may make (`GET /v1/machines`),
and only then stores it, so a mistyped token is never saved. The file's format and rules live
in `control.cli.contexts`; this module is the thin layer of commands over it.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from control.cli.client import open_control_client
from control.cli.common import timed
from control.cli.contexts import (
    Context,
    ContextsFile,
    ContextSummary,
    check_name,
    config_path,
    default_name,
    load,
    save,
    summaries,
)
from control.cli.output import isatty, show_list
from control.cli.usage import CliError, UsageError
from wire.errors import ApiError, ErrorCode

CONTEXT_HEADERS = ("current", "name", "controlplane", "ca")


def read_token(stdin: Any) -> str:
    """The token: from a prompt without echo when stdin is a terminal, else stdin's first
    line. Read before any task runs, so blocking here holds nothing up, and Ctrl-C leaves
    getpass to put the terminal's echo back."""
    if isatty(stdin):
        token = getpass.getpass("API token: ", stream=sys.stderr)
    else:
        token = stdin.readline()
    token = token.strip()
    if not token:
        raise CliError(
            "no token given: type it at the prompt, or give it on stdin "
            "(e.g. 'levers9 login URL < token-file')"
        )
    return token


def _read_ca(path: str) -> str:
    try:
        with open(path, encoding="ascii") as stream:
            pem = stream.read()
    except OSError as exc:
        raise CliError(
            f"cannot read the CA file {path!r} (--ca or LEVERS9_CA): {exc.strerror}; give a PEM "
            "file with the controlplane's CA certificate"
        ) from None
    except UnicodeDecodeError:
        raise CliError(f"the CA file {path!r} is not PEM text; give a PEM file") from None
    if "-----BEGIN CERTIFICATE-----" not in pem:
        raise CliError(f"the CA file {path!r} holds no PEM certificate; give a PEM file")
    return pem


def _login_url(text: str) -> str:
    url = text.strip().rstrip("/")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "https" or not parsed.hostname:
        raise UsageError(f"URL {text!r} is not an https:// URL; give the controlplane's URL")
    return url


async def cmd_login(args: argparse.Namespace) -> None:
    if args.token:
        raise UsageError(
            "login reads the token from a prompt or stdin, not --token; leave --token out"
        )
    url = _login_url(args.url)
    name = check_name(args.login_context or default_name(url))
    ca_file = args.login_ca or args.ca or os.environ.get("LEVERS9_CA") or None
    ca_pem = _read_ca(ca_file) if ca_file else None
    path = config_path(os.environ)
    file = load(path)  # a broken file is reported before the user types a token
    token = read_token(sys.stdin)
    refused: ApiError | None = None
    async with open_control_client(url, token, None, ca_pem=ca_pem) as client:
        try:
            await timed(client.machines())
        except ApiError as exc:
            if exc.code not in (ErrorCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED):
                raise
            refused = exc
    if refused is not None and refused.code is ErrorCode.UNAUTHENTICATED:
        raise CliError(f"the controlplane at {url} refused this token; nothing was stored")
    if refused is not None:
        raise CliError(
            f"the controlplane at {url} does not take this token for the CLI "
            f"({refused.message}); nothing was stored"
        )
    save(path, file.with_context(Context(name, url, token, ca_pem)))
    print(f"logged in to {url}: context {name!r} is current (saved in {path})")


def _file() -> tuple[ContextsFile, Path]:
    path = config_path(os.environ)
    return load(path), path


async def context_list(args: argparse.Namespace) -> None:
    file, _ = _file()

    def row(summary: ContextSummary) -> list[str]:
        return [
            "*" if summary.current else "",
            summary.name,
            summary.controlplane,
            "stored" if summary.private_ca else "system",
        ]

    show_list(args.json, summaries(file), CONTEXT_HEADERS, row)


async def context_show(args: argparse.Namespace) -> None:
    """One context as JSON, for scripts (`deploy/check-pool.sh`): its controlplane and CA,
    and its token only when asked for with --token (it then goes to stdout, as `kubectl config
    view --raw` does; never to stderr or a log)."""
    file, _ = _file()
    if args.name is not None:
        context = file.get(args.name)
    else:
        found = file.current()
        if found is None:
            raise CliError("no context is current: log in with 'levers9 login URL --ca FILE'")
        context = found
    shown: dict[str, object] = {
        "name": context.name,
        "controlplane": context.controlplane,
        "ca": context.ca,
        "current": context.name == file.current_context,
    }
    if args.token:
        shown["token"] = context.token
    print(json.dumps(shown, indent=2))


async def context_use(args: argparse.Namespace) -> None:
    file, path = _file()
    changed = file.use(args.name)
    save(path, changed)
    print(f"context {args.name!r} is current ({changed.get(args.name).controlplane})")


async def context_delete(args: argparse.Namespace) -> None:
    file, path = _file()
    changed = file.without(args.name)
    save(path, changed)
    if file.current_context == args.name and changed.contexts:
        print(
            f"deleted context {args.name!r}; none is current now: choose one with "
            "'levers9 context use NAME'"
        )
    else:
        print(f"deleted context {args.name!r}")
