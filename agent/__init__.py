"""The levers9 worker agent.

It runs as a privileged Kubernetes Job pinned to one GPU node, claims the node's free cards,
runs containers across them and serves ONE HTTP/2 API to the controlplane, either on a TLS
listener of its own (direct mode) or inside a WebSocket it dials out to the controlplane
(tunnel mode). The agent owns that API: its models (`agent.api.models`) and the client the
controlplane uses (`agent.api.client`) live here; the agent never imports `control`.

Its subsystems build on each other in one direction (checked in `make lint`): `wire` (the
transport, shared with the controlplane), `api`, then `host`, `store` and `gpus`, `volumes`,
`runtime` (containers), and `daemon` (the program that wires them together).
"""

__version__ = "0.1.0"
