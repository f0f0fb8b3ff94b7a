"""The controlplane's HTTPS API: the server (one TLS listener, opened with everything it
serves as `async with open_controlplane(config)`), the tunnel accept, and the routes, one
module per group (tasks, workers, pools and machines, endpoints, watches)."""
