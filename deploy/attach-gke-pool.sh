#!/usr/bin/env bash
# attach-gke-pool.sh: the cloud side of a levers9 worker pool on a GKE cluster, in one go.
#
# The controlplane runs on EKS and drives a GKE cluster's API over the internet; for that the
# GCP project needs a service account and its key, a registry the nodes can pull the worker
# image from, the controlplane's egress IPs on the cluster's authorized networks, and a
# firewall rule that lets the controlplane dial the workers. This script does all of that and
# prints the pool's values block. Every step is "create once, update after" and never removes
# anything, so it is rerun whenever something changes: after a worker build (it copies the
# image again) and after EKS nodes are replaced (it appends their new IPs).
#
# The key is the one secret. It is written by gcloud into a private temporary directory,
# moved by python3 (reading stdin, never argv) into the private values file (mode 0600, outside
# any git work tree), and never printed. Only the values block goes to stdout; progress and
# errors go to stderr.
#
# JSON is read with small python3 snippets (gcloud needs Python, so python3 is there wherever
# gcloud is); no jq.
set -euo pipefail

readonly PROG=attach-gke-pool.sh
readonly SA_ID=levers9-controlplane
readonly REPOSITORY=levers9
readonly ROLE=roles/container.developer
# Never let gcloud stop and ask: a prompt here would hang a rerun in a terminal-less shell.
export CLOUDSDK_CORE_DISABLE_PROMPTS=1

usage() {
    printf '%s\n' \
        "usage: $PROG --project P --region R --cluster C --eks-context CTX --eks-cluster NAME" \
        "         --aws-region AR --worker-image ECR_IMAGE [options]" \
        "" \
        "Creates (once) and updates (every run) what a levers9 worker pool on the GKE cluster" \
        "C needs, then prints the pool's block for config.worker.pools on stdout. Safe to" \
        "rerun; it never removes anything. Needs gcloud, kubectl (with the EKS context), aws" \
        "and skopeo, logged in, and python3." \
        "" \
        "required:" \
        "  --project P            GCP project of the GKE cluster" \
        "  --region R             region of the GKE cluster and of the levers9 registry" \
        "  --cluster C            GKE cluster name" \
        "  --eks-context CTX      kubectl context of the controlplane's EKS cluster" \
        "  --eks-cluster NAME     name of that EKS cluster" \
        "  --aws-region AR        AWS region of that EKS cluster" \
        "  --worker-image IMAGE   the worker image in ECR, e.g." \
        "                         123456789012.dkr.ecr.us-east-1.amazonaws.com/levers9/worker:latest" \
        "options:" \
        "  --pool-name NAME       the pool's name (default gke-<cluster>)" \
        "  --agent-port PORT      the worker port the firewall rule opens (default 7443)" \
        "  --private-values FILE  where the key goes (default" \
        "                         \$HOME/.levers9/<cluster>-private-values.yaml); must be" \
        "                         outside any git work tree" \
        "  --accelerator TYPE     the GPU type the pool selects, when the cluster's node pools" \
        "                         carry several (e.g. nvidia-tesla-a100)" \
        "  --node-tag TAG         the network tag the firewall rule targets (default: the GPU" \
        "                         node pools' own tags, else the tag GKE puts on every node of" \
        "                         the cluster, gke-<cluster>-<first 8 of the cluster id>-node)" \
        "  -h, --help             this text"
}

say() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() {
    say "error: $*"
    exit 1
}
usage_die() {
    say "error: $*"
    say "run $PROG --help for the flags"
    exit 2
}

# --- flags ---------------------------------------------------------------------------------

