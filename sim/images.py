"""Builds the worker and controlplane images from their Dockerfiles without a Docker engine.

What a node runs is `images/worker.Dockerfile`'s image, so the images are built and run here
the way a cluster would get them, not trusted to CI's Docker: buildah builds each Dockerfile (no
daemon, `--isolation chroot`), skopeo pushes it to a registry, and `sim.kubelet` pulls and runs
it with runc. `python -m sim.images` (= `make images`) is the command.

The Dockerfiles' release base (`python:3.11-slim-bookworm`, pinned by digest) lives on Docker
Hub, which CI and this project's machines cannot reach. `base="debian"` builds the same base from
Debian's own packages with mmdebstrap (Debian 12 with its python3.11, the base's certificates,
netbase and tzdata, and python3-venv for the Dockerfiles' virtual environment) and passes it as
`--build-arg PYTHON_BASE`; `base="release"` builds on the pinned one. The Debian base is tagged
with a hash of its recipe, so it is made once per package list and reused after. pip inside the
build trusts the CA bundle this machine's pip trusts (an egress proxy's, say), given as the build
secret `build-ca`: mounted for the pip step only, it leaves nothing in any layer (a bind mount
of `buildah bud --volume` left an empty /etc/pip.conf behind as its mount point).

Design: what to run is decided by pure functions (`base_recipe`, `build_argv`, `push_argv`,
`image_report`) and one thin runner executes each argv, so a failing step names the command and
its output.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

REPO = Path(__file__).resolve().parents[1]
SUITE = "bookworm"
BASE_PACKAGES = ("ca-certificates", "netbase", "tzdata", "python3", "python3-venv")
"""What python:3.11-slim-bookworm adds to debian:bookworm-slim (certificates, netbase, tzdata,
a python3.11 with venv and pip), from Debian's packages."""
BASE_REPOSITORY = "localhost/levers9-base"
IMAGES = {"worker": "images/worker.Dockerfile", "control": "images/control.Dockerfile"}
"""Image name -> its Dockerfile, relative to the repository (the build context)."""
LOCAL_REPOSITORY = "localhost/levers9"
BUILD_CA_SECRET = "build-ca"
"""The build secret the Dockerfiles' pip step trusts as its CA bundle when it is given."""
# Documentation, manual pages and translations are what debian:bookworm-slim leaves out too.
_SLIM_EXCLUDES = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
)


class ImageBuildError(Exception):
    """A build step failed; the message names the command, what it said and what to do."""


@attrs.frozen
class BaseRecipe:
    """The Debian base: `suite` with `packages` on the minbase variant; `tag` names it by a hash
    of all of it, so a changed list makes a new base."""

    suite: str = SUITE
    packages: tuple[str, ...] = BASE_PACKAGES

    @property
    def tag(self) -> str:
        recipe = json.dumps([self.suite, sorted(self.packages), _SLIM_EXCLUDES])
        digest = hashlib.sha256(recipe.encode()).hexdigest()[:12]
        return f"{BASE_REPOSITORY}:{self.suite}-{digest}"

    def mmdebstrap_argv(self, target: Path) -> list[str]:
        return [
            "mmdebstrap",
            "--variant=minbase",
            "--quiet",
            f"--include={','.join(self.packages)}",
            *(f"--dpkgopt={option}" for option in _SLIM_EXCLUDES),
            self.suite,
            str(target),
        ]


@attrs.frozen
class LayerInfo:
    digest: str
    size_bytes: int


@attrs.frozen
class ImageReport:
    """What `make images` prints for one image."""

    name: str
    reference: str
    size_bytes: int
    layers: tuple[LayerInfo, ...]
    build_s: float

    def lines(self) -> list[str]:
        head = (
            f"{self.name}: {self.reference}  {self.size_bytes / 1e6:.1f} MB in "
            f"{len(self.layers)} layers (uncompressed), built in {self.build_s:.0f} s"
        )
        return [head] + [
            f"  {layer.digest[:19]}  {layer.size_bytes / 1e6:8.1f} MB" for layer in self.layers
        ]


