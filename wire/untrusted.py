"""What a client sends, made bounded before it becomes a metric label or part of a log line.

A request's method, path and header values are whatever its sender chose, unauthenticated
ones included: a 30 kB `:method` made into a label value is a series of its own on every
scrape, and a 60 kB path copied into a log line is 60 kB of log per request. So nothing a
client supplies reaches either as it came:

- a metric label takes its value from a fixed set: `method_label` maps a method to one of
  `METHODS` or `OTHER`, `status_label` a status code to its number (a bounded set) or `OTHER`;
  routes are the router's patterns (`wire.service.Router`), never a path;
- a log line takes `clip(value)`: at most `CLIP_CHARS` characters, then a marker saying how
  many more there were, so the reader knows the value was longer.

Pure functions, one place for both programs (the agent's Service and the controlplane's API,
metrics and forwarding use them).
"""

from __future__ import annotations

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT")
"""The methods a label names; any other is `OTHER`."""
OTHER = "other"
CLIP_CHARS = 200
"""What a log line keeps of one client-supplied value."""


def method_label(method: str) -> str:
    """The `method` label for a request's `:method`: itself when it is one of `METHODS`
    (exactly, as HTTP methods are case-sensitive), else `OTHER`."""
    return method if method in METHODS else OTHER


def status_label(status: int) -> str:
    """The `code` label: the status as a number from 0 (ended without one) to 599, else
    `OTHER` (a proxied origin may answer with anything)."""
    return str(status) if 0 <= status <= 599 else OTHER


def clip(value: object, limit: int = CLIP_CHARS) -> str:
    """`value` as text for a log line: whole up to `limit` characters, else its first `limit`
    and `…(N more)`."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…({len(text) - limit} more)"


__all__ = ["CLIP_CHARS", "METHODS", "OTHER", "clip", "method_label", "status_label"]