project="" region="" cluster="" eks_context="" eks_cluster="" aws_region="" worker_image=""
pool_name="" agent_port=7443 private_values="" accelerator="" node_tag=""
while (($#)); do
    case $1 in
    -h | --help)
        usage
        exit 0
        ;;
    --*=*)
        flag=${1%%=*} value=${1#*=}
        shift
        ;;
    --*)
        flag=$1
        (($# >= 2)) || usage_die "$1 needs a value"
        value=$2
        shift 2
        ;;
    *) usage_die "unexpected argument '$1': every setting is a --flag" ;;
    esac
    case $flag in
    --project) project=$value ;;
    --region) region=$value ;;
    --cluster) cluster=$value ;;
    --eks-context) eks_context=$value ;;
    --eks-cluster) eks_cluster=$value ;;
    --aws-region) aws_region=$value ;;
    --worker-image) worker_image=${value#docker://} ;;
    --pool-name) pool_name=$value ;;
    --agent-port) agent_port=$value ;;
    --private-values) private_values=$value ;;
    --accelerator) accelerator=$value ;;
    --node-tag) node_tag=$value ;;
    *) usage_die "unknown flag $flag" ;;
    esac
done

missing=()
[[ -n $project ]] || missing+=("--project (the GCP project of the GKE cluster)")
[[ -n $region ]] || missing+=("--region (region of the GKE cluster and the registry)")
[[ -n $cluster ]] || missing+=("--cluster (the GKE cluster name)")
[[ -n $eks_context ]] || missing+=("--eks-context (kubectl context of the EKS cluster)")
[[ -n $eks_cluster ]] || missing+=("--eks-cluster (the EKS cluster name)")
[[ -n $aws_region ]] || missing+=("--aws-region (AWS region of the EKS cluster)")
[[ -n $worker_image ]] || missing+=("--worker-image (the worker image in ECR)")
if ((${#missing[@]})); then
    for m in "${missing[@]}"; do say "error: missing $m"; done
    say "run $PROG --help for the flags"
    exit 2
fi

[[ $project =~ ^[a-z][a-z0-9-]{4,28}[a-z0-9]$ ]] ||
    usage_die "--project '$project' is not a GCP project id (6-30 lowercase letters, digits, -)"
[[ $region =~ ^[a-z]+-[a-z]+[0-9]+$ ]] ||
    usage_die "--region '$region' is not a GCP region such as us-central1"
[[ $cluster =~ ^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$ ]] ||
    usage_die "--cluster '$cluster' is not a GKE cluster name (lowercase letters, digits, -)"
pool_name=${pool_name:-gke-$cluster}
[[ $pool_name =~ ^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$ ]] ||
    usage_die "--pool-name '$pool_name' must be a DNS label (lowercase letters, digits, -)"
if ! [[ $agent_port =~ ^[1-9][0-9]{0,4}$ ]] || ((agent_port > 65535)); then
    usage_die "--agent-port '$agent_port' must be a TCP port number (1-65535)"
fi
ecr_host=${worker_image%%/*}
[[ $worker_image == */* && $ecr_host =~ ^[0-9]{12}\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com$ ]] ||
    usage_die "--worker-image '$worker_image' is not an ECR image such as" \
        "123456789012.dkr.ecr.us-east-1.amazonaws.com/levers9/worker:latest"
ecr_region=${BASH_REMATCH[1]}
values_dir_ours=""
if [[ -z $private_values ]]; then
    values_dir_ours=${HOME:?HOME is not set; pass --private-values}/.levers9
    private_values=$values_dir_ours/$cluster-private-values.yaml
fi
[[ $private_values == /* ]] || private_values=$PWD/$private_values

for tool in gcloud kubectl aws skopeo python3; do
    command -v "$tool" >/dev/null ||
        die "$tool is not on PATH; install it (and log it in) before running $PROG"
done

readonly sa_email=$SA_ID@$project.iam.gserviceaccount.com
readonly registry_host=$region-docker.pkg.dev
readonly worker_dst=$registry_host/$project/$REPOSITORY/worker:latest
readonly firewall_rule=levers9-controlplane-to-$cluster

# --- python3 snippets (JSON on stdin; secrets only ever on stdin) ---------------------------

# argv: path. Prints the enclosing git work tree, if any.
PY_GIT_TREE='
import os, sys
d = os.path.dirname(os.path.realpath(sys.argv[1]))
while True:
    if os.path.exists(os.path.join(d, ".git")):
        print(d)
        break
    up = os.path.dirname(d)
    if up == d:
        break
    d = up
'

# stdin: cluster JSON; argv: cluster, --accelerator, --node-tag. Prints key=value facts.
PY_CLUSTER='
import json, sys
c = json.load(sys.stdin)
cluster, wanted, tag = sys.argv[1:4]
def fail(msg):
    print("attach-gke-pool.sh: error: " + msg, file=sys.stderr)
    sys.exit(1)
if not c.get("endpoint") or not c.get("masterAuth", {}).get("clusterCaCertificate"):
    fail("cluster %s has no public endpoint or CA in its description" % cluster)
if (c.get("autopilot") or {}).get("enabled"):
    fail("cluster %s is a GKE Autopilot cluster, and Autopilot does not admit privileged pods:"
         " a levers9 worker is one (privileged, hostNetwork, hostPath volumes). Use a GKE"
         " Standard cluster with a GPU node pool" % cluster)
pools, kinds = {}, []
for p in c.get("nodePools", []):
    for a in p.get("config", {}).get("accelerators", []):
        kind = a.get("acceleratorType")
        if kind and kind not in kinds:
            kinds.append(kind)
        pools.setdefault(kind, []).append(p)
if not kinds:
    fail("no node pool of cluster %s has GPUs; add a GPU node pool first" % cluster)
if wanted and wanted not in kinds:
    fail("--accelerator %s: no node pool of %s has it; it has %s" % (wanted, cluster, ", ".join(kinds)))
if not wanted and len(kinds) > 1:
    fail("the node pools of %s carry several GPU types (%s); pick one with --accelerator" % (cluster, ", ".join(kinds)))
kind = wanted or kinds[0]
if not tag:
    tags = [p.get("config", {}).get("tags") or [] for p in pools[kind]]
    if all(tags):
        tag = ",".join(dict.fromkeys(t for ts in tags for t in ts))
    elif c.get("id"):
        tag = "gke-%s-%s-node" % (cluster, c["id"][:8])
    else:
        fail("cannot tell the network tag of the nodes of %s; pass --node-tag" % cluster)
auth = c.get("masterAuthorizedNetworksConfig") or {}
print("accelerator=" + kind)
print("network=" + c.get("network", "default").rsplit("/", 1)[-1])
print("node_tag=" + tag)
print("authorized_enabled=" + ("yes" if auth.get("enabled") else "no"))
print("authorized=" + ",".join(b["cidrBlock"] for b in auth.get("cidrBlocks", [])))
'

# stdin: kubectl get nodes -o json. Prints each ExternalIP.
PY_NODE_IPS='
import json, sys
for node in json.load(sys.stdin).get("items", []):
    for a in node.get("status", {}).get("addresses", []):
        if a.get("type") == "ExternalIP" and a.get("address"):
            print(a["address"])
'

# stdin: aws eks describe-cluster. Prints the VPC id.
PY_VPC='
import json, sys
print(json.load(sys.stdin)["cluster"]["resourcesVpcConfig"]["vpcId"])
'

# stdin: aws ec2 describe-nat-gateways. Prints each public IP.
PY_NAT_IPS='
import json, sys
for g in json.load(sys.stdin).get("NatGateways", []):
    for a in g.get("NatGatewayAddresses", []):
        if a.get("PublicIp"):
            print(a["PublicIp"])
'

# argv: existing comma list, then addresses. Prints two comma lists ("-" when empty): the
# existing entries in order followed by the addresses no existing block covers, as /32s;
# and those added.
PY_MERGE='
import ipaddress, sys
existing = [c for c in sys.argv[1].split(",") if c]
nets = [ipaddress.ip_network(c, strict=False) for c in existing]
added = []
for ip in sys.argv[2:]:
    addr = ipaddress.ip_address(ip)
    if not any(addr in n for n in nets):
        n = ipaddress.ip_network("%s/%d" % (addr, addr.max_prefixlen))
        nets.append(n)
        added.append(str(n))
print(",".join(existing + added) or "-", ",".join(added) or "-")
'

# stdin: firewall rule JSON; argv: port. Prints the source ranges ("-" when none) and whether
# tcp:port is allowed.
PY_FIREWALL='
import json, sys
r = json.load(sys.stdin)
port = sys.argv[1]
ok = any(a.get("IPProtocol") in ("tcp", "all") and (not a.get("ports") or any(
    p == port or ("-" in p and int(p.split("-")[0]) <= int(port) <= int(p.split("-")[1]))
    for p in a["ports"])) for a in r.get("allowed", []))
print(",".join(r.get("sourceRanges", [])) or "-", "yes" if ok else "no")
'

# The private values file, as this script writes it: a header, then one line per pool whose
# value is the key JSON on one line (JSON is YAML). Anything else is not ours to rewrite.
PY_VALUES_READ='
import json, os, re, sys
def entries(path):
    with open(path) as f:
        text = f.read()
    head = ["secretConfig:", "  worker:", "    poolCredentials:"]
    lines = [l for l in text.splitlines() if l.strip() and not l.startswith("#")]
    entry = re.compile(r"      ([a-z0-9-]+): (\{.*\})")
    if lines[:3] != head or not all(entry.fullmatch(l) for l in lines[3:]):
        print("attach-gke-pool.sh: error: %s holds more than pool keys written by this "
              "script, so it is not rewritten; pass another --private-values (or the default)"
              % path, file=sys.stderr)
        sys.exit(1)
    return dict(entry.fullmatch(l).groups() for l in lines[3:])
'

# argv: file, pool. Prints the key id the file holds for the pool (nothing when none).
PY_KEY_ID=$PY_VALUES_READ'
raw = entries(sys.argv[1]).get(sys.argv[2])
if raw:
    try:
        print(json.loads(raw).get("private_key_id", ""))
    except ValueError:
        pass
'

# stdin: keys list JSON; argv: key id. Exit 0 when the key is listed.
PY_KEY_LISTED='
import json, sys
names = [k.get("name", "") for k in json.load(sys.stdin)]
sys.exit(0 if any(n.rsplit("/", 1)[-1] == sys.argv[1] for n in names) else 1)
'

# stdin: the new key JSON; argv: file, pool, cluster. Writes the file (0600, parent made 0700,
# other pools kept), atomically. Prints the new key id.
PY_VALUES_WRITE=$PY_VALUES_READ'
path, pool, cluster = sys.argv[1:4]
key = json.load(sys.stdin)
keep = entries(path) if os.path.exists(path) else {}
keep[pool] = json.dumps(key, separators=(",", ":"))
os.umask(0o077)
os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
lines = [
    "# levers9 private values: the service-account keys of worker pools (GKE cluster %s)."
    % cluster,
    "# Written by deploy/attach-gke-pool.sh. Keep it mode 0600 and out of any repository;",
    "# hand it to deploy/deploy.sh as a second -f.",
    "secretConfig:",
    "  worker:",
    "    poolCredentials:",
] + ["      %s: %s" % item for item in sorted(keep.items())]
tmp = "%s.tmp%d" % (path, os.getpid())
fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
with os.fdopen(fd, "w") as f:
    f.write("\n".join(lines) + "\n")
    f.flush()
    os.fsync(f.fileno())
os.replace(tmp, path)
print(key["private_key_id"])
'

# stdin: cluster JSON; argv: pool, accelerator, image, private values file, cluster. Prints
# the values block.
PY_BLOCK='
import json, re, sys
c = json.load(sys.stdin)
pool, accelerator, image, private_values, cluster = sys.argv[1:6]
def s(v):
    plain = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/:+=-]*", v) and not re.fullmatch(
        r"(?i)(true|false|yes|no|on|off|null|~|[-+.0-9_e]+)", v)
    return v if plain and ": " not in v else json.dumps(v)
print("# levers9 worker pool for GKE cluster %s, printed by deploy/attach-gke-pool.sh." % cluster)
print("# It is indented to paste as it is under config.worker.pools in your values file:")
print("#   config:")
print("#     worker:")
print("#       pools:        <- the lines below go here (replace pools: [] with pools:)")
print("# The key is not here: it is in %s (mode 0600). Deploy with that file" % private_values)
print("# last, so that its secretConfig is merged over your values:")
print("#   deploy/deploy.sh -f values.yaml -f %s" % private_values)
for line in (
    "- name: " + s(pool),
    "  provider: kubernetes",
    "  kubernetes:",
    "    flavor: gke",
    "    endpoint: " + s("https://" + c["endpoint"]),
    "    caData: " + s(c["masterAuth"]["clusterCaCertificate"]),
    "    namespace: levers9",
    "    selector:",
    "      cloud.google.com/gke-accelerator: " + s(accelerator),
    "    tunnel: false",
    "    hostNetwork: true",
    "    image: " + s(image),
):
    print("      " + line)
'

py() { python3 -I -c "$@"; }

# merge EXISTING ADDRESS...: sets merged and added (comma lists, see PY_MERGE).
merge() {
    local out
    out=$(py "$PY_MERGE" "$@") || die "could not merge address lists"
    read -r merged added <<<"$out"
    [[ $merged != - ]] || merged=""
    [[ $added != - ]] || added=""
}

# --- work dir: the key lands here first; removed however the script ends --------------------

work=$(mktemp -d "${TMPDIR:-/tmp}/attach-gke-pool.XXXXXXXX")
chmod 700 "$work"
trap 'rm -rf "$work"' EXIT

# run OUT CMD...: CMD's stdout to OUT, its stderr shown only when it fails.
run() {
    local out=$1
    shift
    if ! "$@" >"$out" 2>"$work/err"; then
        printf '%s\n' "$(<"$work/err")" >&2
        die "'$1 ${2:-} ${3:-} ${4:-}' failed (above); fix that and rerun, nothing is undone"
    fi
}

# lookup OUT CMD...: 0 with the resource's JSON in OUT, 1 when it does not exist (the error
# says NOT_FOUND or "was not found"); any other failure ends the script.
lookup() {
    local out=$1 err
    shift
    if "$@" >"$out" 2>"$work/err"; then
        return 0
    fi
    err=$(<"$work/err")
    if [[ $err == *NOT_FOUND* || $err == *"was not found"* ]]; then
        return 1
    fi
    printf '%s\n' "$err" >&2
    die "'$1 ${2:-} ${3:-} ${4:-}' failed (above); fix that and rerun"
}

# --- 0. checks before any change -----------------------------------------------------------

tree=$(py "$PY_GIT_TREE" "$private_values")
if [[ -n $tree ]]; then
    die "--private-values $private_values is inside the git work tree $tree; the key must" \
        "stay out of any repository: pass a path outside it (default \$HOME/.levers9/)"
fi

# The key id the file holds (read now, so a file that is not ours stops us before any change).
key_id=""
if [[ -e $private_values ]]; then
    key_id=$(py "$PY_KEY_ID" "$private_values" "$pool_name") || exit 1
fi

say "reading GKE cluster $cluster ($project, $region)"
run "$work/cluster.json" gcloud container clusters describe "$cluster" \
    --region "$region" --project "$project" --format=json
network="" authorized_enabled="" authorized=""
facts=$(py "$PY_CLUSTER" "$cluster" "$accelerator" "$node_tag" <"$work/cluster.json") || exit 1
while IFS= read -r line; do
    case ${line%%=*} in
    accelerator) accelerator=${line#*=} ;;
    network) network=${line#*=} ;;
    node_tag) node_tag=${line#*=} ;;
    authorized_enabled) authorized_enabled=${line#*=} ;;
    authorized) authorized=${line#*=} ;;
    esac
done <<<"$facts"

# --- 1. service account and its role -------------------------------------------------------

if lookup "$work/sa.json" gcloud iam service-accounts describe "$sa_email" \
    --project "$project" --format=json; then
    say "service account $sa_email: exists, kept"
else
    run /dev/null gcloud iam service-accounts create "$SA_ID" --project "$project" \
        --display-name "levers9 controlplane" --format=json
    say "service account $sa_email: created"
fi

run "$work/policy.json" gcloud projects get-iam-policy "$project" --format=json
if py 'import json, sys
m, r = sys.argv[1:3]
sys.exit(0 if any(b.get("role") == r and m in b.get("members", []) and not b.get("condition")
                  for b in json.load(sys.stdin).get("bindings", [])) else 1)' \
    "serviceAccount:$sa_email" "$ROLE" <"$work/policy.json"; then
    say "role $ROLE for $sa_email: held, kept"
else
    run /dev/null gcloud projects add-iam-policy-binding "$project" \
        --member "serviceAccount:$sa_email" --role "$ROLE" --condition=None --format=none
    say "role $ROLE for $sa_email: granted"
fi

# --- 2. its key, in the private values file only -------------------------------------------

run "$work/keys.json" gcloud iam service-accounts keys list --iam-account "$sa_email" \
    --project "$project" --managed-by=user --format=json
if [[ -n $key_id ]] && py "$PY_KEY_LISTED" "$key_id" <"$work/keys.json"; then
    chmod 600 "$private_values"
    say "key $key_id: still listed, kept (in $private_values)"
else
    if [[ -n $key_id ]]; then
        say "key $key_id in $private_values is no longer listed for $sa_email; making a new one"
    fi
    if [[ -n $values_dir_ours ]]; then
        # Our own directory (the default): private, whatever made it before.
        mkdir -p "$values_dir_ours"
        chmod 700 "$values_dir_ours"
    fi
    run /dev/null gcloud iam service-accounts keys create "$work/key.json" \
        --iam-account "$sa_email" --project "$project" --key-file-type=json
    key_id=$(py "$PY_VALUES_WRITE" "$private_values" "$pool_name" "$cluster" <"$work/key.json") ||
        exit 1
    rm -f "$work/key.json"
    say "key $key_id: created, written to $private_values (mode 0600)"
    if py 'import json, sys; sys.exit(0 if json.load(sys.stdin) else 1)' <"$work/keys.json"; then
        say "the older keys of $sa_email stay valid; delete the unused ones with" \
            "gcloud iam service-accounts keys delete"
    fi
fi

# --- 3. the registry the nodes pull from ---------------------------------------------------

if lookup /dev/null gcloud artifacts repositories describe "$REPOSITORY" \
    --location "$region" --project "$project" --format=json; then
    say "registry $registry_host/$project/$REPOSITORY: exists, kept"
else
    run /dev/null gcloud artifacts repositories create "$REPOSITORY" \
        --repository-format=docker --location "$region" --project "$project" \
        --description "levers9 worker images"
    say "registry $registry_host/$project/$REPOSITORY: created"
fi

# --- 4. the worker image, copied every run (that is the update) ----------------------------

# Registry tokens go to an auth file in the work dir, not the user's, and vanish with it.
# The ECR token is asked for in the registry's own region (from its host name), which need
# not be the EKS cluster's.
authfile=$work/auth.json
aws ecr get-login-password --region "$ecr_region" |
    skopeo login --authfile "$authfile" --username AWS --password-stdin "$ecr_host" >/dev/null ||
    die "could not log skopeo in to $ecr_host (aws ecr get-login-password --region $ecr_region)"
gcloud auth print-access-token |
    skopeo login --authfile "$authfile" --username oauth2accesstoken --password-stdin \
        "$registry_host" >/dev/null ||
    die "could not log skopeo in to $registry_host (gcloud auth print-access-token)"
# --all: copy every platform of an index, not just the one matching this machine.
skopeo copy --all --authfile "$authfile" "docker://$worker_image" "docker://$worker_dst" >&2 ||
    die "could not copy $worker_image to $worker_dst (skopeo's message above)"
say "image $worker_image: copied to $worker_dst"

# --- 5. the controlplane's egress IPs ------------------------------------------------------

run "$work/nodes.json" kubectl --context "$eks_context" get nodes -o json
out=$(py "$PY_NODE_IPS" <"$work/nodes.json") || die "could not read the EKS nodes' addresses"
node_ips=()
[[ -z $out ]] || mapfile -t node_ips <<<"$out"
run "$work/eks.json" aws eks describe-cluster --name "$eks_cluster" --region "$aws_region" \
    --output json
vpc=$(py "$PY_VPC" <"$work/eks.json") || die "could not read the VPC of EKS cluster $eks_cluster"
run "$work/nat.json" aws ec2 describe-nat-gateways --region "$aws_region" \
    --filter "Name=vpc-id,Values=$vpc" "Name=state,Values=available" --output json
out=$(py "$PY_NAT_IPS" <"$work/nat.json") || die "could not read the NAT gateways of $vpc"
nat_ips=()
[[ -z $out ]] || mapfile -t nat_ips <<<"$out"
egress=("${node_ips[@]}" "${nat_ips[@]}")
((${#egress[@]})) ||
    die "found no egress IP of the controlplane: no EKS node in context $eks_context has an" \
        "ExternalIP and VPC $vpc has no available NAT gateway"
say "controlplane egress: ${#node_ips[@]} node IP(s) ${node_ips[*]}," \
    "${#nat_ips[@]} NAT IP(s) ${nat_ips[*]}"

# --- 6. the cluster API's authorized networks ----------------------------------------------

if [[ $authorized_enabled != yes ]]; then
    # Turning them on with only the controlplane listed would lock everyone else out.
    say "authorized networks of $cluster: off (the API takes any address), left as they are"
else
    merge "$authorized" "${egress[@]}"
    if [[ -n $added ]]; then
        run /dev/null gcloud container clusters update "$cluster" --region "$region" \
            --project "$project" --enable-master-authorized-networks \
            --master-authorized-networks="$merged"
        say "authorized networks of $cluster: appended ${added//,/ }"
    else
        say "authorized networks of $cluster: hold every egress IP, kept"
    fi
fi

# --- 7. the firewall rule that lets the controlplane dial the workers ----------------------

# Target: the network tag of the GPU nodes. A node pool's own tags (config.tags) are what an
# operator set deliberately, so they win; without them, every GKE node carries the tag GKE
# derives from the cluster id (gke-<cluster>-<first 8 of id>-node), which limits the rule to
# this cluster's nodes. --node-tag overrides both. The sources are only the controlplane's
# addresses and the port only the agent's, so a broad tag opens little.
if lookup "$work/firewall.json" gcloud compute firewall-rules describe "$firewall_rule" \
    --project "$project" --format=json; then
    out=$(py "$PY_FIREWALL" "$agent_port" <"$work/firewall.json") ||
        die "could not read firewall rule $firewall_rule"
    read -r sources allows_port <<<"$out"
    [[ $sources != - ]] || sources=""
    if [[ $allows_port != yes ]]; then
        say "warning: firewall rule $firewall_rule does not allow tcp:$agent_port; it was" \
            "made with another --agent-port; fix it by hand (this script only appends sources)"
    fi
    merge "$sources" "${egress[@]}"
    if [[ -n $added ]]; then
        run /dev/null gcloud compute firewall-rules update "$firewall_rule" \
            --project "$project" --source-ranges="$merged"
        say "firewall rule $firewall_rule: appended ${added//,/ }"
    else
        say "firewall rule $firewall_rule: holds every egress IP, kept"
    fi
else
    merge "" "${egress[@]}"
    run /dev/null gcloud compute firewall-rules create "$firewall_rule" --project "$project" \
        --network "$network" --direction INGRESS --allow "tcp:$agent_port" \
        --source-ranges="$merged" --target-tags="$node_tag" \
        --description "levers9 controlplane dials its workers on $cluster"
    say "firewall rule $firewall_rule: created (tcp:$agent_port from ${merged//,/ }" \
        "to nodes tagged $node_tag on network $network)"
fi

# --- 8. the values block -------------------------------------------------------------------

py "$PY_BLOCK" "$pool_name" "$accelerator" "$worker_dst" "$private_values" "$cluster" \
    <"$work/cluster.json"
say "done: paste the block above, as it is, under config.worker.pools; the key is in" \
    "$private_values"
