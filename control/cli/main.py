"""`levers9`: the operator's and user's command line, speaking the controlplane's API.

Where a command connects: `--controlplane URL`, `--token TOKEN` and `--ca FILE`, else
`LEVERS9_CONTROLPLANE`, `LEVERS9_TOKEN` and `LEVERS9_CA` (a CA file for a controlplane whose
certificate is not signed by a public CA), else the context `--context NAME` names, else the
current context, which `levers9 login URL` stores (`control.cli.contexts`), so that after a
login no command needs a flag and the token is never on a command line. Listings print a
table for people and JSON with `--json`. Errors are one line that says what to do, and exit 1
(2 for a mistyped command line).

Parsing options and formatting what people read are pure functions at the top (unit-tested
without a controlplane); the commands below them are a thin layer that makes the calls
(`control.cli.client`). `levers9 run` submits a task, then follows its logs and polls its state in
parallel, so the first line of output appears as soon as the task produces it; its exit code
is the task's. It waits `--wait` seconds for the task to start and then leaves it running
(exit 124), since a cold start (node, image pull) may take longer than anyone wants to stare
at a terminal.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from control.cli.usage import (
    CALL_TIMEOUT_S,
    DEFAULT_WAIT_S,
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    CliError,
    UsageError,
    split_command,
)
from workerapi import __version__


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one line (`levers9: ...`, exit 2), like every other error."""

    def error(self, message: str) -> Any:
        raise UsageError(f"{message}; see '{self.prog} --help'")


