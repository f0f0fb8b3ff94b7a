"""The levers9 worker agent.

It runs as a privileged Kubernetes Job pinned to one GPU node, claims the node's free cards,
runs containers across them and serves ONE HTTP/2 API to the controlplane, either on a TLS
listener of its own (direct mode) or inside a WebSocket it dials out to the controlplane
(tunnel mode). That API as its callers see it (models, validation, the client) is the
top-level `workerapi` package, and the transport both programs use is `wire`; the agent never
imports `control`.

Its subsystems build on each other in one direction (checked in `make lint`): `host`, `store`
and `gpus`, then `volumes`, `runtime` (containers), and `daemon` (the program that wires them
together).
"""
