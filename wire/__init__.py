"""The transport both programs use: sans-IO HTTP/2 policy, the trio connection around it,
the router, TLS, WebSocket framing, and the wire's errors and converter.

Nothing here knows about containers, cards or tasks; `workerapi` and `control` build on it.
"""
