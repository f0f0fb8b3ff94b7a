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


PREBUILT_ENV = "LEVERS9_SHIM_BINARY"
"""Names a shim built ahead of time (the worker image's, which carries no compiler)."""


def shim_path(cache_dir: Path | None = None) -> Path:
    """The path of the built shim, compiling it first if this source was not built yet, or
    the prebuilt one `LEVERS9_SHIM_BINARY` names, installed into the cache the same way.

    Blocks while gcc runs (about a second, once per source); trio callers run it in a thread.
    """
    directory = cache_dir if cache_dir is not None else default_cache_dir()
    prebuilt = os.environ.get(PREBUILT_ENV)
    if prebuilt:
        return _install_prebuilt(Path(prebuilt), directory)
    compiler = os.environ.get("CC") or shutil.which("gcc")
    if not compiler:
        raise ShimBuildError("gcc was not found: install it (make deps does, on Debian)")
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


def _install_prebuilt(binary: Path, directory: Path) -> Path:
    """Copy the prebuilt shim into the cache under the hash of its bytes (renamed into place,
    as a build is), so containers keep running from their own copy across image updates."""
    try:
        content = binary.read_bytes()
    except OSError as exc:
        raise ShimBuildError(
            f"{PREBUILT_ENV} names {binary}, which cannot be read ({exc.strerror}); point it at "
            "the shim the image built, or unset it to build one with gcc"
        ) from None
    target = directory / f"{BINARY_PREFIX}-{hashlib.sha256(content).hexdigest()[:16]}"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = directory / f".{target.name}.{os.getpid()}"
    partial.write_bytes(content)
    partial.chmod(0o755)
    os.replace(partial, target)
    return target
