"""Pools registered over the API by `levers9 cluster join`, kept where their token is safe.

A joined pool's block carries a ServiceAccount token, and secrets never reach the
controlplane's own disk; so each joined pool is one Kubernetes Secret in the controlplane's
own namespace (`config.joinedPools`), read back at start-up. The block is checked with the
same `load_pools` as a configured one before it is written, so a bad block is refused at the
API with the field named, never stored.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Mapping
from typing import Any, Protocol

import yaml

from control.config import ConfigError, JoinedPoolsSettings
from control.kube.adapter import KubeAlreadyExists, KubeNotFound
from control.kube.pools import PoolConfig, load_pools, own_cluster_pool
from wire.errors import ApiError, ErrorCode

__all__ = ["JoinedPoolStore", "SecretApi", "own_cluster", "pool_of_secret", "secret_of_pool"]

log = logging.getLogger("levers9.joined")

POOL_LABEL = "levers9.dev/joined-pool"
BLOCK_KEY = "pool.yaml"


class SecretApi(Protocol):
    """What the store needs from the controlplane's own cluster (`KubeClient` has it)."""

    async def list_secrets(self, namespace: str, label_selector: str) -> list[dict[str, Any]]: ...

    async def create_secret(
        self, namespace: str, manifest: Mapping[str, Any]
    ) -> dict[str, Any]: ...

    async def replace_secret(self, namespace: str, manifest: Mapping[str, Any]) -> None: ...

    async def delete_secret(self, namespace: str, name: str) -> None: ...


def own_cluster(settings: JoinedPoolsSettings) -> tuple[PoolConfig, str]:
    """How to reach the controlplane's own cluster (its pod's ServiceAccount), and the
    namespace the joined pools are kept in."""
    where = "config.joinedPools"
    return own_cluster_pool(
        "joined-pools", settings.namespace, where, connection_field=f"{where}.inCluster"
    )


def secret_name(pool: str) -> str:
    return f"levers9-pool-{pool}"


def secret_of_pool(name: str, block: Mapping[str, Any]) -> dict[str, Any]:
    """The Secret that keeps one joined pool's block (token included)."""
    text = yaml.safe_dump(dict(block), sort_keys=True)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": secret_name(name),
            "labels": {POOL_LABEL: name, "app.kubernetes.io/managed-by": "levers9"},
        },
        "data": {BLOCK_KEY: base64.b64encode(text.encode()).decode()},
    }


def pool_of_secret(secret: Mapping[str, Any]) -> dict[str, Any] | None:
    """The block a Secret keeps, or None when it is not one of ours or unreadable."""
    encoded = (secret.get("data") or {}).get(BLOCK_KEY)
    if not isinstance(encoded, str):
        return None
    try:
        block = yaml.safe_load(base64.b64decode(encoded))
    except (ValueError, yaml.YAMLError):
        return None
    return block if isinstance(block, dict) else None


class JoinedPoolStore:
    """The joined pools' blocks, in memory and in their Secrets."""

    def __init__(self, api: SecretApi, namespace: str) -> None:
        self._api = api
        self.namespace = namespace
        self.blocks: dict[str, dict[str, Any]] = {}

    async def load(self) -> list[PoolConfig]:
        """Read every kept block; one that no longer loads is logged and left out."""
        secrets = await self._api.list_secrets(self.namespace, POOL_LABEL)
        blocks: dict[str, dict[str, Any]] = {}
        for secret in secrets:
            name = str((secret.get("metadata") or {}).get("labels", {}).get(POOL_LABEL, ""))
            block = pool_of_secret(secret)
            if not name or block is None or block.get("name") != name:
                log.warning(
                    "joined pool secret %s is unreadable; left out",
                    secret_name(name),
                    extra={"pool": name, "secret": secret_name(name)},
                )
                continue
            try:
                load_pools([block])
            except ConfigError as exc:
                log.warning(
                    "joined pool %s no longer loads, left out: %s",
                    name,
                    exc,
                    extra={"pool": name, "secret": secret_name(name)},
                )
                continue
            blocks[name] = block
        self.blocks = blocks
        return self.pools()

    def pools(self) -> list[PoolConfig]:
        return list(load_pools(list(self.blocks.values())).pools) if self.blocks else []

    async def put(self, block: Mapping[str, Any]) -> PoolConfig:
        """Check and keep a block (create or replace its Secret); returns the typed pool."""
        try:
            (pool,) = load_pools([block]).pools
        except ConfigError as exc:
            raise ApiError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
        manifest = secret_of_pool(pool.name, block)
        try:
            await self._api.create_secret(self.namespace, manifest)
        except KubeAlreadyExists:
            await self._api.replace_secret(self.namespace, manifest)
        self.blocks[pool.name] = dict(block)
        return pool

    async def remove(self, name: str) -> None:
        try:
            await self._api.delete_secret(self.namespace, secret_name(name))
        except KubeNotFound:
            pass
        self.blocks.pop(name, None)