def local_reference(name: str, tag: str = "latest") -> str:
    return f"{LOCAL_REPOSITORY}/{name}:{tag}"


def build_argv(
    name: str,
    base: str | None,
    reference: str,
    *,
    ca_bundle: Path | None = None,
    context: Path = REPO,
) -> list[str]:
    """`buildah bud` of image `name`'s Dockerfile; `base` None keeps the file's pinned base.

    `ca_bundle` goes in as the build secret `BUILD_CA_SECRET`, which the Dockerfiles' pip step
    mounts (`RUN --mount=type=secret`) and no layer keeps."""
    argv = ["buildah", "bud", "--isolation", "chroot", "--layers", "--quiet"]
    if base is not None:
        argv += ["--build-arg", f"PYTHON_BASE={base}"]
    if ca_bundle is not None:
        argv += ["--secret", f"id={BUILD_CA_SECRET},src={ca_bundle}"]
    return [*argv, "-f", str(context / IMAGES[name]), "-t", reference, str(context)]


def build_ca_bundle(environ: Mapping[str, str]) -> Path | None:
    """The CA bundle this machine's own pip trusts (PIP_CERT, else SSL_CERT_FILE), if any."""
    for name in ("PIP_CERT", "SSL_CERT_FILE"):
        value = environ.get(name)
        if value and Path(value).is_file():
            return Path(value)
    return None


def push_argv(reference: str, destination: str, *, tls_verify: bool) -> list[str]:
    """skopeo copy of a locally built image to `destination` (`HOST/REPO:TAG`)."""
    return [
        "skopeo",
        "copy",
        "--quiet",
        f"--dest-tls-verify={str(tls_verify).lower()}",
        f"containers-storage:{reference}",
        f"docker://{destination}",
    ]


def image_report(name: str, reference: str, manifest: Any, build_s: float) -> ImageReport:
    """The report of an image from its OCI/Docker manifest (as `skopeo inspect --raw` gives
    it): the compressed layers as a registry stores and a node pulls them."""
    layers = tuple(
        LayerInfo(str(layer["digest"]), int(layer["size"])) for layer in manifest["layers"]
    )
    size = sum(layer.size_bytes for layer in layers) + int(manifest["config"]["size"])
    return ImageReport(name, reference, size, layers, build_s)


Runner = Callable[[Sequence[str]], str]


def run(argv: Sequence[str]) -> str:
    """Runs one step; its stdout, or ImageBuildError with the tail of what it said."""
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        said = (result.stderr or result.stdout)[-3000:]
        raise ImageBuildError(
            f"{' '.join(argv[:3])} ... failed (exit {result.returncode}):\n{said}\n"
            "run `make deps` as root if a tool is missing; buildah, mmdebstrap and skopeo are "
            "Debian packages"
        )
    return result.stdout


