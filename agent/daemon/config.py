"""The agent's settings, read once from the environment the worker Job sets.

`levers9-agent run` takes no flags: the controlplane's Job spec is the one place its settings
come from, as environment variables (the worker token from a Secret). They are parsed here
into frozen attrs, with an error naming the variable and what to do; the token is removed
from the process environment as soon as it is read, so no child process inherits it, and it
is hidden from every repr.

Removing a variable from `os.environ` does not remove it from the environment the kernel
shows in `/proc/PID/environ` (the block the process was started with), which anyone allowed
to read that file would see for the agent's whole life. So `levers9-agent run` starts itself
again at once (`environ_for_reexec`, `os.execve`, same PID) with the token out of the
environment, handed over instead through a pipe whose descriptor number is in
`LEVERS9_WORKER_TOKEN_FD`; `load_config` reads the pipe to its end and closes it. A pipe keeps
nothing once read, so no file or descriptor holds the token afterwards.

`load_config` is the one parser: `levers9-agent self-check` reads the settings through it too
(on a copy of the environment), so it refuses exactly what `run` refuses. A `ConfigError`
carries the variable's name; `SettingMissing` (a required variable is unset) is its own type,
so callers tell "not the worker's environment" from "a wrong value" without reading messages.
"""

from __future__ import annotations

import ipaddress
import os
import re
import urllib.parse
from collections.abc import Mapping, MutableMapping
from pathlib import Path

import attrs

from agent.gpus.health import DEFAULT_FAULT_XIDS
from agent.runtime.config import ContainerConfig
from wire.admission import DEFAULT_IDLE_TIMEOUT_S, ConnectionLimits
from wire.connection import KeepaliveConfig
from wire.http2 import Http2Settings

ENV_PREFIX = "LEVERS9_"


class ConfigError(ValueError):
    """A setting `levers9-agent run` refuses; the message names the variable and what is wrong.

    `variable` is the full name (``LEVERS9_...``), for callers that report it on their own
    (the self-check); the message never contains the worker token.
    """

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(message)
        self.variable = variable


class SettingMissing(ConfigError):
    """A variable `run` needs is not set: the process does not have the worker's environment."""


@attrs.frozen
class TunnelConfig:
    """How the agent keeps its one outbound tunnel."""

    max_age_s: float = 3600.0
    drain_s: float = 30.0
    handshake_timeout_s: float = 10.0
    backoff_initial_s: float = 0.5
    backoff_cap_s: float = 30.0
    backoff_stable_s: float = 60.0


@attrs.frozen
class HealthConfig:
    """How the agent watches its claimed cards while it runs (agent/daemon/health.py)."""

    fault_xids: frozenset[int] = DEFAULT_FAULT_XIDS
    """LEVERS9_GPU_FAULT_XIDS: the critical XIDs that quarantine a card."""
    policy: str = "fail"
    """LEVERS9_GPU_FAULT_POLICY: `fail` stops the container on a quarantined card and fails it
    with the reason; `mark` lets it run, with an event saying what happened."""
    poll_s: float = 2.0
    """LEVERS9_GPU_HEALTH_POLL_S: how often each card's health and processes are read."""


FAULT_POLICIES = ("fail", "mark")


def load_health_config(env: Mapping[str, str]) -> HealthConfig:
    name = ENV_PREFIX + "GPU_FAULT_XIDS"
    raw = env.get(name)
    xids = DEFAULT_FAULT_XIDS
    if raw:
        try:
            xids = frozenset(int(part) for part in raw.split(",") if part.strip())
        except ValueError:
            raise ConfigError(
                name, f"{name} must be a comma-separated list of XID numbers, not {raw!r}"
            ) from None
        if not xids or any(x <= 0 for x in xids):
            raise ConfigError(
                name, f"{name} must list positive XID numbers (e.g. 48,79,94), not {raw!r}"
            )
    policy_name = ENV_PREFIX + "GPU_FAULT_POLICY"
    policy = (env.get(policy_name) or "fail").strip().lower()
    if policy not in FAULT_POLICIES:
        raise ConfigError(
            policy_name,
            f"{policy_name} must be 'fail' or 'mark', not {env.get(policy_name)!r}",
        )
    return HealthConfig(
        fault_xids=xids, policy=policy, poll_s=_number(env, "GPU_HEALTH_POLL_S", 2.0)
    )


