"""The container shim binary: built from `levers9-shim.c` beside this file, on demand, with gcc.

Why build at run time: the shim must be a small native program (it outlives the agent and sits
between runc and every container), and the agent ships as Python source. The binary is cached in
a directory keyed by the hash of what it was built from, so a changed source gets a new binary
while shims started from an older one keep running from theirs; a build is renamed into place
atomically, so two agents building at once never run half a file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("levers9-shim.c")
BINARY_PREFIX = "levers9-shim"

_CFLAGS = ("-O2", "-Wall", "-Wextra", "-std=gnu11")


class ShimBuildError(Exception):
    """The shim could not be built; the message says what to install or fix."""


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/levers9`, else `~/.cache/levers9`: not a shared temp dir, since root
    runs what is built there."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "levers9"


def shim_path(cache_dir: Path | None = None) -> Path:
    """The path of the built shim, compiling it first if this source was not built yet.

    Blocks while gcc runs (about a second, once per source); trio callers run it in a thread.
    """
    compiler = os.environ.get("CC") or shutil.which("gcc")
    if not compiler:
        raise ShimBuildError("gcc was not found: install it (make deps does, on Debian)")
    directory = cache_dir if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update("\0".join((compiler, *_CFLAGS)).encode())
    target = directory / f"{BINARY_PREFIX}-{digest.hexdigest()[:16]}"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = directory / f".{target.name}.{os.getpid()}"
    result = subprocess.run(
        [compiler, *_CFLAGS, "-o", str(partial), str(SOURCE)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise ShimBuildError(f"gcc could not build the container shim:\n{result.stderr}")
    os.replace(partial, target)
    return target
