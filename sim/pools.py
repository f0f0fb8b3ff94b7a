"""A pool of GPU nodes on the Kubernetes stand-in, as the pools' tests and benchmarks set it up:
labelled GPU nodes, the pool's config block pointing at the stand-in, a kubelet that runs each
worker Job's pod, and the count of Jobs created.

Shared by `tests/` and `bench/` (which never import each other's modules)."""

from __future__ import annotations

import base64
from typing import Any

from sim.kubeapi.objects import job_node, make_node
from sim.kubeapi.store import KubeStandin

__all__ = ["gpu_node", "jobs_created", "pool_block", "schedule_pods_of_jobs"]


def pool_block(kube: KubeStandin, **kubernetes: Any) -> dict[str, Any]:
    """The config block of pool `gpu` on `kube`, selecting the nodes `gpu_node` makes."""
    return {
        "name": "gpu",
        "provider": "kubernetes",
        "kubernetes": {
            "flavor": "generic",
            "endpoint": kube.url,
            "caData": base64.b64encode(kube.ca_pem).decode(),
            "credentials": {"token": kube.token},
            "image": "registry.example.test/levers9/worker:1",
            "selector": {"levers9.dev/test-pool": "gpu"},
            **kubernetes,
        },
    }


def gpu_node(name: str, gpus: int = 4, **kw: Any) -> dict[str, Any]:
    """A node of pool `gpu` with `gpus` cards."""
    labels = {"levers9.dev/test-pool": "gpu", **kw.pop("labels", {})}
    return make_node(name, gpus=gpus, labels=labels, **kw)


def jobs_created(kube: KubeStandin) -> int:
    """How many Job creates the stand-in accepted."""
    return sum(
        1
        for r in kube.requests
        if r.verb == "create" and r.path.endswith("/jobs") and r.status < 300
    )


def schedule_pods_of_jobs(kube: KubeStandin) -> None:
    """A kubelet and scheduler: a Job's pod runs on its node, or waits Pending while a worker
    pod of ours already holds that node's cards."""

    def hook(server: KubeStandin, job: dict[str, Any]) -> None:
        node = job_node(job)
        taken = any(
            pod["spec"].get("nodeName") == node and pod["status"].get("phase") == "Running"
            for pod in server.pods(job["metadata"]["namespace"])
        )
        server.run_job_pod(job, phase="Pending" if taken else "Running")

    kube.on_job_created(hook)
