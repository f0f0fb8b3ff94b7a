"""The levers9 controlplane: public HTTPS endpoints (`control.api`), the tunnel acceptor and
worker registry, the Kubernetes provider (`control.kube`), task records and dispatch
(`control.tasks`), and the `levers9` CLI (`control.cli`). It reaches workers only through the
worker API (`workerapi`) over the shared transport (`wire`)."""
