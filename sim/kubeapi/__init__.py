"""A Kubernetes API server stand-in: real REST shapes over TLS, objects kept as plain dicts.

No kube-apiserver can be installed here, yet the controlplane's Kubernetes adapter must be
tested against something that the official `kubernetes` client and `kubectl` both accept. This
module serves core/v1 nodes, pods (with their `log` subresource), secrets, configmaps,
services, persistentvolumeclaims, namespaces, serviceaccounts and events, apps/v1 deployments
(with their `scale` subresource), batch/v1 jobs, policy/v1 poddisruptionbudgets,
rbac.authorization.k8s.io/v1 roles, clusterroles and their bindings, and coordination.k8s.io/v1
leases (leader election) with the apiserver's paths, List and Status shapes, discovery documents
(short names and the `all` category, so `kubectl get cm,svc,pvc,pdb,deploy` and `kubectl get
all` read right), label and field selectors (an Event's `involvedObject.*`, `reason`, `type`
among them, so `kubectl describe job` lists a Job's events), JSON merge and strategic merge
patches (`sim.kubeapi.patches`), `limit`/`continue` paging, bearer-token authentication,
owner-reference cascading on delete, and optimistic concurrency: a PUT of any resource whose
`metadata.resourceVersion` is not the stored one is a 409 Conflict.

Deployments are kept by a small Deployment controller (`sim.kubeapi.deployments`): `spec.replicas`
pods from the template, owned by the Deployment and named `<deployment>-<hash>-<5 chars>`, bound
by a one-pass scheduler (`sim.kubeapi.scheduler`: the first Ready, schedulable node by name whose
selector, taints and free `nvidia.com/gpu`, cpu and memory fit; else Pending with the
scheduler's reason) and Running at once, since nothing runs in them; the Deployment's status
(replicas, ready, available, updated, observedGeneration, the Available and Progressing
conditions) is what `kubectl get deploy` and `kubectl rollout status` read. So `kubectl scale
deployment NAME --replicas=0` frees the cards its pods held, and deploy/deploy.sh's
`helm upgrade --install` of deploy/chart installs, upgrades and uninstalls: Helm's OpenAPI v3
look before writing is answered (`sim.kubeapi.openapi`) and the release Secrets it sends as
protobuf are decoded (`sim.kubeapi.protobuf`). Services get a cluster IP (and node ports),
claims are Bound at once; neither has a controller behind it.

Every listed resource also serves WATCH (`?watch=true`, its own RBAC verb) as the apiserver
does: a chunked stream of `{"type", "object"}` lines from a list's resourceVersion (or, without
one, synthetic ADDED events for what exists), label and field selectors applied as its cacher
applies them (an object that stops matching arrives as DELETED), `timeoutSeconds`, BOOKMARK
events with `allowWatchBookmarks`, and an ERROR event with a 410 Expired Status for a version
older than the bounded history it keeps (`sendInitialEvents` is ignored). Tests count lists
(`list_count`) and open watches (`watch_count`, `wait_watches`), cut every stream
(`drop_watches`), compact the history (`expire_history`), and make every watch, open or new,
misbehave as under load (`set_watch_faults(WatchFaults(...))`): lag behind the store by
`lag_s` (lists and GETs do not), end at once with no event as a proxy ending long requests
does, or stall, sending nothing until the fault is cleared.

ServiceAccounts are modelled as far as `levers9 cluster join` needs them: the token controller
fills a `kubernetes.io/service-account-token` Secret with a token, the CA and the namespace; a
request bearing that token is `system:serviceaccount:<ns>:<sa>` and is authorized by RBAC
(Roles, ClusterRoles and their bindings, wildcards and resourceNames as the real authorizer
reads them), with the apiserver's 403 wording; `kubectl auth can-i` and `kubectl auth whoami`
get their review answers. The admin token and `add_token` tokens bypass RBAC, as before.

Design choices:
- It is a `http.server.ThreadingHTTPServer` on its own threads, so the same object serves trio
  tests (the official client is blocking and runs in `trio.to_thread`), kubectl subprocesses and
  a benchmark process alike; `python -m sim.kubeapi` serves a synthetic cluster from a
  process of its own.
- Stored objects are never mutated: every change stores a new dict together with its JSON bytes,
  so a list of 100,000 pods is one `b",".join` and handlers serialise nothing under the lock.
- Tests arrange state through the Python API (`add_node`, `add_pod`, `set_pod_phase`, ...) rather
  than through status subresources; request faults and a "kubelet" callback run when a Job is
  created are armed the same way: `inject_fault` answers the next `count` matching requests
  (or every one until `clear_faults`, with `count=None`), matched by path, verb and object name
  prefix, with a 429 and Retry-After, a 500, a delay, or any Status a test names (a 422 Invalid,
  a 403 exceeded quota).
- Only what the controlplane needs is modelled: of admission, Pod Security alone (a pod that
  breaks its namespace's `pod-security.kubernetes.io/enforce` level, or the cluster default
  `set_pod_security_default` sets, is refused with the plugin's 403; a Job's refused pod is a
  `FailedCreate` Event on the Job: `sim.kubeapi.podsecurity`, and a Deployment's its
  `ReplicaFailure` condition; `set_autopilot` adds GKE Autopilot's refusal of privileged pods
  and Jobs in every namespace; a create with `dryRun=All` is admitted but not stored); a
  scheduler only for the Deployments' own pods; no ReplicaSets
  (`kubectl rollout undo` has no history to go back to); no RBAC escalation checks or bootstrap
  roles; and the garbage collector, the token controller and the Deployment controller run
  synchronously inside the request that triggers them.
"""
