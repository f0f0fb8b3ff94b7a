"""`levers9 login` and `levers9 context list|use|delete`: a token checked with the controlplane,
kept in a private contexts file, and used by every later command with no flags.

The commands run as a user's `levers9` does (`main(argv)` in a thread) against test_cli's
stand-in controlplane over TLS; every run checks that no token reached stdout or stderr.
"""

from __future__ import annotations

import getpass
import io
import json
import os
import shlex
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from control.cli.common import TOKEN_FLAG_WARNING, token_flag_warning
from control.cli.contexts import (
    Context,
    ContextError,
    ContextsFile,
    Given,
    Target,
    config_path,
    load,
    resolve_target,
    save,
)
from control.cli.main import main, parse_args
from tests import test_cli
from tests.test_cli import TOKEN, FakeControlplane

fake = test_cli.fake
"""test_cli's stand-in controlplane on loopback (a fixture, used by name)."""

WRONG = "not-the-token-9876543210"


@attrs.frozen
class Result:
    code: int
    out: str
    err: str


@attrs.define
class Cli:
    """`levers9 ARGV` with `stdin`, in a thread; the contexts file is `path`."""

    path: Path
    monkeypatch: pytest.MonkeyPatch
    capsys: pytest.CaptureFixture[str]

    async def run(self, *argv: str, stdin: Any = "", secrets: tuple[str, ...] = ()) -> Result:
        self.monkeypatch.setattr(
            sys, "stdin", io.StringIO(stdin) if isinstance(stdin, str) else stdin
        )
        code = await trio.to_thread.run_sync(main, list(argv))
        out, err = self.capsys.readouterr()
        for secret in (TOKEN, WRONG, *secrets):
            assert secret not in out and secret not in err, f"a token in the output of {argv}"
        return Result(code, out, err)

    async def login(self, fake: FakeControlplane, *options: str, token: str = TOKEN) -> Result:
        return await self.run("login", fake.url, "--ca", fake.ca, *options, stdin=token + "\n")


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    path = tmp_path / "xdg" / "levers9" / "config"
    monkeypatch.setenv("LEVERS9_CONFIG", str(path))
    for name in ("LEVERS9_CONTROLPLANE", "LEVERS9_TOKEN", "LEVERS9_CA"):
        monkeypatch.delenv(name, raising=False)
    return Cli(path, monkeypatch, capsys)


@pytest.fixture
def tty_stdin() -> Iterator[io.TextIOWrapper]:
    """A terminal as stdin: the slave side of a pty."""
    master, slave = os.openpty()
    with open(slave, encoding="utf-8") as stream:
        yield stream
    os.close(master)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- login -----------------------------------------------------------------------------------------


