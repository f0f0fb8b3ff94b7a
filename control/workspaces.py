"""Workspaces: who a token speaks for, which buckets (with whose credentials) it may mount, and
which registry logins its pulls use.

Every task call is scoped to the workspace of the token that made it; a task of another
workspace is NOT_FOUND, in the same words as one that does not exist. A task names buckets of
its workspace by their configured name; the stored task keeps only the bucket's URL and mount
path, and the workspace's credentials are attached again each time a container is created, so
they live in the controlplane's memory and the worker's, never in the task database.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import attrs

from control.config import WorkspaceConfig, WorkspaceLimits
from control.models import TaskVolume
from wire.errors import ApiError, ErrorCode
from workerapi.models import RegistryAuth, VolumeSpec
from workerapi.reference import parse_reference


class Workspaces:
    def __init__(
        self, configs: Sequence[WorkspaceConfig], defaults: WorkspaceLimits | None = None
    ) -> None:
        defaults = defaults or WorkspaceLimits()
        self._configs = {c.name: c for c in configs}
        self._tokens = [(t.token.encode(), c.name) for c in configs for t in c.tokens]
        self._limits = {c.name: c.limits.over(defaults) for c in configs}
        self._defaults = defaults

    def limits(self, workspace: str) -> WorkspaceLimits:
        """The limits in force for the workspace (`control.limits`)."""
        return self._limits.get(workspace, self._defaults)

    def authenticate(self, presented: str) -> str | None:
        """The workspace whose token this is, or None. Every token is compared, in constant
        time each, so timing tells nothing about which one nearly matched."""
        found = None
        given = presented.encode()
        for token, workspace in self._tokens:
            if hmac.compare_digest(token, given):
                found = workspace
        return found

    def names(self) -> list[str]:
        return sorted(self._configs)

    def volumes(self, workspace: str, asked: Sequence[TaskVolume]) -> tuple[VolumeSpec, ...]:
        """The task's volumes as they are stored: bucket URL and mount path, no credentials."""
        config = self._configs[workspace]
        buckets = {b.name: b for b in config.buckets}
        out = []
        for i, volume in enumerate(asked):
            bucket = buckets.get(volume.bucket)
            if bucket is None:
                known = ", ".join(sorted(buckets)) or "none are configured"
                raise ApiError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"field 'volumes[{i}].bucket': workspace {workspace} has no bucket "
                    f"{volume.bucket!r} (its buckets: {known})",
                    field=f"volumes[{i}].bucket",
                )
            out.append(
                VolumeSpec(
                    workspace=workspace,
                    url=bucket.url,
                    mount_path=volume.mount_path,
                    read_only=volume.read_only,
                )
            )
        return tuple(out)

    def pull_policy(self, image: str) -> str:
        """`always` for an image of a registry some workspace logs in to: a worker may hold it
        from another workspace's pull, and only the registry can say whether this workspace
        may use it (the layers stay cached; only the manifest is asked for). Public images
        start from the cache."""
        registry = parse_reference(image).registry
        private = any(
            login.host == registry for c in self._configs.values() for login in c.registries
        )
        return "always" if private else "if-not-present"

    def registry_auth(self, workspace: str, image: str) -> RegistryAuth | None:
        """The workspace's login for the registry `image` is pulled from, if it has one."""
        config = self._configs.get(workspace)
        if config is None or not config.registries:
            return None
        registry = parse_reference(image).registry
        for login in config.registries:
            if login.host == registry:
                return RegistryAuth(username=login.username, password=login.password)
        return None

    def with_credentials(self, workspace: str, volume: VolumeSpec) -> VolumeSpec:
        """The stored volume with its workspace's credentials, for one container create."""
        config = self._configs.get(workspace)
        for bucket in config.buckets if config is not None else ():
            if bucket.url == volume.url:
                return attrs.evolve(volume, s3=bucket.s3, gcs=bucket.gcs)
        raise ApiError(
            ErrorCode.FAILED_PRECONDITION,
            f"workspace {workspace} no longer has a bucket at {volume.url}; the task cannot "
            "mount it (put the bucket back in the config, or run the task without it)",
        )
