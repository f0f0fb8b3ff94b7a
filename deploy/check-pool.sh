#!/usr/bin/env bash
# Check that a levers9 pool takes work: its machines, a GPU job and, with --full, an endpoint,
# a box port, a snapshot restore and a multi-card job (what a tunnel pool should pass before
# anyone relies on it).
#
# Every job is submitted with --detach and followed by reading its task record, never through
# `levers9 run`'s own wait: that wait is shorter than a cold start (the image pull), so it may
# print DEADLINE_EXCEEDED while the task goes on and succeeds. The controlplane and token are
# LEVERS9_CONTROLPLANE and LEVERS9_TOKEN when exported, else the CLI's current context (what
# `levers9 login` stored). The token never appears in a process's arguments: the CLI reads it
# itself, and curl gets its header on stdin.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: deploy/check-pool.sh [options]

Checks that the pool behind the controlplane takes work, step by step, printing
"ok   <step>" or "FAIL <step>: <why and what to do>" and a summary. Exit 0 only when every
step passes, 1 when one fails, 2 for a mistake on the command line.

  1. machines      `levers9 machine list` shows at least one machine
  2. GPU job       a job with --gpus N cards succeeds and sees N cards
With --full, also:
  3. endpoint      HTTP/2 GET through the controlplane's /v1/tasks/ID/ports/8080/ gives 200
  4. box port      a line sent through `levers9 port ID 9000` comes back
  5. snapshot      a file a task wrote is there in a task started from its snapshot
  6. multi-card    a job with --multi cards succeeds and sees them all

Jobs are followed through their task record (`levers9 task get`), not `levers9 run`'s wait,
which is shorter than a cold start and may print DEADLINE_EXCEEDED while the task succeeds.

Options:
  --image IMAGE       image of the GPU jobs; needs sh (default nvidia/cuda:12.4.1-base-ubuntu22.04,
                      whose nvidia-smi lists the cards)
  --gpus N            cards of the GPU job (default 1)
  --timeout SECONDS   how long a task may take to finish, or to start serving (default 900: a
                      cold start pulls the image)
  --full              also check an endpoint, a box port, a snapshot restore, a multi-card job
  --multi N           cards of the multi-card job (default 2)
  --serve-image IMAGE image of the serving and snapshot tasks; needs sh (default busybox:1.36)
  --serve-cmd CMD     shell command (run with sh -c) that serves HTTP on port 8080 and echoes
                      each line it gets on port 9000 back. The default needs busybox's httpd
                      and nc (as in the busybox image); give your own for another image:
                        mkdir -p /www && echo levers9 > /www/index.html &&
                        (nc -ll -p 9000 -e cat &) && exec httpd -f -p 8080 -h /www
  --keep              leave the tasks it started running (default: cancel them on exit)
  -h, --help          show this help

Environment (without LEVERS9_CONTROLPLANE and LEVERS9_TOKEN, the CLI's current context,
as `levers9 login URL --ca FILE` stored it, is used):
  LEVERS9_CONTROLPLANE  the controlplane's URL (https://...)
  LEVERS9_TOKEN         a workspace token; read by the CLI and sent to the endpoint by curl
                        through its stdin, never on a command line
  LEVERS9_CA            CA file for the controlplane's certificate (optional)
  LEVERS9_CLI           the levers9 command (default levers9 from PATH), split on spaces,
                        e.g. "python -m control.cli"

Needs bash, python3 (reads the JSON) and, with --full, curl with HTTP/2.
USAGE
}

die_usage() {
    echo "check-pool.sh: $1; see 'check-pool.sh --help'" >&2
    exit 2
}

# -- options -------------------------------------------------------------------------------------

IMAGE="nvidia/cuda:12.4.1-base-ubuntu22.04"
GPUS=1
TIMEOUT_S=900
FULL=false
MULTI=2
SERVE_IMAGE="busybox:1.36"
SERVE_CMD='mkdir -p /www && echo levers9 check-pool > /www/index.html && '
SERVE_CMD+='(nc -ll -p 9000 -e cat &) && exec httpd -f -p 8080 -h /www'
KEEP=false

