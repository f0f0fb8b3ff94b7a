"""The CLI's contexts file: which controlplane, CA and token a command uses without flags.

`levers9 login` writes it and every command reads it, so a token never has to be on the command
line (where the process list and the shell's history keep it). The file is kubectl-like YAML at
`$LEVERS9_CONFIG`, else `$XDG_CONFIG_HOME/levers9/config`, else `~/.config/levers9/config`:

    current-context: cp.example.com
    contexts:
    - name: cp.example.com
      controlplane: https://cp.example.com
      ca: |
        -----BEGIN CERTIFICATE-----
        ...
      token: ...

`ca` holds the PEM text of the CA certificate(s) itself, not the path of the file it came from,
so the context keeps working when that file moves or goes away; it is absent for a controlplane
whose certificate a public CA signed.

The design choice: the format is attrs models and one cattrs converter of its own (this file is
its own boundary, not the wire); parsing, rendering, editing and choosing what a command uses
(`resolve_target`) are pure functions, and the only I/O is `load` and `save`. `save` writes
atomically (a temp file created 0600 in the same folder, fsync, rename), so the token is never
in a file anyone else can read, not even for a moment, and a crash leaves the old file or the
new one. A file found readable by others gets a one-line warning on every command, as ssh does,
rather than a refusal: the token in it has been readable already, so refusing would stop the
user's work without protecting anything, while the warning names the fix (and the next `login`
writes the file 0600 again). No error or output of this module contains a token or any of the
file's values: a file that does not parse is reported by line and column, a bad entry by its
place and key.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import sys
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from control.cli.usage import CliError

CONFIG_ENV = "LEVERS9_CONFIG"
FILE_MODE = 0o600
DIR_MODE = 0o700
_NAME_RE = re.compile(r"\S{1,253}")
_HEADER = (
    "# levers9 contexts, written by 'levers9 login'. It holds API tokens: keep it private\n"
    "# (mode 0600); 'levers9 context list|use|delete' manage it.\n"
)


class ContextError(CliError):
    """The contexts file or a context name is wrong; the message says what to do."""


@attrs.frozen
class Context:
    """One controlplane the CLI can talk to, and the token it uses there."""

    name: str
    controlplane: str
    token: str = attrs.field(repr=False)
    ca: str | None = attrs.field(default=None, repr=False)
    """PEM text of the CA certificate(s); None trusts the system's CAs."""


@attrs.frozen
class ContextsFile:
    contexts: tuple[Context, ...] = ()
    current_context: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.contexts)

    def get(self, name: str) -> Context:
        """The context called `name`; ContextError listing the known ones else."""
        for context in self.contexts:
            if context.name == name:
                return context
        raise ContextError(f"no context {name!r}; {self._known()}")

    def current(self) -> Context | None:
        if self.current_context is None:
            return None
        for context in self.contexts:
            if context.name == self.current_context:
                return context
        raise ContextError(
            f"the current context {self.current_context!r} is not in the contexts file; "
            f"{self._known()}, or choose one with 'levers9 context use NAME'"
        )

    def with_context(self, context: Context) -> ContextsFile:
        """This file with `context` added (replacing one of the same name) and made current."""
        kept = tuple(c for c in self.contexts if c.name != context.name)
        return ContextsFile((*kept, context), context.name)

    def use(self, name: str) -> ContextsFile:
        return attrs.evolve(self, current_context=self.get(name).name)

    def without(self, name: str) -> ContextsFile:
        """This file less the context `name`; no context is current if it was."""
        self.get(name)
        current = None if self.current_context == name else self.current_context
        return ContextsFile(tuple(c for c in self.contexts if c.name != name), current)

    def _known(self) -> str:
        if not self.contexts:
            return "there are no contexts yet: run 'levers9 login URL'"
        return "known: " + ", ".join(self.names)


@attrs.frozen
class ContextSummary:
    """What `levers9 context list` shows of a context: never its token."""

    name: str
    controlplane: str
    current: bool
    private_ca: bool


def summaries(file: ContextsFile) -> tuple[ContextSummary, ...]:
    return tuple(
        ContextSummary(c.name, c.controlplane, c.name == file.current_context, c.ca is not None)
        for c in file.contexts
    )


def check_name(name: str, option: str = "--context") -> str:
    if not _NAME_RE.fullmatch(name):
        raise ContextError(
            f"{option} {name!r} is not a context name; give 1 to 253 characters without spaces"
        )
    return name