@attrs.frozen
class MetricsConfig:
    """The agent's `/metrics` listener for Prometheus (plain HTTP; `agent.daemon.metrics`)."""

    port: int
    """LEVERS9_METRICS_PORT; 0 (only in tests) picks a free one."""
    host: str = "127.0.0.1"
    """LEVERS9_METRICS_HOST: loopback unless the scrape comes from elsewhere."""
    read_timeout_s: float = 10.0
    """A scrape's time to send its request, and again to take the answer."""
    sample_wait_s: float = 5.0
    """How long a scrape waits for fresh card readings before it reports the last ones."""
    bind_retry_s: float = 5.0
    """How often to try the port again while another process holds it."""


@attrs.frozen
class AgentConfig:
    worker_id: str
    token: str = attrs.field(repr=False)
    mode: str
    controlplane_url: str
    controlplane_ca_file: str | None = None
    listen_host: str = "0.0.0.0"
    listen_port: int = 7443
    advertise_host: str | None = None
    node: str | None = None
    register_interval_s: float = 30.0
    handshake_timeout_s: float = 10.0
    connections: ConnectionLimits = attrs.field(
        default=attrs.Factory(
            lambda self: ConnectionLimits(handshake_timeout_s=self.handshake_timeout_s),
            takes_self=True,
        )
    )
    """The direct listener's limits; its TLS handshake timeout is `handshake_timeout_s`'s unless
    given (LEVERS9_MAX_CONNECTIONS_PER_SOURCE, LEVERS9_MAX_CONNECTIONS,
    LEVERS9_FIRST_REQUEST_TIMEOUT_S, LEVERS9_CONNECTION_IDLE_TIMEOUT_S)."""
    keepalive: KeepaliveConfig = KeepaliveConfig()
    http2: Http2Settings = Http2Settings()
    tunnel: TunnelConfig = TunnelConfig()
    containers: ContainerConfig | None = None
    """None: this agent runs no containers (LEVERS9_CONTAINERS=off)."""
    idle_s: float | None = None
    """With containers: end cleanly after this long without one (LEVERS9_IDLE_S)."""
    loopback_connect: bool = False
    """Plain CONNECT to the worker's loopback addresses (LEVERS9_LOOPBACK_CONNECT=on); off,
    only containers' declared ports: with hostNetwork the loopback is the node's."""
    metrics: MetricsConfig | None = None
    """The `/metrics` listener; None (LEVERS9_METRICS_PORT unset, the default): none."""
    health: HealthConfig = HealthConfig()
    """The watch over the claimed cards while the worker runs."""

    @property
    def controlplane_host(self) -> str:
        return urllib.parse.urlsplit(self.controlplane_url).hostname or ""

    @property
    def controlplane_port(self) -> int:
        return urllib.parse.urlsplit(self.controlplane_url).port or 443


