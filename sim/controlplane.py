"""The controlplane as a task, for the tests and benchmarks that hold it in a nursery they
already have (a fixture's, or one they cancel to restart it).

The product opens it as `async with open_controlplane(config)` (`control.api.server`), which
owns every task it runs; this is that block kept open until cancelled, so `nursery.start`
gives the running controlplane.
"""

from __future__ import annotations

from collections.abc import Mapping

import trio

from control.api.server import Controlplane, open_controlplane
from control.config import ControlConfig


async def run_controlplane(
    config: ControlConfig,
    *,
    pool_env: Mapping[str, str] | None = None,
    task_status: trio.TaskStatus[Controlplane] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `config`'s controlplane until cancelled; `started()` gives it."""
    async with open_controlplane(config, pool_env=pool_env) as control:
        task_status.started(control)
        await trio.sleep_forever()
