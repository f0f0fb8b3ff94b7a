#!/usr/bin/env bash
# Install or upgrade the levers9 controlplane with the chart beside this script.
#
# Every argument goes on to `helm upgrade --install`, so the values files (the repository's and
# your private one, which holds the keys under secretConfig) are passed with -f. This script
# reads no key from the environment and writes no file: a key only ever lives in the private
# values file you hand to helm.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: deploy/deploy.sh -f values.yaml -f ~/private-values.yaml [helm upgrade arguments...]

Installs or upgrades the levers9 controlplane chart (deploy/chart) with
  helm upgrade --install "${RELEASE:-levers9}" deploy/chart \
    --namespace "${NAMESPACE:-levers9-control}" --create-namespace ARGS...

Every argument is passed on to helm unchanged, e.g. --set image.tag=1.2.3, --dry-run, --wait.

  values.yaml           config: publicUrl, config.worker.pools (the block attach-gke-pool.sh
                        prints, pasted unchanged), tls.secretName...; may live in the repository.
  private-values.yaml   secretConfig: apiTokens, worker.tokens, worker.poolCredentials (a pool's
                        key), workspaces; readable only by you (chmod 600), never in the repository.

Environment:
  RELEASE     the Helm release name (default levers9)
  NAMESPACE   the namespace of the controlplane (default levers9-control)

To attach a cluster without any key, use `levers9 cluster join`.
USAGE
}

if [[ $# -gt 0 && ( "$1" == "-h" || "$1" == "--help" ) ]]; then
    usage
    exit 0
fi
if [[ $# -eq 0 ]]; then
    usage >&2
    echo >&2
    echo "deploy.sh: give your values files, e.g. -f values.yaml -f ~/private-values.yaml" >&2
    exit 2
fi

if [[ -n "${LEVERS9_GKE_SA_JSON+set}" ]]; then
    # The value is never read, printed or passed on; only its name is mentioned.
    echo "deploy.sh: warning: LEVERS9_GKE_SA_JSON is set and ignored; keys are no longer read" \
        "from the environment. Put the pool's key under secretConfig.worker.poolCredentials.<pool>" \
        "in a private values file (chmod 600, outside the repository) and pass it with -f," \
        "or attach the cluster without a key: levers9 cluster join" >&2
    unset LEVERS9_GKE_SA_JSON
fi

if ! command -v helm >/dev/null 2>&1; then
    echo "deploy.sh: helm is not on PATH; install Helm 3 (https://helm.sh/docs/intro/install/)" \
        "or add its directory to PATH, then run deploy.sh again" >&2
    exit 127
fi

chart="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)/chart"

exec helm upgrade --install "${RELEASE:-levers9}" "$chart" \
    --namespace "${NAMESPACE:-levers9-control}" --create-namespace "$@"
