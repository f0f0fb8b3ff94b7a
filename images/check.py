"""Our own rules for the worker and controlplane Dockerfiles, run by `make images-check`.

hadolint checks Dockerfile hygiene in general; this checks what only we know: bases pinned by
digest (resolving the file's global ARG defaults), no compiler in a final stage, apt-get used
the slim way, exec-form commands, no secrets in ENV/ARG, and each image's contract with the
rest of the project: the worker's ENTRYPOINT is `levers9-agent` with CMD `run` (the worker Job
sets `args: ["run"]`, which replaces CMD only) and it has a HEALTHCHECK; the controlplane runs
as a numeric non-root USER, serves on 8443 and starts `levers9-control serve`.

A file's role (`worker`, `control`) comes from its name (`worker.Dockerfile`) or `--role`.
Findings print as `FILE:LINE: RULE: message`; the exit status is 1 when there is any.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

WORKER_ENTRYPOINT = ["levers9-agent"]
WORKER_CMD = ["run"]
CONTROL_ENTRYPOINT = ["levers9-control", "serve"]
CONTROL_PORT = "8443"

_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
_VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
_COMPILERS = re.compile(r"^(gcc|g\+\+|cpp|clang|build-essential|gcc-\d+|clang-\d+)$")
_SECRET_NAME = re.compile(r"TOKEN|PASSWORD|PASSWD|SECRET|KEY", re.IGNORECASE)

_Report = Callable[[int, str, str], None]


@attrs.frozen
class Instruction:
    """One Dockerfile instruction, continuation lines joined; `line` is where it starts."""

    line: int
    keyword: str
    arguments: str


@attrs.frozen
class Finding:
    """One broken rule: where, which rule, and what to do about it."""

    path: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.message}"


def parse(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile; comments and blank lines dropped."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction is dropped by Docker too
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        joined = " ".join(part for part in pending if part)
        keyword, _, arguments = joined.partition(" ")
        instructions.append(Instruction(start, keyword.upper(), arguments.strip()))
        pending = []
    if pending:
        joined = " ".join(part for part in pending if part)
        keyword, _, arguments = joined.partition(" ")
        instructions.append(Instruction(start, keyword.upper(), arguments.strip()))
    return instructions


def exec_form(arguments: str) -> list[str] | None:
    """The argv of an exec-form (JSON array) ENTRYPOINT/CMD, or None for shell form."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    return None


def final_stage(instructions: Sequence[Instruction]) -> list[Instruction]:
    """The instructions from the last FROM on: what ends up in the image."""
    starts = [index for index, item in enumerate(instructions) if item.keyword == "FROM"]
    return list(instructions[starts[-1] :]) if starts else []


def _last(stage: Sequence[Instruction], keyword: str) -> Instruction | None:
    found = [item for item in stage if item.keyword == keyword]
    return found[-1] if found else None


def _apt_packages(command: str) -> list[str]:
    packages: list[str] = []
    for segment in re.split(r"&&|\|\||;", command):
        words = segment.split()
        if "apt-get" in words and "install" in words:
            after = words[words.index("install") + 1 :]
            packages += [word.split("=")[0] for word in after if not word.startswith("-")]
    return packages


def check(text: str, *, role: str | None = None, path: str = "Dockerfile") -> list[Finding]:
    """Every rule `text` breaks; `role` adds the worker's or the controlplane's own rules."""
    instructions = parse(text)
    findings: list[Finding] = []

    def report(line: int, rule: str, message: str) -> None:
        findings.append(Finding(path, line, rule, message))

    if not any(item.keyword == "FROM" for item in instructions):
        report(1, "no-from", "there is no FROM: start the file with a pinned base image")
        return findings
    global_args: dict[str, str] = {}
    stages: set[str] = set()
    seen_from = False
    for item in instructions:
        if item.keyword == "ARG":
            name, _, default = item.arguments.partition("=")
            if not seen_from and default:
                global_args[name.strip()] = default.strip().strip('"')
        if item.keyword == "FROM":
            seen_from = True
            words = item.arguments.split()
            words = [word for word in words if not word.startswith("--platform")]
            image = _VARIABLE.sub(lambda m: global_args.get(m.group(1), m.group(0)), words[0])
            if len(words) >= 3 and words[1].upper() == "AS":
                stages.add(words[2])
            if image in stages or image == "scratch" or _DIGEST.search(image):
                continue
            report(
                item.line,
                "pinned-base",
                f"FROM {words[0]} is not pinned by digest: write IMAGE:TAG@sha256:<64 hex>",
            )
        if item.keyword in ("ENV", "ARG"):
            for name in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", item.arguments) or [
                item.arguments.split()[0] if item.arguments else ""
            ]:
                if _SECRET_NAME.search(name):
                    report(
                        item.line,
                        "no-secret-env",
                        f"{item.keyword} {name} looks like a secret: pass it at run time "
                        "(a Kubernetes Secret), never bake it into the image",
                    )
        if item.keyword == "ADD" and re.search(r"\bhttps?://", item.arguments):
            report(
                item.line,
                "no-remote-add",
                "ADD fetches a URL unverified: download with a checksum check in a build stage",
            )
        if item.keyword in ("ENTRYPOINT", "CMD") and exec_form(item.arguments) is None:
            report(
                item.line,
                "exec-form",
                f"{item.keyword} is in shell form: write it as a JSON array so signals reach "
                "the program",
            )
        if item.keyword == "HEALTHCHECK":
            probe = item.arguments.split(None, 1)
            while probe and probe[0].startswith("--"):
                probe = probe[1].split(None, 1) if len(probe) > 1 else []
            shell_form = len(probe) < 2 or exec_form(probe[1]) is None
            if probe and probe[0].upper() == "CMD" and shell_form:
                report(
                    item.line,
                    "exec-form",
                    "HEALTHCHECK CMD is in shell form: write it as a JSON array",
                )
        if item.keyword == "RUN" and "apt-get" in item.arguments and "install" in item.arguments:
            if "--no-install-recommends" not in item.arguments:
                report(
                    item.line,
                    "apt-slim",
                    "apt-get install without --no-install-recommends: add it",
                )
            if "rm -rf /var/lib/apt/lists" not in item.arguments:
                report(
                    item.line,
                    "apt-slim",
                    "apt-get install leaves its lists behind: end the same RUN with "
                    "`rm -rf /var/lib/apt/lists/*`",
                )

    final = final_stage(instructions)
    for item in final:
        if item.keyword == "RUN":
            compilers = [p for p in _apt_packages(item.arguments) if _COMPILERS.match(p)]
            if compilers:
                report(
                    item.line,
                    "no-compiler-in-final",
                    f"the final stage installs {', '.join(compilers)}: build in an earlier "
                    "stage and COPY --from it",
                )
    if role == "worker":
        _check_worker(final, report)
    elif role == "control":
        _check_control(final, report)
    return findings