def _get(env: Mapping[str, str], name: str, default: str | None = None) -> str:
    value = env.get(ENV_PREFIX + name, default)
    if value is None or value == "":
        raise SettingMissing(
            ENV_PREFIX + name,
            f"{ENV_PREFIX}{name} is not set; the worker Job sets it (see images/worker.Dockerfile"
            " and the controlplane's Job template)",
        )
    return value


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(ENV_PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(
            ENV_PREFIX + name, f"{ENV_PREFIX}{name} must be a number of seconds, not {raw!r}"
        ) from None
    if value <= 0:
        raise ConfigError(
            ENV_PREFIX + name, f"{ENV_PREFIX}{name} must be greater than 0, not {raw!r}"
        )
    return value


def _whole(env: Mapping[str, str], name: str, default: int, *, minimum: int, unit: str) -> int:
    """A whole number of `unit` (" of bytes", or "") from the environment, at least `minimum`."""
    raw = env.get(ENV_PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(
            ENV_PREFIX + name, f"{ENV_PREFIX}{name} must be a whole number{unit}, not {raw!r}"
        ) from None
    if value < minimum:
        raise ConfigError(
            ENV_PREFIX + name, f"{ENV_PREFIX}{name} must be {minimum} or more, not {raw!r}"
        )
    return value


def _bytes(env: Mapping[str, str], name: str, default: int) -> int:
    return _whole(env, name, default, minimum=0, unit=" of bytes")


def _on_off(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(ENV_PREFIX + name) or ("on" if default else "off")
    if raw.lower() not in ("on", "off"):
        raise ConfigError(
            ENV_PREFIX + name, f"{ENV_PREFIX}{name} must be 'on' or 'off', not {raw!r}"
        )
    return raw.lower() == "on"


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    return _whole(env, name, default, minimum=1, unit="")


def load_connection_limits(env: Mapping[str, str]) -> ConnectionLimits:
    """The direct listener's limits (wire.admission has why the defaults are what they
    are)."""
    default = ConnectionLimits()
    return ConnectionLimits(
        max_per_source=_count(env, "MAX_CONNECTIONS_PER_SOURCE", default.max_per_source),
        max_total=_count(env, "MAX_CONNECTIONS", default.max_total),
        first_request_timeout_s=_number(
            env, "FIRST_REQUEST_TIMEOUT_S", default.first_request_timeout_s
        ),
        idle_timeout_s=_number(env, "CONNECTION_IDLE_TIMEOUT_S", DEFAULT_IDLE_TIMEOUT_S),
    )


def _existing_file(env: Mapping[str, str], name: str) -> str | None:
    path = env.get(ENV_PREFIX + name) or None
    if path is not None and not os.path.isfile(path):
        raise ConfigError(
            ENV_PREFIX + name, f"{ENV_PREFIX}{name} names {path!r}, which is not a file"
        )
    return path


def _is_https_url(url: str) -> bool:
    """An https:// URL with a host, and a port the agent can dial if it names one."""
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 -- raises ValueError on a port that is not 0 to 65535
    except ValueError:
        return False
    return parts.scheme == "https" and bool(parts.hostname)


_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def _is_host(text: str) -> bool:
    """An IP address or a DNS name a listener can be bound to."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return len(text) <= 253 and _HOSTNAME.fullmatch(text) is not None
    return True


def load_metrics_config(env: Mapping[str, str]) -> MetricsConfig | None:
    """The `/metrics` listener: on when LEVERS9_METRICS_PORT is set, on LEVERS9_METRICS_HOST
    (loopback by default)."""
    raw_port = env.get(ENV_PREFIX + "METRICS_PORT") or ""
    host = env.get(ENV_PREFIX + "METRICS_HOST") or ""
    if not raw_port:
        if host:
            raise ConfigError(
                ENV_PREFIX + "METRICS_HOST",
                f"{ENV_PREFIX}METRICS_HOST is set but {ENV_PREFIX}METRICS_PORT is not; set the "
                "port to serve /metrics, or unset the host",
            )
        return None
    if not re.fullmatch(r"[0-9]{1,5}", raw_port) or not 1 <= int(raw_port) <= 65535:
        raise ConfigError(
            ENV_PREFIX + "METRICS_PORT",
            f"{ENV_PREFIX}METRICS_PORT must be a TCP port, 1 to 65535, not {raw_port!r}; unset "
            "it to serve no /metrics",
        )
    host = host.strip("[]") or MetricsConfig(port=0).host
    if not _is_host(host):
        raise ConfigError(
            ENV_PREFIX + "METRICS_HOST",
            f"{ENV_PREFIX}METRICS_HOST must be an IP address or a host name to listen on (e.g. "
            f"127.0.0.1 or 0.0.0.0), not {host!r}",
        )
    return MetricsConfig(port=int(raw_port), host=host)


def load_container_config(env: Mapping[str, str]) -> ContainerConfig | None:
    switch = env.get(ENV_PREFIX + "CONTAINERS", "on").lower()
    if switch not in ("on", "off"):
        raise ConfigError(
            ENV_PREFIX + "CONTAINERS",
            f"{ENV_PREFIX}CONTAINERS must be 'on' or 'off', not {switch!r}",
        )
    if switch == "off":
        return None
    state_dir = env.get(ENV_PREFIX + "STATE_DIR") or "/var/lib/levers9"
    if not os.path.isabs(state_dir):
        raise ConfigError(
            ENV_PREFIX + "STATE_DIR",
            f"{ENV_PREFIX}STATE_DIR must be an absolute path, not {state_dir!r}",
        )
    ca_file = env.get(ENV_PREFIX + "REGISTRY_CA") or None
    if ca_file is not None and not os.path.isfile(ca_file):
        raise ConfigError(
            ENV_PREFIX + "REGISTRY_CA",
            f"{ENV_PREFIX}REGISTRY_CA names {ca_file!r}, which is not a file",
        )
    insecure = tuple(
        part.strip()
        for part in env.get(ENV_PREFIX + "INSECURE_REGISTRIES", "").split(",")
        if part.strip()
    )
    return ContainerConfig(
        state_dir=Path(state_dir),
        object_budget_bytes=_bytes(env, "OBJECT_BUDGET_BYTES", 50 << 30),
        free_floor_bytes=_bytes(env, "FREE_FLOOR_BYTES", 5 << 30),
        log_max_bytes=_bytes(env, "LOG_MAX_BYTES", 10 << 20),
        insecure_registries=insecure,
        allow_local_registries=_allow_local_registries(env),
        registry_ca_file=ca_file,
        bucket_ca_file=_existing_file(env, "BUCKET_CA"),
        rclone_binary=_existing_file(env, "RCLONE"),
        network_table=env.get(ENV_PREFIX + "NETWORK_TABLE") or "levers9",
        network_prefix=env.get(ENV_PREFIX + "NETWORK_PREFIX") or "l9",
        network_pool=env.get(ENV_PREFIX + "NETWORK_POOL") or "169.254.128.0/17",
    )


TOKEN_VARIABLE = ENV_PREFIX + "WORKER_TOKEN"
TOKEN_FD_VARIABLE = ENV_PREFIX + "WORKER_TOKEN_FD"
MAX_TOKEN_BYTES = 4096
"""A worker token is some tens of bytes; a pipe takes this much without a reader."""


def environ_for_reexec(env: Mapping[str, str], fd: int) -> dict[str, str]:
    """The environment `levers9-agent run` starts itself again with: `env` without the token,
    which is to be read from descriptor `fd` instead. Pure."""
    out = {k: v for k, v in env.items() if k != TOKEN_VARIABLE}
    out[TOKEN_FD_VARIABLE] = str(fd)
    return out


def _take_token(env: MutableMapping[str, str]) -> str:
    """The worker token, removed from `env`: from the pipe `LEVERS9_WORKER_TOKEN_FD` names
    (read to its end, then closed) when set, else from `LEVERS9_WORKER_TOKEN`."""
    fd_text = env.pop(TOKEN_FD_VARIABLE, None)
    if fd_text is None:
        token = _get(env, "WORKER_TOKEN")
        env.pop(TOKEN_VARIABLE, None)
        return token
    env.pop(TOKEN_VARIABLE, None)
    try:
        fd = int(fd_text)
    except ValueError:
        raise ConfigError(
            TOKEN_FD_VARIABLE,
            f"{TOKEN_FD_VARIABLE} must be a file descriptor number, not {fd_text!r}; it is set "
            "by levers9-agent itself, never by hand",
        ) from None
    try:
        with os.fdopen(fd, "rb") as pipe:
            data = pipe.read(MAX_TOKEN_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            TOKEN_FD_VARIABLE,
            f"cannot read the worker token from descriptor {fd} ({TOKEN_FD_VARIABLE}): "
            f"{exc.strerror or exc}",
        ) from None
    token = os.fsdecode(data)  # as the environment would have given it
    if not token:
        raise SettingMissing(
            TOKEN_VARIABLE,
            f"{TOKEN_VARIABLE} is not set (descriptor {fd} held no token); the worker Job "
            "sets it from its Secret",
        )
    return token


def load_config(env: MutableMapping[str, str] | None = None) -> AgentConfig:
    """Read the agent's settings; the token is popped from `env` (os.environ by default)."""
    env = os.environ if env is None else env
    worker_id = _get(env, "WORKER_ID")
    token = _take_token(env)
    mode = _get(env, "MODE", "direct")
    if mode not in ("direct", "tunnel"):
        raise ConfigError(
            ENV_PREFIX + "MODE", f"{ENV_PREFIX}MODE must be 'direct' or 'tunnel', not {mode!r}"
        )
    url = _get(env, "CONTROLPLANE_URL")
    if not _is_https_url(url):
        raise ConfigError(
            ENV_PREFIX + "CONTROLPLANE_URL",
            f"{ENV_PREFIX}CONTROLPLANE_URL must be an https:// URL with a host, not {url!r}",
        )
    listen = env.get(ENV_PREFIX + "LISTEN", "0.0.0.0:7443")
    host, _, port_text = listen.rpartition(":")
    try:
        port = int(port_text)
        if ":" not in listen or not 0 <= port < 65536:
            raise ValueError
    except ValueError:
        raise ConfigError(
            ENV_PREFIX + "LISTEN",
            f"{ENV_PREFIX}LISTEN must be HOST:PORT (e.g. 0.0.0.0:7443), not {listen!r}",
        ) from None
    ca_file = env.get(ENV_PREFIX + "CONTROLPLANE_CA") or None
    if ca_file is not None and not os.path.isfile(ca_file):
        raise ConfigError(
            ENV_PREFIX + "CONTROLPLANE_CA",
            f"{ENV_PREFIX}CONTROLPLANE_CA names {ca_file!r}, which is not a file",
        )
    return AgentConfig(
        worker_id=worker_id,
        token=token,
        mode=mode,
        controlplane_url=url.rstrip("/"),
        controlplane_ca_file=ca_file,
        listen_host=host.strip("[]") or "0.0.0.0",
        listen_port=port,
        advertise_host=env.get(ENV_PREFIX + "ADVERTISE_HOST") or None,
        node=env.get(ENV_PREFIX + "NODE_NAME") or None,
        register_interval_s=_number(env, "REGISTER_INTERVAL_S", 30.0),
        connections=load_connection_limits(env),
        keepalive=KeepaliveConfig(
            ping_interval_s=_number(env, "PING_INTERVAL_S", 15.0),
            ping_timeout_s=_number(env, "PING_TIMEOUT_S", 15.0),
        ),
        tunnel=TunnelConfig(
            max_age_s=_number(env, "TUNNEL_MAX_AGE_S", 3600.0),
            drain_s=_number(env, "TUNNEL_DRAIN_S", 30.0),
            backoff_cap_s=min(_number(env, "BACKOFF_CAP_S", 30.0), 30.0),
        ),
        containers=load_container_config(env),
        idle_s=_number(env, "IDLE_S", 0.0) if env.get(ENV_PREFIX + "IDLE_S") else None,
        loopback_connect=_on_off(env, "LOOPBACK_CONNECT", False),
        metrics=load_metrics_config(env),
        health=load_health_config(env),
    )


def _allow_local_registries(env: Mapping[str, str]) -> bool:
    """LEVERS9_ALLOW_LOCAL_REGISTRIES: 1 (a pool's allowLocalRegistries: true) or 0, unset."""
    name = ENV_PREFIX + "ALLOW_LOCAL_REGISTRIES"
    raw = env.get(name, "0").strip().lower()
    if raw not in ("1", "0", "true", "false", "on", "off", ""):
        raise ConfigError(name, f"{name} must be 1 or 0, not {raw!r}")
    return raw in ("1", "true", "on")