async def test_login_stores_a_private_file_and_later_commands_need_no_flags(
    fake: FakeControlplane, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_chmod(*args: object, **kwargs: object) -> None:
        raise AssertionError("the contexts file is created 0600, never chmodded")

    monkeypatch.setattr(os, "chmod", no_chmod)
    monkeypatch.setattr(os, "fchmod", no_chmod)
    old_umask = os.umask(0)  # the modes come from the code, not from a strict umask
    try:
        result = await cli.login(fake)
    finally:
        os.umask(old_umask)
    assert result.code == 0, result.err
    assert f"logged in to {fake.url}: context '127.0.0.1' is current" in result.out
    assert mode(cli.path) == 0o600
    assert mode(cli.path.parent) == 0o700
    assert os.listdir(cli.path.parent) == ["config"]  # no temp file left behind
    pem = Path(fake.ca).read_text()
    assert load(cli.path) == ContextsFile(
        (Context("127.0.0.1", fake.url, TOKEN, pem),), current_context="127.0.0.1"
    )

    # The CA's text is in the context: the file it came from may go.
    Path(fake.ca).rename(fake.ca + ".moved")
    got = await cli.run("task", "get", "t-1")
    assert got.code == 0, got.err
    assert "t-1" in got.out and got.err == ""
    assert (await cli.run("task", "list")).code == 0
    assert (await cli.run("machine", "list")).code == 0
    run = await cli.run("run", "--detach", "busybox")
    assert run.code == 0 and run.out == "t-1\n"


async def test_a_refused_token_stores_nothing(fake: FakeControlplane, cli: Cli) -> None:
    refused = await cli.login(fake, token=WRONG)
    assert refused.code == 1
    assert (
        refused.err
        == f"levers9: the controlplane at {fake.url} refused this token; nothing was stored\n"
    )
    assert not cli.path.exists()

    assert (await cli.login(fake)).code == 0
    before = cli.path.read_bytes()
    assert (await cli.login(fake, "--context", "other", token=WRONG)).code == 1
    assert cli.path.read_bytes() == before


async def test_login_without_the_ca_of_a_private_controlplane_names_the_flag(
    fake: FakeControlplane, cli: Cli
) -> None:
    untrusted = await cli.run("login", fake.url, stdin=TOKEN + "\n")
    assert untrusted.code == 1
    assert untrusted.err.startswith(f"levers9: TLS with {fake.url} failed (")
    assert untrusted.err.endswith(
        "if its certificate is from a private CA, pass that CA with --ca FILE\n"
    )
    assert not cli.path.exists()


async def test_the_demos_login_lines_log_the_cli_in_without_showing_a_token(
    fake: FakeControlplane, cli: Cli, tmp_path: Path
) -> None:
    from sim.demo import sign_in_lines

    token_file = tmp_path / "demo-team-a-token"
    token_file.write_text(TOKEN + "\n")
    lines = sign_in_lines(
        fake.url, Path(fake.ca), [("workspace team-a", "demo-team-a", token_file)]
    )
    assert f"  sign in as workspace team-a: the token is in {token_file} (cat it)" in lines
    assert TOKEN not in "\n".join(lines)
    (login,) = [line.strip() for line in lines if line.strip().startswith("levers9 login ")]
    command, _, source = login.partition(" < ")
    done = await cli.run(*shlex.split(command)[1:], stdin=Path(source).read_text())
    assert done.code == 0, done.err
    assert "context 'demo-team-a' is current" in done.out


async def test_login_prompts_on_a_terminal_and_reads_a_pipe_otherwise(
    fake: FakeControlplane,
    cli: Cli,
    monkeypatch: pytest.MonkeyPatch,
    tty_stdin: io.TextIOWrapper,
) -> None:
    prompts: list[str] = []

    def prompt(text: str = "", stream: Any = None) -> str:
        prompts.append(text)
        return TOKEN

    monkeypatch.setattr(getpass, "getpass", prompt)
    typed = await cli.run("login", fake.url, "--ca", fake.ca, stdin=tty_stdin)
    assert typed.code == 0, typed.err
    assert prompts == ["API token: "]
    assert load(cli.path).get("127.0.0.1").token == TOKEN

    piped = await cli.run(
        "login", fake.url + "/", "--ca", fake.ca, "--context", "piped", stdin=f"  {TOKEN}  \nmore\n"
    )
    assert piped.code == 0, piped.err
    assert prompts == ["API token: "]  # no prompt for a pipe
    assert load(cli.path).get("piped") == Context(
        "piped", fake.url, TOKEN, Path(fake.ca).read_text()
    )

    empty = await cli.run("login", fake.url, "--ca", fake.ca, "--context", "e", stdin="\n")
    assert empty.code == 1 and empty.err.startswith("levers9: no token given")
    with_flag = await cli.run("--token", TOKEN, "login", fake.url, secrets=(TOKEN,))
    assert with_flag.code == 2 and "not --token" in with_flag.err


# -- which controlplane, token and CA a command uses -----------------------------------------------


async def test_flags_beat_the_environment_beats_the_named_then_the_current_context(
    fake: FakeControlplane, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    pem = Path(fake.ca).read_text()
    good = Context("good", fake.url, TOKEN, pem)
    bad = Context("bad", fake.url, WRONG, pem)
    save(cli.path, ContextsFile((good, bad), current_context="bad"))
    unauthenticated = "levers9: UNAUTHENTICATED: missing or wrong bearer token\n"

    assert (await cli.run("task", "get", "t-1")).err == unauthenticated  # the current context
    assert (await cli.run("--context", "good", "task", "get", "t-1")).code == 0
    monkeypatch.setenv("LEVERS9_TOKEN", TOKEN)
    assert (await cli.run("task", "get", "t-1")).code == 0  # env over the current context
    monkeypatch.setenv("LEVERS9_TOKEN", WRONG)
    assert (await cli.run("--context", "good", "task", "get", "t-1")).err == unauthenticated
    flag = await cli.run("--token", TOKEN, "--context", "bad", "task", "get", "t-1")
    assert flag.code == 0, flag.err  # the flag over env

    # A context's token goes to its own controlplane only.
    monkeypatch.delenv("LEVERS9_TOKEN")
    monkeypatch.setenv("LEVERS9_CONTROLPLANE", "https://elsewhere.invalid")
    elsewhere = await cli.run("task", "get", "t-1")
    assert elsewhere.code == 1
    assert elsewhere.err.startswith(
        "levers9: no API token for https://elsewhere.invalid: the context 'bad' is for "
    )
    unknown = await cli.run("--context", "nope", "task", "list")
    assert unknown.err == "levers9: no context 'nope'; known: good, bad\n"


FILE = ContextsFile(
    (Context("a", "https://a.example", "token-a", "PEM-A"), Context("b", "https://b", "token-b")),
    current_context="a",
)


@pytest.mark.parametrize(
    ("given", "target"),
    [
        (Given(), Target("https://a.example", "token-a", None, "PEM-A", "a")),
        (Given(context="b"), Target("https://b", "token-b", None, None, "b")),
        (Given(token="t"), Target("https://a.example", "t", None, "PEM-A", "a")),
        (Given(ca="/ca.pem"), Target("https://a.example", "token-a", "/ca.pem", None, "a")),
        (
            Given(controlplane="https://a.example/"),
            Target("https://a.example/", "token-a", None, "PEM-A", "a"),
        ),
        (Given(controlplane="https://c", token="t"), Target("https://c", "t")),
        (Given(controlplane="https://c", token="t", context="b"), Target("https://c", "t")),
    ],
)
def test_each_field_comes_from_the_first_place_that_has_it(given: Given, target: Target) -> None:
    assert resolve_target(given, lambda: FILE) == target


def test_the_environment_stands_in_for_flags_and_given_everything_the_file_is_not_read() -> None:
    environ = {"LEVERS9_CONTROLPLANE": "https://e", "LEVERS9_TOKEN": "te", "LEVERS9_CA": "/e.pem"}
    given = Given.of(controlplane=None, token=None, ca=None, context=None, environ=environ)
    assert given == Given("https://e", "te", "/e.pem")
    flags = Given.of(
        controlplane="https://f", token="tf", ca="/f.pem", context="x", environ=environ
    )
    assert flags == Given("https://f", "tf", "/f.pem", "x")

    def unreadable() -> ContextsFile:
        raise AssertionError("the contexts file was read")

    assert resolve_target(given, unreadable) == Target("https://e", "te", "/e.pem")
    with pytest.raises(ContextError, match=r"no context 'x'; known: a, b"):
        resolve_target(flags, lambda: FILE)
    with pytest.raises(ContextError, match="current context 'gone' is not in the contexts file"):
        resolve_target(Given(), lambda: attrs.evolve(FILE, current_context="gone"))


def test_the_contexts_file_lives_in_the_config_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert config_path({}) == tmp_path / ".config" / "levers9" / "config"
    assert config_path({"XDG_CONFIG_HOME": "/xdg"}) == Path("/xdg/levers9/config")
    assert config_path({"XDG_CONFIG_HOME": "rel"}) == tmp_path / ".config" / "levers9" / "config"
    assert config_path({"LEVERS9_CONFIG": "/c", "XDG_CONFIG_HOME": "/xdg"}) == Path("/c")


# -- context list|use|delete -----------------------------------------------------------------------


async def test_context_list_use_and_delete(fake: FakeControlplane, cli: Cli) -> None:
    assert (await cli.login(fake, "--context", "one")).code == 0
    assert (await cli.login(fake, "--context", "two")).code == 0

    table = (await cli.run("context", "list")).out.splitlines()
    assert table[0].split() == ["CURRENT", "NAME", "CONTROLPLANE", "CA"]
    assert [line.split() for line in table[1:]] == [
        ["one", fake.url, "stored"],
        ["*", "two", fake.url, "stored"],
    ]
    listed = await cli.run("context", "list", "--json")
    assert json.loads(listed.out) == [
        {"name": "one", "controlplane": fake.url, "current": False, "privateCa": True},
        {"name": "two", "controlplane": fake.url, "current": True, "privateCa": True},
    ]

    used = await cli.run("context", "use", "one")
    assert used.code == 0 and used.out == f"context 'one' is current ({fake.url})\n"
    assert load(cli.path).current_context == "one"
    assert mode(cli.path) == 0o600
    missing = await cli.run("context", "use", "three")
    assert (missing.code, missing.err) == (1, "levers9: no context 'three'; known: one, two\n")

    deleted = await cli.run("context", "delete", "one")
    assert deleted.code == 0 and "none is current now" in deleted.out
    assert load(cli.path) == ContextsFile(
        (Context("two", fake.url, TOKEN, Path(fake.ca).read_text()),), current_context=None
    )
    no_current = await cli.run("task", "list")
    assert no_current.code == 1 and "levers9 login URL" in no_current.err
    assert (await cli.run("context", "use", "two")).code == 0
    assert (await cli.run("task", "list")).code == 0
    assert (await cli.run("context", "delete", "two")).code == 0
    empty = await cli.run("context", "delete", "two")
    assert (
        empty.err
        == "levers9: no context 'two'; there are no contexts yet: run 'levers9 login URL'\n"
    )
    assert (await cli.run("context", "list", "--json")).out == "[]\n"


# -- the token stays out of sight ------------------------------------------------------------------


async def test_token_flag_warns_on_a_terminal_only(
    fake: FakeControlplane, cli: Cli, monkeypatch: pytest.MonkeyPatch, tty_stdin: io.TextIOWrapper
) -> None:
    argv = ("--controlplane", fake.url, "--token", TOKEN, "--ca", fake.ca, "task", "get", "t-1")
    on_tty = await cli.run(*argv, stdin=tty_stdin)
    assert on_tty.code == 0
    assert on_tty.err == f"levers9: {TOKEN_FLAG_WARNING}\n"
    assert "use `levers9 login` or LEVERS9_TOKEN" in on_tty.err
    piped = await cli.run(*argv)
    assert piped.code == 0 and piped.err == ""
    monkeypatch.setenv("LEVERS9_TOKEN", TOKEN)
    from_env = await cli.run(
        "--controlplane", fake.url, "--ca", fake.ca, "task", "get", "t-1", stdin=tty_stdin
    )
    assert from_env.code == 0 and from_env.err == ""

    # stderr on a terminal counts as well.
    args = parse_args(["--token", TOKEN, "task", "list"])
    assert token_flag_warning(args, io.StringIO(), tty_stdin) == TOKEN_FLAG_WARNING
    assert token_flag_warning(args, io.StringIO(), io.StringIO()) is None


async def test_context_show_gives_a_script_the_controlplane_and_the_token_only_when_asked(
    fake: FakeControlplane, cli: Cli
) -> None:
    assert (await cli.login(fake, "--context", "one")).code == 0
    shown = await cli.run("context", "show")
    assert shown.code == 0, shown.err
    assert json.loads(shown.out) == {
        "name": "one",
        "controlplane": fake.url,
        "ca": Path(fake.ca).read_text(),
        "current": True,
    }
    code = await trio.to_thread.run_sync(main, ["context", "show", "one", "--token"])
    out, err = cli.capsys.readouterr()
    assert code == 0 and err == ""
    assert json.loads(out)["token"] == TOKEN
    missing = await cli.run("context", "show", "two")
    assert missing.code == 1 and "no context 'two'" in missing.err


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(tmp_path: Path) -> None:
    # `levers9 context list | head -1`, with more contexts than a pipe holds.
    path = tmp_path / "config"
    names = [f"cp-{i}.example.com" for i in range(3000)]
    contexts = tuple(Context(n, f"https://{n}", TOKEN) for n in names)
    save(path, ContextsFile(contexts, current_context=names[0]))
    command = "import sys; from control.cli.main import main; sys.exit(main())"
    levers9 = subprocess.Popen(
        [sys.executable, "-c", command, "context", "list"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "LEVERS9_CONFIG": str(path)},
    )
    assert levers9.stdout is not None and levers9.stderr is not None
    assert levers9.stdout.readline().split() == [b"CURRENT", b"NAME", b"CONTROLPLANE", b"CA"]
    levers9.stdout.close()
    err = levers9.stderr.read().decode()
    assert levers9.wait(timeout=30) == 141
    assert err == ""


@pytest.mark.parametrize(
    "text",
    [
        "contexts: [{name: a, controlplane: https://a, token: SECRET-IN-FILE\n",
        "contexts:\n- name: a\n  controlplane: https://a\n  tokn: SECRET-IN-FILE\n",
        "contexts:\n- name: a\n  controlplane: [SECRET-IN-FILE]\n  token: SECRET-IN-FILE\n",
        "SECRET-IN-FILE\n",
    ],
)
async def test_a_bad_contexts_file_is_reported_without_its_content(
    fake: FakeControlplane, cli: Cli, text: str
) -> None:
    cli.path.parent.mkdir(parents=True)
    cli.path.write_text(text)
    cli.path.chmod(0o600)
    secrets = ("SECRET-IN-FILE",)
    for argv in (("task", "list"), ("context", "list")):
        bad = await cli.run(*argv, secrets=secrets)
        assert bad.code == 1
        assert bad.err.startswith(f"levers9: the contexts file {cli.path} ")
        assert bad.err.endswith("'levers9 login URL' again\n") and bad.err.count("\n") == 1
    # Given everything, a command does not need the file.
    flags = ("--controlplane", fake.url, "--token", TOKEN, "--ca", fake.ca)
    assert (await cli.run(*flags, "task", "get", "t-1", secrets=secrets)).code == 0


async def test_a_file_open_to_others_gets_a_warning_and_login_makes_it_private(
    fake: FakeControlplane, cli: Cli
) -> None:
    assert (await cli.login(fake)).code == 0
    cli.path.chmod(0o644)
    warned = await cli.run("task", "get", "t-1")
    assert warned.code == 0
    assert warned.err == (
        f"levers9: warning: the contexts file {cli.path} holds tokens but is open to others "
        f"(mode 0644); run 'chmod 600 {cli.path}'\n"
    )
    assert (await cli.login(fake, "--context", "again")).code == 0
    assert mode(cli.path) == 0o600
    assert (await cli.run("task", "get", "t-1")).err == ""
