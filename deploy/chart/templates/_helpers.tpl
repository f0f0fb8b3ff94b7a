{{/*
Names, labels, the container port and the checks every template runs first. The checks live
here, not in the controlplane alone, so that a bad values file fails at `helm upgrade` with the
field named instead of as a crash-looping pod. values.schema.json (generated from the
controlplane's config types by `python -m control.values_schema`) refuses unknown keys and
values of the wrong kind before any template runs; these checks cover what a schema cannot say
as well (a value that depends on another, a secret in the wrong tree). Templates run them with
`template`, not `include`, so that Helm reports a failed check at its own line in this file
rather than at whichever template it happened to render first.
*/}}

{{- define "levers9.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "levers9.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "levers9.selectorLabels" -}}
app.kubernetes.io/name: {{ include "levers9.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "levers9.commonLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "levers9.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "levers9.labels" -}}
{{ include "levers9.commonLabels" . }}
app.kubernetes.io/component: controlplane
{{- end }}

{{/*
The metrics Service's labels: its own component, so that the ServiceMonitor's selector picks
it and never the public Service.
*/}}
{{- define "levers9.metricsSelectorLabels" -}}
{{ include "levers9.selectorLabels" . }}
app.kubernetes.io/component: metrics
{{- end }}

{{- define "levers9.metricsLabels" -}}
{{ include "levers9.commonLabels" . }}
app.kubernetes.io/component: metrics
{{- end }}

{{- define "levers9.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "levers9.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The container port: the port of config.listen (HOST:PORT). */}}
{{- define "levers9.port" -}}
{{- regexReplaceAll "^.*:" (toString .Values.config.listen) "" }}
{{- end }}

{{/* The metrics listener's address as config.metrics.listen takes it (HOST:PORT). */}}
{{- define "levers9.metricsListen" -}}
{{- printf "0.0.0.0:%d" (int .Values.metrics.port) }}
{{- end }}

{{/* The pools of config.worker.pools as a list (empty when unset). */}}
{{- define "levers9.pools" -}}
{{- $worker := .Values.config.worker | default dict }}
{{- toJson ($worker.pools | default list) }}
{{- end }}

{{/*
Namespaces of this cluster where workers run: each inCluster pool's namespace (default
levers9) and rbac.workerNamespaces, each once, sorted. A JSON list.
*/}}
{{- define "levers9.workerNamespaces" -}}
{{- $seen := dict }}
{{- range (include "levers9.pools" . | fromJsonArray) }}
{{- $kube := .kubernetes | default dict }}
{{- if $kube.inCluster }}
{{- $_ := set $seen ($kube.namespace | default "levers9") true }}
{{- end }}
{{- end }}
{{- range .Values.rbac.workerNamespaces }}
{{- $_ := set $seen . true }}
{{- end }}
{{- toJson (keys $seen | sortAlpha) }}
{{- end }}

{{/*
The namespace holding pools joined by `levers9 cluster join`, or "" when joined pools are not
kept in this cluster.
*/}}
{{- define "levers9.joinedPoolsNamespace" -}}
{{- $joined := .Values.config.joinedPools | default dict }}
{{- if $joined.inCluster }}
{{- $joined.namespace | default .Release.Namespace }}
{{- end }}
{{- end }}

{{/*
"true" when pools are shared out by Leases (leaderElection.enabled, or more than one replica),
else "".
*/}}
{{- define "levers9.leaderElection" -}}
{{- $election := .Values.leaderElection | default dict }}
{{- if or $election.enabled (gt (int .Values.replicaCount) 1) }}true{{ end }}
{{- end }}

{{/* config.leaderElection as the chart renders it (a YAML mapping). */}}
{{- define "levers9.leaderElectionConfig" -}}
{{- $election := .Values.leaderElection }}
{{- dict "enabled" true "namespace" .Release.Namespace "leaseDurationS" (int $election.leaseDurationS) "renewDeadlineS" (float64 $election.renewDeadlineS) "retryPeriodS" (float64 $election.retryPeriodS) | toYaml }}
{{- end }}

{{/* Refuse values the controlplane cannot run with; each message names the field. */}}
{{- define "levers9.validate" -}}
{{- $private := "move them under secretConfig in your private values file (kept outside the repository), which the chart puts in a Secret" }}
{{- $replicas := .Values.replicaCount }}
{{- if or (kindIs "invalid" $replicas) (kindIs "bool" $replicas) (not (regexMatch "^[0-9]+$" (toString $replicas))) (lt (int $replicas) 1) }}
{{- fail (printf "replicaCount: %v must be a whole number, 1 or more" $replicas) }}
{{- end }}
{{- if not (kindIs "map" .Values.config) }}
{{- fail "config: must be a mapping of the controlplane's settings (publicUrl, listen, worker...); see the chart's values.yaml" }}
{{- end }}
{{- $c := .Values.config }}
{{- $secretConfig := .Values.secretConfig | default dict }}
{{- if not (kindIs "map" $secretConfig) }}
{{- fail "secretConfig: must be a mapping of the controlplane's secret settings (apiTokens, worker, workspaces...); see the chart's values.yaml" }}
{{- end }}
{{- $replication := $c.replication | default dict }}
{{- if not (kindIs "map" $replication) }}
{{- fail "config.replication: must be a mapping (advertise, leaseS); its secret goes under secretConfig.replication.secret" }}
{{- end }}
{{- if $replication.secret }}
{{- fail (printf "config.replication.secret: the replica secret must not be in the ConfigMap; %s (secretConfig.replication.secret)" $private) }}
{{- end }}
{{- $replicaSecrets := $secretConfig.replication | default dict }}
{{- if not (kindIs "map" $replicaSecrets) }}
{{- fail "secretConfig.replication: must be a mapping (secret: ...)" }}
{{- end }}
{{- if $replicaSecrets.secret }}
{{- if or (not (kindIs "string" $replicaSecrets.secret)) (lt (len $replicaSecrets.secret) 16) }}
{{- fail "secretConfig.replication.secret must be a string of 16 characters or more; use a long random one (openssl rand -hex 32)" }}
{{- end }}
{{- if $replication.secretFile }}
{{- fail "secretConfig.replication.secret and config.replication.secretFile are both set; keep one" }}
{{- end }}
{{- end }}
{{- if gt (int $replicas) 1 }}
{{- if not (and (kindIs "map" $c.database) $c.database.url) }}
{{- fail (printf "replicaCount: %v needs the task records in PostgreSQL: set config.database.url (with secretConfig.database.password), or set replicaCount: 1 (SQLite on the volume takes one replica)" $replicas) }}
{{- end }}
{{- if not (or $replicaSecrets.secret $replication.secretFile) }}
{{- fail (printf "secretConfig.replication.secret is empty; replicaCount: %v needs it (the replicas authenticate each other with it when one passes a request on to the replica holding the worker): put a long random string there (openssl rand -hex 32) in your private values file, kept outside the repository" $replicas) }}
{{- end }}
{{- end }}
{{- $pdb := .Values.podDisruptionBudget | default dict }}
{{- if not (kindIs "map" $pdb) }}
{{- fail "podDisruptionBudget: must be a mapping (enabled, maxUnavailable); see the chart's values.yaml" }}
{{- end }}
{{- if and $pdb.enabled (not (regexMatch "^([1-9][0-9]*|[1-9][0-9]?%|100%)$" (toString $pdb.maxUnavailable))) }}
{{- fail (printf "podDisruptionBudget.maxUnavailable: %v must be a whole number of pods, 1 or more, or a percentage such as 50%%" $pdb.maxUnavailable) }}
{{- end }}
{{- if hasKey $c "leaderElection" }}
{{- fail "config.leaderElection: set the chart's leaderElection: values instead (top level, beside replicaCount); the chart renders config.leaderElection from them together with the Role the Leases need" }}
{{- end }}
{{- $election := .Values.leaderElection }}
{{- if not (kindIs "map" $election) }}
{{- fail "leaderElection: must be a mapping (enabled, leaseDurationS, renewDeadlineS, retryPeriodS); see the chart's values.yaml" }}
{{- end }}
{{- range $key := list "leaseDurationS" "renewDeadlineS" "retryPeriodS" }}
{{- $seconds := index $election $key }}
{{- if or (kindIs "invalid" $seconds) (kindIs "bool" $seconds) (not (regexMatch "^[0-9]+(\\.[0-9]+)?$" (toString $seconds))) (le (float64 $seconds) 0.0) }}
{{- fail (printf "leaderElection.%s: %v must be a number of seconds above 0" $key $seconds) }}
{{- end }}
{{- end }}
{{- if ne (float64 $election.leaseDurationS) (float64 (int $election.leaseDurationS)) }}
{{- fail (printf "leaderElection.leaseDurationS: %v must be a whole number of seconds (a Lease keeps whole seconds)" $election.leaseDurationS) }}
{{- end }}
{{- if not (lt (float64 $election.renewDeadlineS) (float64 $election.leaseDurationS)) }}
{{- fail (printf "leaderElection.renewDeadlineS must be less than leaseDurationS (%v), not %v: a leader must stop reconciling before its Lease can expire" $election.leaseDurationS $election.renewDeadlineS) }}
{{- end }}
{{- if not (lt (float64 $election.retryPeriodS) (float64 $election.renewDeadlineS)) }}
{{- fail (printf "leaderElection.retryPeriodS must be less than renewDeadlineS (%v), not %v: a leader must be able to try renewing more than once" $election.renewDeadlineS $election.retryPeriodS) }}
{{- end }}
{{- template "levers9.validateMetrics" . }}
{{- if not $c.publicUrl }}
{{- fail "config.publicUrl is empty; set it to the https:// URL that workers and the CLI dial (the Service's address under your DNS name), e.g. config.publicUrl: https://levers9.example.com" }}
{{- end }}
{{- if not (hasPrefix "https://" (toString $c.publicUrl)) }}
{{- fail (printf "config.publicUrl: %q must start with https://; the controlplane serves only HTTPS" (toString $c.publicUrl)) }}
{{- end }}
{{- if not (regexMatch "^.+:[0-9]{1,5}$" (toString $c.listen)) }}
{{- fail (printf "config.listen: %q must be HOST:PORT, e.g. 0.0.0.0:8443" (toString $c.listen)) }}
{{- end }}
{{- if not .Values.tls.secretName }}
{{- fail "tls.secretName is empty; make a kubernetes.io/tls Secret for config.publicUrl's host in the release namespace (kubectl create secret tls NAME --cert=FILE --key=FILE, or cert-manager) and set tls.secretName: NAME" }}
{{- end }}
{{- if and $c.database $c.database.password }}
{{- fail (printf "config.database.password: the database password is a secret and must not be in the ConfigMap; %s (secretConfig.database.password)" $private) }}
{{- end }}
{{- if not (and $c.database (or $c.database.url $c.database.path)) }}
{{- fail "config.database.path is empty; give the task database's file path, e.g. /var/lib/levers9-control/tasks.db (its directory is the volume's mount point), or config.database.url for PostgreSQL" }}
{{- end }}
{{- if $c.apiTokens }}
{{- fail (printf "config.apiTokens: API tokens are secrets and must not be in the ConfigMap; %s" $private) }}
{{- end }}
{{- if $c.workspaces }}
{{- fail (printf "config.workspaces: workspaces hold tokens and bucket keys and must not be in the ConfigMap; %s" $private) }}
{{- end }}
{{- $worker := $c.worker | default dict }}
{{- if not (kindIs "map" $worker) }}
{{- fail "config.worker: must be a mapping (pools, connectTimeoutS...)" }}
{{- end }}
{{- if $worker.tokens }}
{{- fail (printf "config.worker.tokens: worker tokens are secrets and must not be in the ConfigMap; %s" $private) }}
{{- end }}
{{- if $worker.poolCredentials }}
{{- fail (printf "config.worker.poolCredentials: pool keys must not be in the ConfigMap; %s" $private) }}
{{- end }}
{{- $pools := $worker.pools | default list }}
{{- if not (kindIs "slice" $pools) }}
{{- fail "config.worker.pools: must be a list of pool blocks (- name: ..., kubernetes: {...})" }}
{{- end }}
{{- $names := dict }}
{{- range $i, $pool := $pools }}
{{- if not (kindIs "map" $pool) }}
{{- fail (printf "config.worker.pools[%d]: must be a pool block (a mapping with name: and kubernetes:)" $i) }}
{{- end }}
{{- if not (and $pool.name (kindIs "string" $pool.name)) }}
{{- fail (printf "config.worker.pools[%d].name: is missing; give each pool a name (a DNS label, e.g. gke-a100)" $i) }}
{{- end }}
{{- $where := printf "config.worker.pools[%s]" $pool.name }}
{{- if hasKey $names $pool.name }}
{{- fail (printf "%s.name: the pool name appears twice; give each pool its own name" $where) }}
{{- end }}
{{- $_ := set $names $pool.name true }}
{{- if not (kindIs "map" $pool.kubernetes) }}
{{- fail (printf "%s.kubernetes: is missing; paste the whole block attach-gke-pool.sh printed" $where) }}
{{- end }}
{{- $kube := $pool.kubernetes }}
{{- if hasKey $kube "credentials" }}
{{- fail (printf "%s.kubernetes.credentials: the pool's key must not be in the ConfigMap; move it to secretConfig.worker.poolCredentials.%s in your private values file (kept outside the repository), or use kubernetes.credentialsFile, or join the cluster with `levers9 cluster join`" $where $pool.name) }}
{{- end }}
{{- $hostNetwork := true }}
{{- if hasKey $kube "hostNetwork" }}
{{- $hostNetwork = $kube.hostNetwork }}
{{- end }}
{{- $tunnel := false }}
{{- if hasKey $kube "tunnel" }}
{{- $tunnel = $kube.tunnel }}
{{- end }}
{{- if and (not $hostNetwork) (not $tunnel) }}
{{- fail (printf "%s.kubernetes.hostNetwork: false needs tunnel: true (nothing outside the cluster can dial a pod address); set tunnel: true or hostNetwork: true" $where) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The metrics values: the listener the chart turns on (config.metrics.listen, a container port,
a ClusterIP Service) and the ServiceMonitor that scrapes it.
*/}}
{{- define "levers9.validateMetrics" -}}
{{- $metrics := .Values.metrics }}
{{- if not (kindIs "map" $metrics) }}
{{- fail "metrics: must be a mapping (enabled, port, serviceMonitor); see the chart's values.yaml" }}
{{- end }}
{{- $monitor := $metrics.serviceMonitor | default dict }}
{{- if not (kindIs "map" $monitor) }}
{{- fail "metrics.serviceMonitor: must be a mapping (enabled, interval, labels); see the chart's values.yaml" }}
{{- end }}
{{- $c := .Values.config }}
{{- $own := $c.metrics | default dict }}
{{- if not (kindIs "map" $own) }}
{{- fail "config.metrics: must be a mapping (listen: HOST:PORT); or leave it out and set the chart's metrics.enabled: true" }}
{{- end }}
{{- if and $monitor.enabled (not $metrics.enabled) }}
{{- fail "metrics.serviceMonitor.enabled is true but metrics.enabled is not: the ServiceMonitor scrapes the metrics listener that metrics.enabled turns on; set metrics.enabled: true as well, or metrics.serviceMonitor.enabled: false" }}
{{- end }}
{{- if $metrics.enabled }}
{{- if $own.listen }}
{{- fail (printf "metrics.enabled and config.metrics.listen (%q) are both set; keep one: metrics.enabled renders config.metrics.listen as 0.0.0.0:<metrics.port> together with the container port, the metrics Service and the ServiceMonitor, so remove config.metrics.listen (or set metrics.enabled: false to run a listener of your own without them)" (toString $own.listen)) }}
{{- end }}
{{- $port := $metrics.port }}
{{- if or (kindIs "invalid" $port) (kindIs "bool" $port) (not (regexMatch "^[0-9]+$" (toString $port))) (lt (int $port) 1) (gt (int $port) 65535) }}
{{- fail (printf "metrics.port: %v must be a port number, 1 to 65535 (default 9090)" $port) }}
{{- end }}
{{- if eq (toString (int $port)) (include "levers9.port" .) }}
{{- fail (printf "metrics.port: %v is config.listen's port too (%s); the metrics listener needs a port of its own, e.g. 9090" $port (toString $c.listen)) }}
{{- end }}
{{- end }}
{{- if $monitor.enabled }}
{{- if not (regexMatch "^([0-9]+(ms|s|m|h|d|w|y))+$" (toString $monitor.interval)) }}
{{- fail (printf "metrics.serviceMonitor.interval: %q must be a Prometheus duration, e.g. 30s or 1m" (toString $monitor.interval)) }}
{{- end }}
{{- if not (kindIs "map" ($monitor.labels | default dict)) }}
{{- fail "metrics.serviceMonitor.labels: must be a mapping of label names to values, e.g. {release: prometheus}" }}
{{- end }}
{{- end }}
{{- end }}