def default_name(url: str) -> str:
    """A context's name when `levers9 login` is given none: the controlplane's host."""
    return urllib.parse.urlsplit(url).hostname or url


def same_controlplane(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


# -- the file's format -----------------------------------------------------------------------------


def _make_converter() -> cattrs.Converter:
    """The file's keys are the fields' names, `current-context` kebab-cased as kubectl's is;
    unknown keys are refused so a misspelt one is named instead of silently ignored."""
    converter = cattrs.Converter(forbid_extra_keys=True)
    renames = {"current_context": "current-context"}

    def overrides(cls: type[Any]) -> dict[str, Any]:
        return {
            a.name: override(rename=renames[a.name], omit_if_default=True)
            if a.name in renames
            else override(omit_if_default=a.name == "ca")
            for a in attrs.fields(cls)
        }

    def structure_factory(cls: type[Any]) -> Callable[[Any, Any], Any]:
        return make_dict_structure_fn(
            cls,
            converter,
            _cattrs_forbid_extra_keys=True,
            **overrides(cls),
        )

    def unstructure_factory(cls: type[Any]) -> Callable[[Any], Any]:
        return make_dict_unstructure_fn(cls, converter, **overrides(cls))

    converter.register_structure_hook_factory(attrs.has, structure_factory)
    converter.register_unstructure_hook_factory(attrs.has, unstructure_factory)
    converter.register_structure_hook(str, _structure_str)
    return converter


def _structure_str(value: Any, _: Any) -> str:
    # cattrs' default would turn a mapping or a list into its repr; a string is asked for.
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError("expected a string")
    return str(value)


_CONVERTER = _make_converter()


def _dumper() -> type[Any]:
    """A YAML dumper writing multi-line strings (the CA's PEM) as literal blocks, as people
    write them."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        return dumper.represent_scalar(
            "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None
        )

    Dumper.add_representer(str, represent_str)
    return Dumper


def parse(text: str, where: str) -> ContextsFile:
    """The contexts file's text → its model. Errors name `where` and the place, never a value
    (the file holds tokens)."""
    import yaml  # here, not at the top: a command whose target comes from flags never reads YAML

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ContextError(
            f"the contexts file {where} is not valid YAML{at}; fix it, or delete it and run "
            "'levers9 login URL' again"
        ) from None
    if data is None:
        return ContextsFile()
    if not isinstance(data, Mapping):
        raise ContextError(
            f"the contexts file {where} is not a mapping with 'contexts' and 'current-context'; "
            "fix it, or delete it and run 'levers9 login URL' again"
        )
    try:
        file = _CONVERTER.structure(data, ContextsFile)
    except Exception as exc:
        raise ContextError(
            f"the contexts file {where} has {_problems(exc)}; fix it, or delete it and run "
            "'levers9 login URL' again"
        ) from None
    names = file.names
    for name in names:
        if names.count(name) > 1:
            raise ContextError(f"the contexts file {where} has two contexts named {name!r}")
    return file


def _problems(exc: Exception) -> str:
    """cattrs' account of what is wrong, by place; messages that might quote a value are
    reduced to their place."""
    found = []
    for problem in cattrs.transform_error(exc, path="file"):
        what, _, place = problem.partition(" @ ")
        if what.startswith("unknown error"):
            what = "an invalid value"
        place = place.removeprefix("file").lstrip(".")
        place = place.replace("current_context", "current-context")
        found.append(f"{what} at {place}" if place else what)
    if not found:
        return "an invalid shape"
    return "; ".join(found[:3]) + (f" (and {len(found) - 3} more)" if len(found) > 3 else "")


def render(file: ContextsFile) -> str:
    data = _CONVERTER.unstructure(file)
    ordered = {"current-context": data.pop("current-context", None), **data}
    import yaml

    text: str = yaml.dump(ordered, Dumper=_dumper(), sort_keys=False, default_flow_style=False)
    return _HEADER + text


# -- where it lives, reading and writing -----------------------------------------------------------


def config_path(environ: Mapping[str, str]) -> Path:
    """`$LEVERS9_CONFIG`, else `$XDG_CONFIG_HOME/levers9/config` (an absolute one; the XDG
    spec says to ignore a relative one), else `~/.config/levers9/config`."""
    if environ.get(CONFIG_ENV):
        return Path(environ[CONFIG_ENV])
    xdg = environ.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".config"
    return base / "levers9" / "config"


def _warn(message: str) -> None:
    print(f"levers9: {message}", file=sys.stderr)


def load(path: Path, *, warn: Callable[[str], None] = _warn) -> ContextsFile:
    """The contexts file at `path` (no contexts when there is none). A file that others can
    read or write gets one line through `warn`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return ContextsFile()
    except OSError as exc:
        raise ContextError(
            f"cannot read the contexts file {path}: {exc.strerror}; set {CONFIG_ENV} to "
            "another file or fix its permissions"
        ) from None
    with os.fdopen(fd, "rb") as stream:
        mode = stat.S_IMODE(os.fstat(stream.fileno()).st_mode)
        try:
            data = stream.read()
        except OSError as exc:
            raise ContextError(f"cannot read the contexts file {path}: {exc.strerror}") from None
    if mode & 0o077:
        warn(
            f"warning: the contexts file {path} holds tokens but is open to others "
            f"(mode {mode:04o}); run 'chmod 600 {path}'"
        )
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise ContextError(
            f"the contexts file {path} is not UTF-8 text; fix or delete it"
        ) from None
    return parse(text, str(path))


def save(path: Path, file: ContextsFile) -> None:
    """Write `file` to `path` atomically: a temp file created 0600 (never loosened, never
    chmodded after the token is in it) in the same folder, fsync, rename over `path`, fsync
    of the folder. A folder that does not exist is created 0700."""
    folder = path.parent
    try:
        folder.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    except OSError as exc:
        raise ContextError(
            f"cannot create the folder {folder} for the contexts file: {exc.strerror}"
        ) from None
    temp = folder / f".{path.name}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(temp, flags, FILE_MODE)
    except OSError as exc:
        raise ContextError(f"cannot write the contexts file in {folder}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(render(file).encode())
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temp, path)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise ContextError(f"cannot write the contexts file {path}: {exc.strerror}") from None
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: Path) -> None:
    # The rename is durable once the folder is; a filesystem that cannot fsync a folder
    # still has the file.
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- what a command uses ---------------------------------------------------------------------------


