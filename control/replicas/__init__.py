"""Several controlplane replicas: the directory of who owns which worker, and the one hop
that forwards a request to the owner."""
