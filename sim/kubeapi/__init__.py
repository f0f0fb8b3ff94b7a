"""A Kubernetes API server stand-in: real REST shapes over TLS, objects kept as plain dicts.

No kube-apiserver can be installed here, yet the controlplane's Kubernetes adapter must be
tested against something that the official `kubernetes` client and `kubectl` both accept. This
module serves core/v1 nodes, pods (with their `log` subresource), secrets, namespaces,
serviceaccounts and events, batch/v1 jobs, rbac.authorization.k8s.io/v1 roles, clusterroles
and their bindings, and coordination.k8s.io/v1 leases (leader election) with the apiserver's
paths, List and Status shapes, discovery documents, label and field selectors (an Event's
`involvedObject.*`, `reason`, `type` among them, so `kubectl describe job` lists a Job's events),
JSON merge and strategic merge patches, `limit`/`continue` paging, bearer-token authentication,
owner-reference cascading on delete, and optimistic concurrency: a PUT of any resource whose
`metadata.resourceVersion` is not the stored one is a 409 Conflict.

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
- Only what the controlplane needs is modelled: no admission, no scheduler, no RBAC escalation
  checks or bootstrap roles, and the garbage collector and the token controller run
  synchronously inside the request that triggers them.
"""