if TYPE_CHECKING:
    # What `add_subparsers` returns; each group of commands adds its own to it.
    _Subcommands = argparse._SubParsersAction[_Parser]


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: the connection options, then one group of commands each."""
    parser = _Parser(prog="levers9", description="levers9 command line")
    parser.add_argument("--version", action="version", version=__version__)
    # The environment and the contexts file fill in what these leave out, at the command
    # (control.cli.common.target_from_args), so a flag can be told from a variable.
    parser.add_argument(
        "--controlplane", metavar="URL", help="the controlplane (or LEVERS9_CONTROLPLANE)"
    )
    parser.add_argument(
        "--token",
        metavar="TOKEN",
        help="API token (or LEVERS9_TOKEN); 'levers9 login' keeps it off the command line",
    )
    parser.add_argument("--ca", metavar="FILE", help="the controlplane's CA (or LEVERS9_CA)")
    parser.add_argument(
        "--context",
        dest="use_context",
        metavar="NAME",
        help="a context of 'levers9 login' instead of the current one",
    )
    sub = parser.add_subparsers(dest="group", required=True, metavar="COMMAND")
    _add_login(sub)
    _add_context(sub)
    _add_run(sub)
    _add_task(sub)
    _add_exec(sub)
    _add_port(sub)
    _add_worker(sub)
    _add_machine(sub)
    _add_cluster(sub)
    return parser


def _add_login(sub: _Subcommands) -> None:
    """`levers9 login URL`."""
    login = sub.add_parser(
        "login",
        help="check a token with a controlplane and keep it in a context",
        description="Read the API token from a prompt (or stdin when it is not a terminal), "
        "check it with the controlplane at URL and store URL, CA and token as a context that "
        "becomes current, so later commands need no flags. The contexts file is "
        "$LEVERS9_CONFIG, else $XDG_CONFIG_HOME/levers9/config, else ~/.config/levers9/config.",
    )
    login.add_argument("url", metavar="URL", help="the controlplane, https://...")
    login.add_argument(
        "--ca",
        dest="login_ca",
        metavar="FILE",
        help="the controlplane's CA certificate (PEM); its text is stored, not its path",
    )
    login.add_argument(
        "--context",
        dest="login_context",
        metavar="NAME",
        help="the context's name (default: the URL's host)",
    )
    login.set_defaults(func="login:cmd_login")


def _add_context(sub: _Subcommands) -> None:
    """`levers9 context list|show|use|delete`."""
    context = sub.add_parser("context", help="the contexts 'levers9 login' stored")
    xsub = context.add_subparsers(dest="action", required=True, metavar="ACTION")
    xls = xsub.add_parser("list", help="list contexts; * marks the current one")
    xls.add_argument("--json", action="store_true")
    xls.set_defaults(func="login:context_list")
    xshow = xsub.add_parser("show", help="one context as JSON (the current one by default)")
    xshow.add_argument("name", metavar="NAME", nargs="?")
    xshow.add_argument(
        "--token", action="store_true", help="include its token (printed on stdout, for scripts)"
    )
    xshow.set_defaults(func="login:context_show")
    xuse = xsub.add_parser("use", help="make a context the current one")
    xuse.add_argument("name", metavar="NAME")
    xuse.set_defaults(func="login:context_use")
    xdel = xsub.add_parser("delete", help="forget a context and its token")
    xdel.add_argument("name", metavar="NAME")
    xdel.set_defaults(func="login:context_delete")


def _add_run(sub: _Subcommands) -> None:
    """`levers9 run IMAGE [-- CMD...]`."""
    run = sub.add_parser(
        "run",
        help="run a task: an image, with cards, and follow its output",
        usage="levers9 run [options] IMAGE [-- CMD...]",
        description="Run IMAGE as a task and follow its logs; exits with the task's exit code. "
        "CMD after '--' replaces the image's entrypoint.",
    )
    run.add_argument("image", metavar="IMAGE")
    run.add_argument("--gpus", default="0", metavar="N", help="cards the task gets")
    run.add_argument("--cpu", metavar="CORES", help="CPU cores, e.g. 0.5, 2 or 500m")
    run.add_argument("--memory", metavar="SIZE", help="memory, e.g. 512Mi, 2Gi, 2G or bytes")
    run.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="environment variable (repeatable); a bare K takes K's value from yours",
    )
    run.add_argument(
        "--volume",
        action="append",
        default=[],
        metavar="BUCKET:/PATH[:ro]",
        help="mount a bucket of your workspace (repeatable)",
    )
    run.add_argument(
        "--port", action="append", default=[], metavar="N", help="a port the task serves"
    )
    run.add_argument("--timeout", metavar="SECONDS", help="stop the task after this long")
    run.add_argument("--snapshot", metavar="DIGEST", help="start from a task's snapshot")
    run.add_argument(
        "--detach", "-d", action="store_true", help="print the task id and exit at once"
    )
    run.add_argument(
        "--wait",
        default=str(int(DEFAULT_WAIT_S)),
        metavar="SECONDS",
        help="how long to wait for the task to start before leaving it running (exit 124)",
    )
    run.set_defaults(func="tasks:cmd_run", takes_command=True)


def _add_task(sub: _Subcommands) -> None:
    """`levers9 task list|get|logs|cancel|snapshot`."""
    task = sub.add_parser("task", help="tasks of your workspace")
    tsub = task.add_subparsers(dest="action", required=True, metavar="ACTION")
    tls = tsub.add_parser("list", help="list tasks, newest first")
    tls.add_argument("--state", metavar="S,...", help="only tasks in these states")
    tls.add_argument("--limit", default="100", metavar="N")
    tls.add_argument("--before", metavar="ID", help="the next page: tasks created before this one")
    tls.add_argument("--json", action="store_true")
    tls.set_defaults(func="tasks:task_list")
    tget = tsub.add_parser("get", help="one task's details")
    tget.add_argument("task_id", metavar="ID")
    tget.add_argument("--json", action="store_true")
    tget.set_defaults(func="tasks:task_get")
    tlogs = tsub.add_parser("logs", help="a task's output")
    tlogs.add_argument("task_id", metavar="ID")
    tlogs.add_argument("-f", "--follow", action="store_true", help="until the task ends")
    tlogs.set_defaults(func="tasks:task_logs")
    tcancel = tsub.add_parser("cancel", help="stop a task")
    tcancel.add_argument("task_id", metavar="ID")
    tcancel.set_defaults(func="tasks:task_cancel")
    tsnap = tsub.add_parser("snapshot", help="keep a task's filesystem changes; prints a digest")
    tsnap.add_argument("task_id", metavar="ID")
    tsnap.set_defaults(func="tasks:task_snapshot")


def _add_exec(sub: _Subcommands) -> None:
    """`levers9 exec TASK -- CMD...`."""
    exec_ = sub.add_parser(
        "exec",
        help="run a command in a running task",
        usage="levers9 exec [-t | --no-tty] TASK -- CMD...",
    )
    exec_.add_argument("task_id", metavar="TASK")
    exec_.add_argument(
        "-t",
        "--tty",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a terminal (default: when stdin and stdout are terminals)",
    )
    exec_.set_defaults(func="exec:cmd_exec", takes_command=True)


def _add_port(sub: _Subcommands) -> None:
    """`levers9 port TASK PORT`."""
    port = sub.add_parser("port", help="forward a local port to a port of a running task")
    port.add_argument("task_id", metavar="TASK")
    port.add_argument("port", metavar="PORT")
    port.add_argument(
        "--local",
        metavar="[HOST:]PORT",
        help="where to listen (default 127.0.0.1 and the same port; 0 = any free port)",
    )
    port.set_defaults(func="port:cmd_port")


def _add_worker(sub: _Subcommands) -> None:
    """`levers9 worker list|get`."""
    worker = sub.add_parser("worker", help="workers known to the controlplane")
    wsub = worker.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = wsub.add_parser("list", help="list workers")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func="workers:worker_list")
    get = wsub.add_parser("get", help="ask one worker about itself (through its connection)")
    get.add_argument("worker_id")
    get.add_argument("--json", action="store_true")
    get.set_defaults(func="workers:worker_get")


def _add_machine(sub: _Subcommands) -> None:
    """`levers9 machine list`."""
    machine = sub.add_parser("machine", help="machines: the pools' nodes that can take work")
    msub = machine.add_subparsers(dest="action", required=True, metavar="ACTION")
    mls = msub.add_parser("list", help="list machines with their free cards, CPU and memory")
    mls.add_argument("--json", action="store_true")
    mls.set_defaults(func="workers:machine_list")


def _add_cluster(sub: _Subcommands) -> None:
    """`levers9 cluster join|list|leave`: pools joined from a kubeconfig, with an operator token."""
    cluster = sub.add_parser("cluster", help="clusters whose nodes are pools (operator token)")
    csub = cluster.add_subparsers(dest="action", required=True, metavar="ACTION")
    _add_cluster_join(csub)
    clist = csub.add_parser("list", help="list pools: configured and joined")
    clist.add_argument("--json", action="store_true")
    clist.set_defaults(func="cluster:cluster_list")
    leave = csub.add_parser(
        "leave",
        help="remove a joined pool: its workers, then its access to the cluster",
    )
    leave.add_argument("name", metavar="POOL")
    leave.add_argument("--context", help="kubeconfig context (default: the current one)")
    leave.add_argument("--kubeconfig", help="kubeconfig file")
    leave.add_argument(
        "--delete-namespace", action="store_true", help="also delete the pool's namespace"
    )
    leave.add_argument(
        "--keep-access",
        action="store_true",
        help="leave the ServiceAccount and its roles on the cluster",
    )
    leave.set_defaults(func="cluster:cluster_leave")


def _add_cluster_join(csub: _Subcommands) -> None:
    join = csub.add_parser(
        "join",
        help="attach the cluster of your kubeconfig context as a pool, with no key file",
        description="With your kubeconfig's identity: create the namespace, a ServiceAccount "
        "with least-privilege RBAC and a token on that cluster, then register the pool with "
        "the controlplane. Safe to rerun.",
    )
    join.add_argument("name", metavar="POOL", help="the pool's name (a DNS label)")
    join.add_argument("--image", required=True, help="the worker image the Jobs run")
    join.add_argument("--context", help="kubeconfig context (default: the current one)")
    join.add_argument(
        "--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)"
    )
    join.add_argument("--namespace", default="levers9", help="namespace of the worker Jobs")
    join.add_argument(
        "--selector",
        action="append",
        default=[],
        metavar="KEY=VALUE|KEY",
        help="node label the pool's nodes carry (repeatable); default: every node with cards",
    )
    join.add_argument("--flavor", choices=["gke", "eks", "generic"], default="generic")
    join.add_argument(
        "--endpoint",
        help="the API server URL the controlplane should use (default: your kubeconfig's)",
    )
    join.add_argument("--tunnel", action="store_true", help="workers dial out; nothing inbound")
    join.add_argument(
        "--host-network",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="workers use the node's network (--no-host-network needs --tunnel)",
    )
    join.add_argument("--driver-path", help="the NVIDIA driver dir on the nodes")
    join.add_argument("--json", action="store_true")
    join.set_defaults(func="cluster:cluster_join")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line → its namespace (`command`: what followed `--`); UsageError else."""
    options, command = split_command(argv)
    args = build_parser().parse_args(options)
    if command is not None and not getattr(args, "takes_command", False):
        raise UsageError("'--' and a command only follow 'levers9 run IMAGE' or 'exec TASK'")
    args.command = command
    return args


