"""In-process agent settings for the tests and benchmarks that run an agent beside a controlplane
of `sim`: the agent's own config type, filled as the worker Job's environment would fill it."""

from __future__ import annotations

from agent.daemon.config import AgentConfig, TunnelConfig
from sim.configs import WORKER_TOKENS, Pki
from wire.connection import KeepaliveConfig


def agent_config(
    pki: Pki,
    controlplane_port: int,
    *,
    mode: str,
    worker_id: str | None = None,
    token: str | None = None,
    max_age_s: float = 3600.0,
    ping_interval_s: float = 15.0,
    loopback_connect: bool = False,
) -> AgentConfig:
    worker_id = worker_id or f"w-{mode}"
    return AgentConfig(
        worker_id=worker_id,
        token=token or WORKER_TOKENS[worker_id],
        mode=mode,
        controlplane_url=f"https://127.0.0.1:{controlplane_port}",
        controlplane_ca_file=str(pki.ca_file),
        listen_host="127.0.0.1",
        listen_port=0,
        advertise_host="127.0.0.1",
        register_interval_s=0.5,
        keepalive=KeepaliveConfig(ping_interval_s=ping_interval_s, ping_timeout_s=ping_interval_s),
        tunnel=TunnelConfig(
            max_age_s=max_age_s,
            drain_s=5.0,
            backoff_initial_s=0.05,
            backoff_cap_s=0.5,
            backoff_stable_s=2.0,
        ),
        loopback_connect=loopback_connect,
    )