def has_image(reference: str, runner: Runner = run) -> bool:
    try:
        runner(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", reference])
    except ImageBuildError:
        return False
    return True


def ensure_base(recipe: BaseRecipe = BaseRecipe(), runner: Runner = run) -> str:
    """The Debian base's reference, built with mmdebstrap and imported into buildah's storage
    unless an image of the same recipe is there already."""
    if has_image(recipe.tag, runner):
        return recipe.tag
    with tempfile.TemporaryDirectory(prefix="levers9-base-") as scratch:
        tarball = Path(scratch) / "rootfs.tar"
        runner(recipe.mmdebstrap_argv(tarball))
        container = runner(["buildah", "from", "--quiet", "scratch"]).strip()
        try:
            mountpoint = runner(["buildah", "mount", container]).strip()
            runner(["tar", "-C", mountpoint, "--numeric-owner", "-xpf", str(tarball)])
            runner(["buildah", "umount", container])
            runner(
                [
                    "buildah",
                    "config",
                    "--env",
                    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "--env",
                    "LANG=C.UTF-8",
                    "--cmd",
                    "python3",
                    container,
                ]
            )
            runner(["buildah", "commit", "--quiet", "--rm", container, recipe.tag])
        except BaseException:
            subprocess.run(["buildah", "rm", container], capture_output=True, check=False)
            raise
    return recipe.tag


def build(
    name: str,
    base: str | None,
    runner: Runner = run,
    tag: str = "latest",
    ca_bundle: Path | None = None,
) -> ImageReport:
    """Builds image `name` (`worker`, `control`) on `base` and reports it; pip inside the
    build trusts `ca_bundle` when given."""
    reference = local_reference(name, tag)
    started = time.monotonic()
    runner(build_argv(name, base, reference, ca_bundle=ca_bundle))
    build_s = time.monotonic() - started
    raw = runner(["skopeo", "inspect", "--raw", f"containers-storage:{reference}"])
    return image_report(name, reference, json.loads(raw), build_s)


def push(reference: str, destination: str, *, tls_verify: bool, runner: Runner = run) -> None:
    runner(push_argv(reference, destination, tls_verify=tls_verify))


def build_all(
    base: str,
    runner: Runner = run,
    tag: str = "latest",
    ca_bundle: Path | None = None,
) -> list[ImageReport]:
    """Both images; `base` is `debian` (the base made here), `release` (the pinned one) or an
    image reference. `ca_bundle`: see `build`; by default the one this machine's pip trusts."""
    if ca_bundle is None:
        ca_bundle = build_ca_bundle(os.environ)
    if base == "debian":
        reference: str | None = ensure_base(runner=runner)
    elif base == "release":
        reference = None
    else:
        reference = base
    return [build(name, reference, runner, tag, ca_bundle) for name in IMAGES]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sim images", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--base",
        default="debian",
        help="debian (made here with mmdebstrap, the default), release (the Dockerfiles' "
        "pinned base) or an image reference",
    )
    parser.add_argument(
        "--push",
        metavar="HOST",
        help="push both images to the registry at HOST (e.g. registry.example:5000) as "
        "levers9/NAME; by default they go to a docker-registry started on loopback for the "
        "push, which checks that they can be pushed and pulled",
    )
    parser.add_argument("--tag", default="latest")
    parser.add_argument(
        "--insecure", action="store_true", help="push to --push HOST over plain HTTP"
    )
    args = parser.parse_args(argv)
    try:
        reports = build_all(args.base, tag=args.tag)
        for report in reports:
            print("\n".join(report.lines()))
        if args.push:
            push_all(reports, args.push, args.tag, tls_verify=not args.insecure)
        else:
            from sim.registry import running_registry

            with (
                tempfile.TemporaryDirectory(prefix="levers9-registry-") as scratch,
                running_registry(Path(scratch)) as registry,
            ):
                push_all(reports, registry.host, args.tag, tls_verify=False)
    except ImageBuildError as exc:
        print(f"python -m sim.images: {exc}", file=sys.stderr)
        return 1
    return 0


def push_all(reports: Sequence[ImageReport], host: str, tag: str, *, tls_verify: bool) -> None:
    """Pushes each image to `host` as levers9/NAME:`tag`, and reads its manifest back."""
    for report in reports:
        destination = f"{host}/levers9/{report.name}:{tag}"
        push(report.reference, destination, tls_verify=tls_verify)
        raw = run(
            [
                "skopeo",
                "inspect",
                "--raw",
                f"--tls-verify={str(tls_verify).lower()}",
                f"docker://{destination}",
            ]
        )
        pushed = image_report(report.name, destination, json.loads(raw), report.build_s)
        print(
            f"pushed {destination}: {pushed.size_bytes / 1e6:.1f} MB compressed in "
            f"{len(pushed.layers)} layers"
        )


if __name__ == "__main__":
    sys.exit(main())