def _command(name: str) -> Any:
    """The function a command names (``module:function`` under `control.cli`), imported now:
    only the chosen command's module is loaded."""
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(f"control.cli.{module}"), function)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"levers9: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    # Imported once a command is chosen: --help and usage errors never load them.
    import trio

    from control.cli.client import ControlClientError
    from control.cli.common import token_flag_warning
    from wire.errors import ApiError
    from wire.errors import exception_leaves as _leaves

    func = _command(args.func)
    warning = token_flag_warning(args, sys.stdin, sys.stderr)
    if warning is not None:
        print(f"levers9: {warning}", file=sys.stderr)
    code = 1
    messages: list[str] = []
    try:
        code = trio.run(func, args) or 0
    except* UsageError as group:
        messages += [str(e) for e in _leaves(group)]
        code = EXIT_USAGE
    except* (CliError, ControlClientError) as group:
        messages += [str(e) for e in _leaves(group)]
    except* ApiError as group:
        messages += [
            f"{e.code.name}: {e.message}" for e in _leaves(group) if isinstance(e, ApiError)
        ]
    except* trio.TooSlowError:
        messages.append(f"DEADLINE_EXCEEDED: no answer within {CALL_TIMEOUT_S:g} s")
    except* KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except* BrokenPipeError:
        # The reader went away (`levers9 task logs ID | head`): end quietly, as git and
        # kubectl do. Python's own flush of stdout at exit would fail again, so stdout now
        # goes nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_BROKEN_PIPE
    from control.cli.output import visible

    for message in messages:
        # A server's message may quote what a workspace wrote: never raw to a terminal.
        print(f"levers9: {visible(message, lines=True)}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
