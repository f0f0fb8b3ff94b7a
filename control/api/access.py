"""Who may call a route: the checks the controlplane's routes share.

A caller's principal (`Controlplane._principal_of`) is `api:NAME` for an operator token,
`ws:NAME` for a workspace's, `worker:ID` for a worker's. Each check refuses with
PERMISSION_DENIED, naming the kind of token the call needs.
"""

from __future__ import annotations

from control.api.tasks import WORKSPACE_PREFIX
from wire.errors import ApiError, ErrorCode
from wire.service import Request


def require_api(request: Request) -> None:
    """An operator's call (a token of `apiTokens`)."""
    if not request.principal.startswith("api:"):
        raise ApiError(ErrorCode.PERMISSION_DENIED, "this call needs an operator token (apiTokens)")


def require_user(request: Request) -> None:
    """An operator's or a workspace's call."""
    if not request.principal.startswith(("api:", WORKSPACE_PREFIX)):
        raise ApiError(ErrorCode.PERMISSION_DENIED, "this call needs an API token")


def require_worker(request: Request, worker_id: str, what: str) -> None:
    """A call only worker `worker_id` itself may make (its own token), `what` naming it."""
    if request.principal != f"worker:{worker_id}":
        raise ApiError(ErrorCode.PERMISSION_DENIED, f"this token may not {what} worker {worker_id}")