need_value() {
    [[ $# -ge 2 && -n "$2" ]] || die_usage "$1 needs a value"
}

need_count() {
    [[ "$2" =~ ^[0-9]+$ && "$2" -ge 1 ]] || die_usage "$1: '$2' is not a whole number of at least 1"
}

while [[ $# -gt 0 ]]; do
    case "$1" in
    -h | --help)
        usage
        exit 0
        ;;
    --image)
        need_value "$@"
        IMAGE="$2"
        shift 2
        ;;
    --gpus)
        need_value "$@"
        need_count "$1" "$2"
        GPUS="$2"
        shift 2
        ;;
    --timeout)
        need_value "$@"
        need_count "$1" "$2"
        TIMEOUT_S="$2"
        shift 2
        ;;
    --full)
        FULL=true
        shift
        ;;
    --multi)
        need_value "$@"
        need_count "$1" "$2"
        MULTI="$2"
        shift 2
        ;;
    --serve-image)
        need_value "$@"
        SERVE_IMAGE="$2"
        shift 2
        ;;
    --serve-cmd)
        need_value "$@"
        SERVE_CMD="$2"
        shift 2
        ;;
    --keep)
        KEEP=true
        shift
        ;;
    *)
        die_usage "unknown argument '$1'"
        ;;
    esac
done

