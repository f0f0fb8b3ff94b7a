"""Every command the operator docs show exists: a `levers9 ...` line parses with the CLI's own
parser, a `levers9-agent`/`levers9-control` line with theirs, and a `deploy/*.sh` line names
the script and only options its `--help` lists. A doc naming a subcommand or option that was
renamed or never built fails here, not in front of an operator."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from control.cli.main import parse_args
from control.cli.usage import UsageError

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
PROGRAMS = ("levers9", "levers9-agent", "levers9-control", "deploy/")


def commands(text: str) -> list[tuple[str, bool]]:
    """Commands in fenced shell blocks (continuations joined, comments dropped) and in inline
    code spans that start with one of our programs; True for the inline ones (prose may name a
    command without its required arguments)."""
    found: list[tuple[str, bool]] = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for raw in joined.splitlines():
            line = raw.split("  #")[0].strip()
            if line.startswith(PROGRAMS):
                found.append((line, False))
    for span in re.findall(r"`([^`\n]+)`", text):
        if span.startswith(PROGRAMS) and " " in span:
            found.append((span, True))
    return found


REDIRECTIONS = ("<", ">", ">>", "2>", "2>>")


def words(command: str) -> list[str]:
    # Placeholders such as <id> or <pool> stand for one word; a redirection (`< token-file`,
    # `> block.yaml`) is the shell's, not the program's, so it and its file are dropped.
    split = shlex.split(re.sub(r"<[^>]+>", "x", command.replace("~", "/home/x")))
    kept: list[str] = []
    skip = False
    for word in split:
        if skip:
            skip = False
        elif word in REDIRECTIONS:
            skip = True
        else:
            kept.append(word)
    return kept


def script_options(script: Path) -> set[str]:
    done = subprocess.run(
        ["bash", str(script), "--help"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return set(re.findall(r"--[a-z][a-z-]*", done.stdout + done.stderr))


ALL = [(doc.name, *found) for doc in DOCS for found in commands(doc.read_text())]


def test_the_docs_show_commands() -> None:
    names = {doc.name for doc in DOCS}
    assert {"gke.md", "eks.md", "kubernetes.md", "tunnel.md", "day-two.md"} <= names
    shown = {name for name, _, _ in ALL}
    assert {"gke.md", "kubernetes.md", "day-two.md"} <= shown
    assert any("cluster join" in command for _, command, inline in ALL if not inline)


@pytest.mark.parametrize(
    ("doc", "command", "inline"), ALL, ids=[f"{d}:{c[:40]}" for d, c, _ in ALL]
)
def test_a_documented_command_exists(doc: str, command: str, inline: bool) -> None:
    argv = words(command)
    program = argv[0]
    if program == "levers9":
        try:
            parse_args(argv[1:])
        except UsageError as exc:
            if not (inline and "arguments are required" in str(exc)):
                raise AssertionError(f"{doc}: `{command}` does not parse: {exc}") from None
        except SystemExit as exc:  # --version and --help print, then exit 0
            assert exc.code == 0, f"{doc}: `{command}` exits {exc.code}"
        return
    if program in ("levers9-agent", "levers9-control"):
        module = "agent.daemon.cli" if program == "levers9-agent" else "control.main"
        done = subprocess.run(
            [sys.executable, "-m", module, argv[1], "--help"],
            capture_output=True,
            text=True,
            check=False,
            cwd=REPO,
        )
        assert done.returncode == 0, f"{doc}: `{command}`: {done.stderr}"
        for option in (w for w in argv[2:] if w.startswith("--")):
            assert option in done.stdout, f"{doc}: `{command}`: no option {option}"
        return
    script = REPO / program
    assert script.is_file(), f"{doc}: `{command}` names {program}, which is not in the repository"
    if script.suffix != ".sh":
        return
    known = script_options(script)
    for word in argv[1:]:
        option = word.split("=")[0]
        if option.startswith("--") and program != "deploy/deploy.sh":  # deploy.sh passes all on
            assert option in known, f"{doc}: `{command}`: {program} has no option {option}"


@pytest.mark.parametrize(
    "command",
    [
        "levers9 cluster joinn lab --image x",
        "levers9 cluster join lab --image x --zone a",
        "deploy/attach-gke-pool.sh --project p --zone z",
        "deploy/remove-pool.sh",
        "levers9-agent self-check --verbose",
    ],
)
def test_a_command_that_does_not_exist_is_caught(command: str) -> None:
    with pytest.raises(AssertionError):
        test_a_documented_command_exists("x.md", command, False)


OUTSIDE = re.compile(r"\.\./shared|\b(?:DESIGN|STYLE|COMPONENTS|LAYOUT)\.md\b")
"""The team's own notes live beside the repository, not in it: a clone has none of them."""


def test_nothing_shipped_points_outside_the_repository() -> None:
    shipped = [REPO / "README.md", *DOCS, *(REPO / "deploy").rglob("*")]
    shipped += [*(REPO / "agent").rglob("*.py"), *(REPO / "control").rglob("*.py")]
    shipped += [*(REPO / "sim").rglob("*.py"), *(REPO / "bench").rglob("*.py")]
    pointing = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in shipped
        if path.is_file() and path.suffix not in (".png", ".tgz")
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert pointing == []
