"""The controlplane's HTTPS API: the server, its models and its routes."""
