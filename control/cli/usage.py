"""What the command line needs before any command runs: its errors, exit codes and limits.

Why this module exists: `levers9 --help`, a mistyped flag and the choice of a command happen
before any call is made, so they must not pay for importing trio, h2, attrs and the API's
models (about 0.2 s, most of the CLI's start). This module imports nothing beyond the standard
library; `control.cli.main` imports a command's own module only once the command is chosen.
"""

from __future__ import annotations

from collections.abc import Sequence

CALL_TIMEOUT_S = 30.0
DEFAULT_WAIT_S = 60.0
EXIT_USAGE = 2
EXIT_DEADLINE = 124
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE: what a shell shows for a program the closed pipe ended (git's, kubectl's)."""


class CliError(Exception):
    pass


class UsageError(CliError):
    """The command line itself is wrong (exit 2)."""


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """The options before the first `--`, and the command after it (None without `--`)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, None
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]