read -r -a CLI <<<"${LEVERS9_CLI:-levers9}"
[[ ${#CLI[@]} -gt 0 ]] || die_usage "LEVERS9_CLI is empty; unset it to use levers9 from PATH"
if ! command -v "${CLI[0]}" >/dev/null 2>&1; then
    echo "check-pool.sh: '${CLI[0]}' is not on PATH; install the levers9 CLI or point" \
        "LEVERS9_CLI at it" >&2
    exit 2
fi
if [[ -n "${LEVERS9_CONTROLPLANE:-}${LEVERS9_TOKEN:-}" ]]; then
    for name in LEVERS9_CONTROLPLANE LEVERS9_TOKEN; do
        # Only the variable's name is ever printed, never its value.
        if [[ -z "${!name:-}" ]]; then
            echo "check-pool.sh: $name is not set; export both LEVERS9_CONTROLPLANE and" \
                "LEVERS9_TOKEN, or neither to use the CLI's context (see 'check-pool.sh --help')" >&2
            exit 2
        fi
    done
fi
TOOLS=(python3)
if $FULL; then
    TOOLS+=(curl)
fi
for tool in "${TOOLS[@]}"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "check-pool.sh: $tool is not on PATH; install it or add its directory to PATH" >&2
        exit 2
    fi
done

# -- bookkeeping ---------------------------------------------------------------------------------

WORK="$(mktemp -d "${TMPDIR:-/tmp}/check-pool.XXXXXX")"
STARTED=()           # ids of the tasks this run started, cancelled on exit unless --keep
ENDED=" "            # ids seen in a terminal state, space-separated: nothing to cancel
FORWARDER=""         # pid of a running `levers9 port`
PASSED=0
FAILED=0

cleanup() {
    local rc=$? id state
    if [[ -n "$FORWARDER" ]]; then
        kill "$FORWARDER" 2>/dev/null || true
        wait "$FORWARDER" 2>/dev/null || true
    fi
    if [[ ${#STARTED[@]} -gt 0 ]]; then
        if $KEEP; then
            echo "kept (--keep): ${STARTED[*]}; stop each with 'levers9 task cancel ID'"
        else
            for id in "${STARTED[@]}"; do
                [[ "$ENDED" != *" $id "* ]] || continue
                state="$(l9 task get "$id" --json 2>/dev/null | task_fields 2>/dev/null |
                    cut -d $'\x1f' -f1)" || state=""
                case "$state" in
                succeeded | failed | cancelled | lost) ;;
                *)
                    if l9 task cancel "$id" >/dev/null 2>"$WORK/cancel.err"; then
                        echo "cancelled task $id (pass --keep to leave what the check starts)"
                    else
                        echo "could not cancel task $id: $(last_line "$WORK/cancel.err");" \
                            "cancel it with 'levers9 task cancel $id'"
                    fi
                    ;;
                esac
            done
        fi
    fi
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Where to reach the controlplane, as whom: the environment, else the CLI's current context
# (its CA into a file of the work dir; the token only in this shell's memory).
if [[ -n "${LEVERS9_CONTROLPLANE:-}" ]]; then
    CP_URL="$LEVERS9_CONTROLPLANE"
    CP_TOKEN="$LEVERS9_TOKEN"
    CP_CA="${LEVERS9_CA:-}"
else
    # The context's JSON goes from the CLI to python3 through a pipe: never a file.
    CP_URL="" CP_TOKEN="" CP_CA=""
    {
        read -r CP_URL || true
        read -r CP_TOKEN || true
        read -r CP_CA || true
    } < <("${CLI[@]}" context show --token 2>"$WORK/context.err" | python3 -c '
import json, sys
context = json.load(sys.stdin)
ca = sys.argv[1] if context.get("ca") else ""
if ca:
    open(ca, "w").write(context["ca"])
print(context["controlplane"])
print(context["token"])
print(ca)
' "$WORK/ca.pem" 2>/dev/null)
    if [[ -z "$CP_URL" || -z "$CP_TOKEN" ]]; then
        why="$(tail -n 1 "$WORK/context.err")"
        echo "check-pool.sh: no controlplane to check${why:+: $why}; log in with" \
            "'levers9 login URL --ca FILE', or export LEVERS9_CONTROLPLANE and LEVERS9_TOKEN" >&2
        exit 2
    fi
fi

l9() {
    "${CLI[@]}" "$@"
}

ok() {
    PASSED=$((PASSED + 1))
    echo "ok   $1"
}

fail() {
    FAILED=$((FAILED + 1))
    echo "FAIL $1: $2"
}

detail() {
    sed 's/^/     /'
}

last_line() {
    # The last non-empty line of a file: the CLI's one-line error.
    grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 1 || true
}

# TaskView JSON on stdin -> state, exitCode, reason, waiting, node, cardIds (comma-joined),
# separated by the unit separator so that empty fields survive `read`.
task_fields() {
    python3 -c '
import json, sys
view = json.load(sys.stdin)
def text(value):
    return "" if value is None else " ".join(str(value).split())
cards = ",".join(view.get("cardIds") or [])
fields = [view.get("state"), view.get("exitCode"), view.get("reason"), view.get("waiting"),
          view.get("node"), cards]
print("\x1f".join(text(f) for f in fields))
'
}

# wait_task ID UNTIL: read the task record every second until the task has ended
# (UNTIL=end) or is running or ended (UNTIL=running), at most --timeout seconds. Sets
# T_STATE, T_EXIT, T_REASON, T_WAITING, T_NODE, T_CARDS and T_ERROR (the last error reading
# the record). Returns 0 when reached, 1 when the time ran out.
wait_task() {
    local id="$1" until="$2" deadline=$((SECONDS + TIMEOUT_S)) json
    T_STATE="" T_EXIT="" T_REASON="" T_WAITING="" T_NODE="" T_CARDS="" T_ERROR=""
    while :; do
        if json="$(l9 task get "$id" --json 2>"$WORK/get.err")"; then
            IFS=$'\x1f' read -r T_STATE T_EXIT T_REASON T_WAITING T_NODE T_CARDS \
                < <(task_fields <<<"$json") || true
            T_ERROR=""
        else
            # A slow answer is not the end: keep reading until the deadline.
            T_ERROR="$(last_line "$WORK/get.err")"
        fi
        case "$T_STATE" in
        succeeded | failed | cancelled | lost)
            ENDED+="$id "
            return 0
            ;;
        running)
            [[ "$until" == running ]] && return 0
            ;;
        esac
        [[ $SECONDS -lt $deadline ]] || return 1
        sleep 1
    done
}

# Why a task did not get where it should in time, and what to do.
late_reason() {
    local id="$1"
    local why="task $id still ${T_STATE:-unknown} after ${TIMEOUT_S} s"
    [[ -z "$T_WAITING" ]] || why+=": $T_WAITING"
    [[ -z "$T_ERROR" ]] || why+=" (last read of its record: $T_ERROR)"
    if [[ "$T_STATE" == pending ]]; then
        why+="; it needs one worker with all its cards free: see the free cards in"
        why+=" 'levers9 machine list', or give a longer --timeout while a worker still starts"
    else
        why+="; a cold start pulls the image: give a longer --timeout, and see"
        why+=" 'levers9 task get $id'"
    fi
    echo "$why"
}

ended_reason() {
    local id="$1"
    local why="task $id ${T_STATE}"
    [[ -z "$T_EXIT" ]] || why+=" with exit code $T_EXIT"
    [[ -z "$T_REASON" ]] || why+=": $T_REASON"
    echo "$why; read its logs with 'levers9 task logs $id'"
}

# start NAME ARGS...: `levers9 run --detach ARGS`; the task id in TASK_ID, or FAIL NAME.
start() {
    local what="$1"
    shift
    if ! TASK_ID="$(l9 run --detach "$@" 2>"$WORK/run.err")" || [[ -z "$TASK_ID" ]]; then
        fail "$what" "levers9 run was refused: $(last_line "$WORK/run.err")"
        return 1
    fi
    STARTED+=("$TASK_ID")
    return 0
}

# -- steps ---------------------------------------------------------------------------------------

check_machines() {
    local listing count
    if ! l9 machine list >"$WORK/machines" 2>"$WORK/machines.err"; then
        fail "machine list" "$(last_line "$WORK/machines.err"); check the controlplane, the \
token (a workspace token) and the CA: LEVERS9_CONTROLPLANE, LEVERS9_TOKEN and LEVERS9_CA, or the \
CLI's context ('levers9 context list')"
        return 1
    fi
    detail <"$WORK/machines"
    detail <"$WORK/machines.err"
    listing="$(l9 machine list --json 2>"$WORK/machines.err")" || listing="[]"
    count="$(python3 -c 'import json, sys; print(len(json.load(sys.stdin)))' <<<"$listing")"
    if [[ "$count" -eq 0 ]]; then
        fail "machine list" "no machines: check the pool's selector, \`levers9 cluster list\`"
        return 1
    fi
    ok "machine list: $count machine(s)"
}

# A job that prints the cards it sees; ok when it succeeds with as many as it asked.
check_gpu_job() {
    local what="$1" cards="$2" id seen count
    # shellcheck disable=SC2016 # the task's shell expands it, not this one
    start "$what" --gpus "$cards" "$IMAGE" -- \
        sh -c 'echo cards=$NVIDIA_VISIBLE_DEVICES; nvidia-smi -L || true' || return 1
    id="$TASK_ID"
    echo "     task $id: waiting for it to end (at most ${TIMEOUT_S} s)"
    if ! wait_task "$id" end; then
        fail "$what" "$(late_reason "$id")"
        return 1
    fi
    echo "     task $id $T_STATE (exit ${T_EXIT:--}) on node ${T_NODE:--}, cards ${T_CARDS:--}"
    l9 task logs "$id" >"$WORK/logs" 2>&1 || true
    detail <"$WORK/logs"
    if [[ "$T_STATE" != succeeded ]]; then
        fail "$what" "$(ended_reason "$id")"
        return 1
    fi
    seen="$(sed -n 's/^cards=//p' "$WORK/logs" | tail -n 1)"
    count="$(tr ',' '\n' <<<"$seen" | grep -c . || true)"
    # "all", "none" or "void" would hand over the node's cards or none, not the assigned ones.
    if [[ "$count" -ne "$cards" || "$seen" =~ ^(all|none|void)$ ]]; then
        fail "$what" "the job asked for $cards card(s) but NVIDIA_VISIBLE_DEVICES named $count \
('$seen'); compare the machine's cards in 'levers9 machine list' and read its worker pod's log"
        return 1
    fi
    ok "$what: $cards card(s) seen ($seen)"
}

SERVER_ID=""

# Start a task (the arguments after the first three go to `levers9 run`) and wait until it
# runs; TASK_ID names it. A task still not running, or one that ended, fails STEP with the
# record's reason, ENDED before it and SUFFIX after.
start_running() {
    local what=$1 ended=$2 suffix=$3
    shift 3
    start "$what" "$@" || return 1
    echo "     task $TASK_ID: waiting for it to run (at most ${TIMEOUT_S} s)"
    if ! wait_task "$TASK_ID" running; then
        fail "$what" "$(late_reason "$TASK_ID")"
        return 1
    fi
    if [[ "$T_STATE" != running ]]; then
        fail "$what" "$ended: $(ended_reason "$TASK_ID")$suffix"
        return 1
    fi
}

# A task serving HTTP on 8080 (and echo on 9000), then a GET through its endpoint URL.
check_endpoint() {
    local what="endpoint" id url code version deadline
    start_running "$what" "the serving task ended" "; check --serve-cmd" \
        --port 8080 --port 9000 "$SERVE_IMAGE" -- sh -c "$SERVE_CMD" || return 1
    id="$TASK_ID"
    SERVER_ID="$id"
    url="${CP_URL%/}/v1/tasks/$id/ports/8080/"
    local args=(--http2 --silent --show-error --max-time 10 --output "$WORK/page"
        --write-out '%{http_code} %{http_version}')
    [[ -z "$CP_CA" ]] || args+=(--cacert "$CP_CA")
    # The server may still be starting inside the task: retry for a while.
    deadline=$((SECONDS + 60))
    while :; do
        # printf is a builtin: the header reaches curl on stdin, not in any argv.
        read -r code version < <(printf 'Authorization: Bearer %s\n' "$CP_TOKEN" |
            curl "${args[@]}" -H @- "$url" 2>"$WORK/curl.err" || true) || true
        [[ "$code" != 200 && $SECONDS -lt $deadline ]] || break
        sleep 1
    done
    if [[ "$code" != 200 ]]; then
        local why="GET $url gave ${code:-no answer}"
        [[ ! -s "$WORK/curl.err" ]] || why+=" ($(last_line "$WORK/curl.err"))"
        [[ ! -s "$WORK/page" ]] || why+=": $(head -c 300 "$WORK/page" | tr '\n' ' ')"
        fail "$what" "$why; the task must serve HTTP on 8080 (--serve-cmd); see \
'levers9 task logs $id'"
        return 1
    fi
    ok "$what: GET .../v1/tasks/$id/ports/8080/ gave 200 over HTTP/$version"
}

# `levers9 port` to a free local port, a line through it and back.
check_box_port() {
    local what="box port" id="$SERVER_ID" lport="" deadline reply line
    if [[ -z "$id" ]]; then
        fail "$what" "no serving task (see the endpoint step)"
        return 1
    fi
    "${CLI[@]}" port "$id" 9000 --local 127.0.0.1:0 >"$WORK/port.out" 2>"$WORK/port.err" &
    FORWARDER=$!
    deadline=$((SECONDS + 30))
    while [[ -z "$lport" && $SECONDS -lt $deadline ]] && kill -0 "$FORWARDER" 2>/dev/null; do
        lport="$(sed -n 's/^forwarding 127\.0\.0\.1:\([0-9][0-9]*\) .*/\1/p' "$WORK/port.err")"
        [[ -n "$lport" ]] || sleep 0.2
    done
    if [[ -z "$lport" ]]; then
        fail "$what" "levers9 port did not start forwarding: $(last_line "$WORK/port.err")"
        return 1
    fi
    line="levers9-check-$RANDOM$RANDOM"
    reply=""
    deadline=$((SECONDS + 30))
    while [[ "$reply" != "$line" && $SECONDS -lt $deadline ]]; do
        reply="$(python3 -c '
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10) as sock:
    sock.sendall(sys.argv[2].encode() + b"\n")
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
print(data.decode(errors="replace").strip())
' "$lport" "$line" 2>"$WORK/echo.err")" || reply=""
        [[ "$reply" == "$line" ]] || sleep 1
    done
    kill "$FORWARDER" 2>/dev/null || true
    wait "$FORWARDER" 2>/dev/null || true
    FORWARDER=""
    if [[ "$reply" != "$line" ]]; then
        local why="a line sent to 127.0.0.1:$lport did not come back (got '${reply}')"
        [[ ! -s "$WORK/echo.err" ]] || why+=": $(last_line "$WORK/echo.err")"
        [[ ! -s "$WORK/port.err" ]] || why+="; levers9 port said: $(last_line "$WORK/port.err")"
        fail "$what" "$why; the task must echo lines on port 9000 (--serve-cmd)"
        return 1
    fi
    ok "$what: a line through 127.0.0.1:$lport -> $id:9000 came back"
}

# A task that wrote a file, its snapshot, and a task started from it reading the file.
check_snapshot() {
    local what="snapshot restore" id digest restored mark deadline
    mark="levers9-check-$RANDOM$RANDOM"
    start_running "$what" "the writing task ended" "" \
        "$SERVE_IMAGE" -- sh -c "echo $mark > /levers9-check.txt && echo written && \
trap 'exit 0' TERM && while :; do sleep 1; done" || return 1
    id="$TASK_ID"
    deadline=$((SECONDS + 60))
    # Into a file first: grep -q leaving early would fail the pipeline under pipefail.
    until l9 task logs "$id" >"$WORK/logs" 2>/dev/null && grep -qx written "$WORK/logs"; do
        if [[ $SECONDS -ge $deadline ]]; then
            fail "$what" "task $id did not print 'written' within 60 s; see 'levers9 task logs $id'"
            return 1
        fi
        sleep 1
    done
    if ! digest="$(l9 task snapshot "$id" 2>"$WORK/snapshot.err")" || [[ -z "$digest" ]]; then
        fail "$what" "levers9 task snapshot $id failed: $(last_line "$WORK/snapshot.err")"
        return 1
    fi
    echo "     task $id: snapshot $digest"
    start "$what" --snapshot "$digest" "$SERVE_IMAGE" -- cat /levers9-check.txt || return 1
    restored="$TASK_ID"
    echo "     task $restored: started from it, waiting for it to end (at most ${TIMEOUT_S} s)"
    if ! wait_task "$restored" end; then
        fail "$what" "$(late_reason "$restored")"
        return 1
    fi
    l9 task logs "$restored" >"$WORK/logs" 2>&1 || true
    detail <"$WORK/logs"
    if [[ "$T_STATE" != succeeded ]]; then
        fail "$what" "$(ended_reason "$restored")"
        return 1
    fi
    if ! grep -qx "$mark" "$WORK/logs"; then
        fail "$what" "task $restored did not find the file task $id wrote; the snapshot \
$digest was restored without it"
        return 1
    fi
    ok "$what: task $restored read back what task $id wrote (snapshot ${digest:0:19}...)"
}

# -- run -----------------------------------------------------------------------------------------

echo "checking the pool behind $CP_URL"
if check_machines; then
    check_gpu_job "GPU job ($GPUS card(s))" "$GPUS" || true
    if $FULL; then
        check_endpoint || true
        check_box_port || true
        check_snapshot || true
        check_gpu_job "multi-card job ($MULTI cards)" "$MULTI" || true
    fi
fi

echo "summary: $PASSED passed, $FAILED failed"
if [[ $FAILED -gt 0 ]]; then
    exit 1
fi
echo "the pool takes work"