@attrs.frozen
class Given:
    """What the command line and the environment say; None (or empty) where they say nothing."""

    controlplane: str | None = None
    token: str | None = attrs.field(default=None, repr=False)
    ca: str | None = None
    context: str | None = None
    """`--context NAME`."""

    @classmethod
    def of(
        cls,
        *,
        controlplane: str | None,
        token: str | None,
        ca: str | None,
        context: str | None,
        environ: Mapping[str, str],
    ) -> Given:
        """Flags first, then `LEVERS9_CONTROLPLANE`, `LEVERS9_TOKEN`, `LEVERS9_CA`."""
        return cls(
            controlplane=controlplane or environ.get("LEVERS9_CONTROLPLANE") or None,
            token=token or environ.get("LEVERS9_TOKEN") or None,
            ca=ca or environ.get("LEVERS9_CA") or None,
            context=context or None,
        )


@attrs.frozen
class Target:
    """Where a command connects, with what: the URL, the token, a CA file or PEM text."""

    controlplane: str
    token: str = attrs.field(repr=False)
    ca_file: str | None = None
    ca_pem: str | None = attrs.field(default=None, repr=False)
    context: str | None = None
    """The context it came from, if any."""


def resolve_target(given: Given, load_file: Callable[[], ContextsFile]) -> Target:
    """Flags > environment variables > `--context NAME` > the current context, field by field.

    A context's token and CA go only to that context's own controlplane: when a flag or the
    environment names another URL, the context gives nothing, so a token never reaches a
    controlplane it was not issued by. The file is read only when something is missing (or
    `--context` is given), so commands given everything work as they did before contexts,
    whatever state the file is in."""
    url, token = given.controlplane, given.token
    if url and token and given.context is None:
        return Target(url, token, given.ca)
    file = load_file()
    context = file.get(given.context) if given.context is not None else file.current()
    if context is None:
        return Target(url or "", token or "", given.ca)
    if url and not same_controlplane(url, context.controlplane):
        if token:
            return Target(url, token, given.ca)
        raise ContextError(
            f"no API token for {url}: the context {context.name!r} is for "
            f"{context.controlplane}; pass --token or set LEVERS9_TOKEN, or run "
            f"'levers9 login {url}'"
        )
    return Target(
        url or context.controlplane,
        token or context.token,
        given.ca,
        None if given.ca else context.ca,
        context.name,
    )
