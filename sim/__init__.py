"""The simulated installation: a Kubernetes API stand-in (RBAC enforced), a kubelet that
runs worker Jobs as local processes with its own pod arithmetic, an OCI registry runner,
an S3 server runner, the whole cluster, the demo and stand-in cloud CLIs.

It is shipped so that an installed `levers9` can run `python -m sim demo`; nothing in
`agent` or `control` imports it.
"""
