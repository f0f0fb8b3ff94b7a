"""The controlplane's configuration: YAML shaped like the Helm values, merged, then typed.

`levers9-control serve --config FILE [--config FILE ...]` reads each file, merges later
files over earlier ones (mappings merge key by key, anything else is replaced; the private
values file holding keys is a second file), takes the `config:` block and structures it into
frozen attrs with one cattrs converter. Unknown keys and bad values are refused with the
dotted path of the field; secrets (worker tokens, API tokens) are hidden from every repr.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import yaml

from agent.models import ApiError, structure


class ConfigError(ValueError):
    """The configuration is missing, unreadable or invalid; the message names the field."""


@attrs.frozen
class TlsFiles:
    cert_file: str
    key_file: str


@attrs.frozen
class WorkerToken:
    """A worker's bearer secret (minted per worker Job by the Kubernetes provider later)."""

    worker_id: str
    token: str = attrs.field(repr=False)


@attrs.frozen
class ApiToken:
    """A token for the CLI and scripts."""

    name: str
    token: str = attrs.field(repr=False)


@attrs.frozen
class TunnelSettings:
    ping_interval_s: float = 15.0
    ping_timeout_s: float = 15.0
    handshake_timeout_s: float = 10.0


@attrs.frozen
class WorkerSettings:
    tokens: tuple[WorkerToken, ...] = ()
    pools: tuple[Mapping[str, Any], ...] = ()
    connect_timeout_s: float = 10.0


@attrs.frozen
class ControlConfig:
    public_url: str
    tls: TlsFiles
    listen: str = "0.0.0.0:8443"
    api_tokens: tuple[ApiToken, ...] = ()
    worker: WorkerSettings = WorkerSettings()
    tunnel: TunnelSettings = TunnelSettings()
    database: Mapping[str, Any] | None = None
    workspaces: tuple[Mapping[str, Any], ...] = ()

    @property
    def listen_host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]") or "0.0.0.0"

    @property
    def listen_port(self) -> int:
        return int(self.listen.rpartition(":")[2])


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; any other value in `override` replaces the base's."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_files(paths: Sequence[str | Path]) -> ControlConfig:
    if not paths:
        raise ConfigError("no --config file given; pass the values file (YAML)")
    merged: dict[str, Any] = {}
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {path} must hold a mapping with a 'config:' key")
        merged = merge(merged, data)
    return parse(merged)


def parse(values: Mapping[str, Any]) -> ControlConfig:
    """Type the `config:` block of merged values; errors name the dotted field path."""
    block = values.get("config")
    if not isinstance(block, Mapping):
        raise ConfigError("the values have no 'config:' mapping; put the settings under config:")
    try:
        config = _structure(block)
    except ApiError as exc:
        where = f"config.{exc.field}" if exc.field else "config"
        what = exc.message.split(": ", 1)[-1]
        raise ConfigError(f"{where}: {what}") from None
    _validate(config)
    return config


def _structure(block: Mapping[str, Any]) -> ControlConfig:
    return structure(dict(block), ControlConfig)


def _validate(config: ControlConfig) -> None:
    if not config.public_url.startswith("https://"):
        raise ConfigError(f"config.publicUrl must start with https://, not {config.public_url!r}")
    host, _, port = config.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"config.listen must be HOST:PORT, not {config.listen!r}")
    seen: set[str] = set()
    for i, entry in enumerate(config.worker.tokens):
        if not entry.token:
            raise ConfigError(f"config.worker.tokens[{i}].token is empty; set a secret token")
        if entry.worker_id in seen:
            raise ConfigError(
                f"config.worker.tokens[{i}].workerId {entry.worker_id!r} appears twice"
            )
        seen.add(entry.worker_id)
    for i, api in enumerate(config.api_tokens):
        if not api.token:
            raise ConfigError(f"config.apiTokens[{i}].token is empty; set a secret token")
