"""The levers9 controlplane: public HTTPS endpoints, the tunnel acceptor, the worker registry,
and the `levers9` CLI. It reaches workers only through the client that `agent.api.client` ships."""