def _check_entrypoint(
    final: Sequence[Instruction], expected: list[str], report: _Report, why: str
) -> None:
    entrypoint = _last(final, "ENTRYPOINT")
    if entrypoint is None:
        line = final[0].line if final else 1
        report(line, "entrypoint", f"the final stage has no ENTRYPOINT: add {json.dumps(expected)}")
    elif exec_form(entrypoint.arguments) != expected:
        report(
            entrypoint.line,
            "entrypoint",
            f"ENTRYPOINT is {entrypoint.arguments}, not {json.dumps(expected)}: {why}",
        )


def _check_worker(final: Sequence[Instruction], report: _Report) -> None:
    _check_entrypoint(
        final,
        WORKER_ENTRYPOINT,
        report,
        'the worker Job sets args ["run"], which replaces CMD only',
    )
    cmd = _last(final, "CMD")
    if cmd is None or exec_form(cmd.arguments) != WORKER_CMD:
        report(
            cmd.line if cmd else final[0].line,
            "worker-cmd",
            f"the worker's CMD must be {json.dumps(WORKER_CMD)} so a bare `docker run` starts "
            "the agent as the Job does",
        )
    if _last(final, "HEALTHCHECK") is None:
        report(
            final[0].line,
            "healthcheck",
            'the worker has no HEALTHCHECK: add HEALTHCHECK CMD ["levers9-agent", "self-check"]',
        )


def _check_control(final: Sequence[Instruction], report: _Report) -> None:
    _check_entrypoint(
        final, CONTROL_ENTRYPOINT, report, "the controlplane's Deployment runs the image as is"
    )
    user = _last(final, "USER")
    if user is None:
        report(
            final[0].line,
            "non-root",
            "the final stage has no USER: add a numeric non-root one (USER 10001)",
        )
    else:
        name = user.arguments.split(":")[0]
        if not name.isdigit() or int(name) == 0:
            report(
                user.line,
                "non-root",
                f"USER {user.arguments} is not a numeric non-root uid: Kubernetes' runAsNonRoot "
                "can only verify a number; use one like 10001",
            )
    exposed = [
        word.split("/")[0]
        for item in final
        if item.keyword == "EXPOSE"
        for word in item.arguments.split()
    ]
    if CONTROL_PORT not in exposed:
        report(final[0].line, "expose", f"the controlplane serves on {CONTROL_PORT}: EXPOSE it")


def role_of(path: Path) -> str | None:
    """`worker` for worker.Dockerfile, `control` for control.Dockerfile, else None."""
    name = path.name.removesuffix(".Dockerfile")
    return name if name in ("worker", "control") else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="images/check.py", description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="Dockerfiles to check")
    parser.add_argument("--role", choices=("worker", "control"), help="default: from the name")
    args = parser.parse_args(argv)
    findings: list[Finding] = []
    for path in args.files:
        try:
            text = path.read_text()
        except OSError as exc:
            print(f"{path}: cannot read it ({exc.strerror}): check the path", file=sys.stderr)
            return 2
        findings += check(text, role=args.role or role_of(path), path=str(path))
    for finding in findings:
        print(finding)
    if not findings:
        print(f"images/check.py: {len(args.files)} file(s) clean")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
