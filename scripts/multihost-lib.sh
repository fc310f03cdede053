# shellcheck shell=bash
# Checks and fault drills on a cluster of network namespaces (scripts/cluster.sh), shared by
# scripts/test-multihost.sh (CI: the fast ones) and scripts/multihost-faults.sh (all, opt-in).
# Source it from the repository root; call mh_setup first. Each mh_check_* / mh_drill_* runs
# one job and returns 0 when every expectation held (and prints why not otherwise); the
# drills also require the job to end within a bound and nothing (mpirun, orted, tp) to be
# left on the hosts afterwards. See docs/multi-host.md.

CLUSTER=scripts/cluster.sh
MH_PASSED=0
MH_FAILED=0
MH_FAILED_NAMES=()
# 1: print every job's output (the faults script); 0: only on failure.
MH_SHOW=${MH_SHOW:-0}
MH_HOSTS=2

mh_log() { echo "multihost: $*"; }

# Whether network namespaces can be made here (root with CAP_NET_ADMIN); prints why not.
mh_can_make_namespaces() {
    local probe="${TP_CLUSTER:-tpc}-probe" out
    if ! command -v ip >/dev/null; then
        echo "the ip command is missing (apt-get install iproute2)"
        return 2
    fi
    if ! out=$(ip netns add "$probe" 2>&1); then
        echo "cannot create a network namespace: ${out:-ip netns add failed} (needs root with CAP_NET_ADMIN)"
        return 1
    fi
    ip netns del "$probe" 2>/dev/null || true
}

# TP (absolute path of the binary), MODEL, A1/A2 (host addresses), WORK (scratch dir).
mh_setup() {
    TP=$(realpath "$1")
    MODEL=$(realpath "$2")
    [[ -x $TP ]] || { mh_log "no tp binary at $1"; return 1; }
    [[ -f $MODEL ]] || { mh_log "no model at $2 (run scripts/fetch-models.sh)"; return 1; }
    WORK=$(mktemp -d /tmp/tp-multihost.XXXXXX)
    $CLUSTER up "$MH_HOSTS" || return 1
    A1=$($CLUSTER addr 1)
    A2=$($CLUSTER addr 2)
}

mh_teardown() {
    $CLUSTER down >/dev/null 2>&1 || $CLUSTER down
    [[ -n ${WORK:-} && -d $WORK ]] && rm -rf "$WORK"
    return 0
}

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
within() { awk -v t="$1" -v lim="$2" 'BEGIN { exit !(t <= lim) }'; }

# Starts `cluster.sh run` in the background (killed after LIMIT seconds whatever happens);
# its stdout goes to $WORK/NAME.out, stderr to $WORK/NAME.err. Sets JOB (pid) and JOB_T0.
# Usage: mh_start NAME LIMIT [ENV=VALUE...] -- RUN-ARGS...
mh_start() {
    local name=$1 limit=$2
    shift 2
    local envs=()
    while [[ $# -gt 0 && $1 != -- ]]; do
        envs+=("$1")
        shift
    done
    shift
    JOB_NAME=$name
    JOB_LIMIT=$limit
    JOB_T0=$(now)
    env "${envs[@]}" timeout -k 5 "$limit" $CLUSTER run "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" &
    JOB=$!
}

# Waits for the job; sets RC, TOOK (seconds since the start, or since MARK when given) and
# OUT (stdout and stderr together).
mh_wait() {
    local mark=${1:-$JOB_T0}
    wait "$JOB"
    RC=$?
    TOOK=$(secs "$mark" "$(now)")
    JOB_TOTAL=$(secs "$JOB_T0" "$(now)")
    OUT=$(cat "$WORK/$JOB_NAME.out" "$WORK/$JOB_NAME.err")
    if [[ $MH_SHOW == 1 ]]; then
        echo "---- $JOB_NAME: exit $RC after $TOOK s; output:"
        sed 's/^/    /' "$WORK/$JOB_NAME.out" "$WORK/$JOB_NAME.err"
        echo "----"
    fi
}

mh_run() {
    mh_start "$@"
    mh_wait
}

# Fails (with the output shown) unless OUT contains TEXT.
expect_text() {
    if ! grep -qF -- "$1" <<<"$OUT"; then
        echo "expected \"$1\" in the output of $JOB_NAME"
        return 1
    fi
}

expect_failed_within() {
    local limit=$1
    if [[ $RC -eq 0 ]]; then
        echo "$JOB_NAME exited 0, expected a failure"
        return 1
    fi
    if ! within "$JOB_TOTAL" "$((JOB_LIMIT - 1))"; then
        echo "$JOB_NAME hung: killed after its time limit of $JOB_LIMIT s"
        return 1
    fi
    if ! within "$TOOK" "$limit"; then
        echo "$JOB_NAME took $TOOK s, more than $limit s"
        return 1
    fi
}

# Nothing may run on the hosts once a job is over (waits up to 5 s for processes on their
# way out); leftovers are listed and removed by rebuilding the cluster.
expect_nothing_left() {
    local k left=""
    for _ in $(seq 1 50); do
        left=""
        for k in $(seq 1 "$MH_HOSTS"); do
            left+=$($CLUSTER pids "$k" | xargs -r ps -o pid=,comm= -p | sed "s/^/host $k: /")
        done
        [[ -z $left ]] && return 0
        sleep 0.1
    done
    echo "left running after $JOB_NAME:"
    sed 's/^/      /' <<<"$left"
    $CLUSTER up "$MH_HOSTS" >/dev/null
    return 1
}

# Runs check NAME (a function, in this shell) and counts it.
mh_case() {
    local name=$1 t0 rc why
    shift
    t0=$(now)
    JOB_NAME=""
    "$@" >"$WORK/case.log" 2>&1
    rc=$?
    why=$(cat "$WORK/case.log")
    if [[ $rc -eq 0 ]]; then
        MH_PASSED=$((MH_PASSED + 1))
        mh_log "PASS $name ($(secs "$t0" "$(now)") s)"
        [[ -z $why ]] || sed 's/^/    /' <<<"$why"
    else
        MH_FAILED=$((MH_FAILED + 1))
        MH_FAILED_NAMES+=("$name")
        mh_log "FAIL $name ($(secs "$t0" "$(now)") s)"
        [[ -z $why ]] || sed 's/^/    /' <<<"$why"
        if [[ $MH_SHOW != 1 && -n $JOB_NAME && -f $WORK/$JOB_NAME.out ]]; then
            echo "output of $JOB_NAME (last lines):"
            tail -n 40 "$WORK/$JOB_NAME.out" "$WORK/$JOB_NAME.err" | sed 's/^/      /'
        fi
    fi
}

mh_summary() {
    echo "multihost: $MH_PASSED passed, $MH_FAILED failed${MH_FAILED_NAMES:+ (${MH_FAILED_NAMES[*]})}"
    [[ $MH_FAILED -eq 0 ]]
}

# Greedy text over 2 hosts equals 2 local rank threads; rank 0 prints a load line per host.
mh_check_greedy_text() {
    local prompt="The three primary colors are" want
    local args=(generate --model "$MODEL" --greedy --max-tokens 24)
    want=$("$TP" "${args[@]}" -q --tp 2 "$prompt" 2>"$WORK/local.err") || {
        echo "local tp generate failed:"
        cat "$WORK/local.err"
        return 1
    }
    mh_run greedy 120 -- 2 -- "$TP" "${args[@]}" --backend mpi "$prompt"
    if [[ $RC -ne 0 ]]; then
        echo "tp generate --backend mpi on 2 hosts exited $RC"
        return 1
    fi
    local got
    got=$(cat "$WORK/greedy.out")
    if [[ $got != "$want" ]]; then
        echo "the texts differ: local threads: $(printf %q "$want")"
        echo "                  2 hosts:       $(printf %q "$got")"
        return 1
    fi
    [[ ${#want} -gt 20 ]] || {
        echo "suspiciously short text: $(printf %q "$want")"
        return 1
    }
    grep -qE "^# +0 +$A1 " "$WORK/greedy.err" && grep -qE "^# +1 +$A2 " "$WORK/greedy.err" || {
        echo "no load line per host ($A1, $A2) on stderr"
        return 1
    }
    echo "same $(wc -w <<<"$want") words; $(grep -F '# load:' "$WORK/greedy.err" | sed 's/^# //')"
}

# Each host's rank runs on CPUs of its own (cluster.sh pins hosts; without it every host's
# orted binds its rank to core 0 and the "hosts" share one core: slower, not faster, at 2).
mh_check_hosts_own_cpus() {
    local cores
    cores=$(nproc)
    mh_run cpus 30 -- 2 -- sh -c 'echo "$TP_HOST $(grep Cpus_allowed_list /proc/self/status | cut -f2)"'
    if [[ $RC -ne 0 ]]; then
        echo "cluster run exited $RC"
        return 1
    fi
    local a b
    a=$(awk -v h="$A1" '$1 == h {print $2}' "$WORK/cpus.out")
    b=$(awk -v h="$A2" '$1 == h {print $2}' "$WORK/cpus.out")
    [[ -n $a && -n $b ]] || {
        echo "no CPU list from both hosts: $(cat "$WORK/cpus.out")"
        return 1
    }
    if ((cores >= 2)) && [[ $a == "$b" ]]; then
        echo "both hosts' ranks run on CPUs $a of this $cores-core machine"
        return 1
    fi
    echo "host $A1 on CPUs $a, host $A2 on CPUs $b"
}

mh_check_conformance() {
    mh_run selftest 180 -- 2 -- "$TP" selftest --backend mpi
    [[ $RC -eq 0 ]] || {
        echo "tp selftest --backend mpi exited $RC"
        return 1
    }
    expect_text " passed, 0 failed" || return 1
    expect_text "conformance on 2 ranks" || return 1
    grep -E "^[0-9]+ passed, 0 failed" <<<"$OUT"
}

# The id of the tp process on host K (waits up to 60 s for it).
tp_pid_on() {
    local k=$1 p
    for _ in $(seq 1 600); do
        for p in $($CLUSTER pids "$k"); do
            if [[ $(cat "/proc/$p/comm" 2>/dev/null) == tp ]]; then
                echo "$p"
                return 0
            fi
        done
        sleep 0.1
    done
    return 1
}

# Starts a long generation on 2 hosts and returns once text is coming out (decode under way).
start_long_decode() {
    local name=$1 limit=$2
    shift 2
    mh_start "$name" "$limit" -- 2 -- "$TP" generate --model "$MODEL" --greedy --max-tokens 4000 \
        "$@" --backend mpi "Count from one to one thousand: one, two, three, four,"
    for _ in $(seq 1 600); do
        [[ $(wc -c <"$WORK/$name.out") -ge 16 ]] && return 0
        kill -0 "$JOB" 2>/dev/null || break
        sleep 0.1
    done
    echo "the generation never started (or ended at once)"
    return 1
}

# kill -9 of the tp process on host 2 mid-decode: the job ends in seconds naming rank 1's host.
mh_drill_rank_killed() {
    start_long_decode killed 120 || { mh_wait; return 1; }
    local pid mark
    pid=$(tp_pid_on 2) || { echo "no tp process on host 2"; mh_wait; return 1; }
    mark=$(now)
    kill -9 "$pid"
    mh_wait "$mark"
    expect_failed_within 15 || return 1
    expect_text "process rank 1 with PID $pid on node $A2 exited on signal 9" || return 1
    expect_text "rank 0 on $A1: ended by SIGTERM while in " || return 1
    expect_nothing_left || return 1
    echo "ended $TOOK s after the kill: $(grep -m1 -o "rank 0 on $A1: ended by SIGTERM while in [^(]*" <<<"$OUT")"
}

# tp serve over 2 hosts, a request streaming: kill -9 of host 2's rank. The client's stream ends
# with an SSE error event and [DONE] (not a cut connection), and the job ends in seconds.
mh_drill_serve_rank_killed() {
    local port=18080 url
    url=http://127.0.0.1:$port
    mh_start serve 120 -- 2 -- "$TP" serve --backend mpi --model "$MODEL" --port "$port"
    local up=0
    for _ in $(seq 1 300); do
        $CLUSTER exec 1 curl -sf -o /dev/null "$url/health" 2>/dev/null && { up=1; break; }
        kill -0 "$JOB" 2>/dev/null || break
        sleep 0.1
    done
    ((up)) || { echo "the server never answered /health"; mh_wait; return 1; }
    $CLUSTER exec 1 curl -sN --max-time 60 "$url/v1/completions" -H 'content-type: application/json' \
        -d '{"prompt":"Count from one to one thousand: one, two,","max_tokens":3000,"stream":true,"temperature":0}' \
        >"$WORK/serve-client.out" 2>&1 &
    local client=$! got=0
    for _ in $(seq 1 300); do
        [[ $(grep -c '^data: {"choices"' "$WORK/serve-client.out") -ge 5 ]] && { got=1; break; }
        sleep 0.1
    done
    ((got)) || { echo "no tokens streamed: $(head -c 300 "$WORK/serve-client.out")"; kill "$client"; mh_wait; return 1; }
    local pid mark
    pid=$(tp_pid_on 2) || { echo "no tp process on host 2"; kill "$client"; mh_wait; return 1; }
    mark=$(now)
    kill -9 "$pid"
    mh_wait "$mark"
    wait "$client"
    local crc=$?
    expect_failed_within 15 || return 1
    expect_text "process rank 1 with PID $pid on node $A2 exited on signal 9" || return 1
    local tail2
    tail2=$(grep -v '^$' "$WORK/serve-client.out" | tail -n 2)
    if ! grep -q '^data: {"error"' <<<"$tail2" || [[ $(tail -n 1 <<<"$tail2") != "data: [DONE]" ]]; then
        echo "the stream did not end with an error event and [DONE] (curl exit $crc); its end:"
        tail -c 400 "$WORK/serve-client.out"
        return 1
    fi
    expect_nothing_left || return 1
    echo "stream ended with: $(grep -o '"message":"[^"]*"' <<<"$tail2" | head -1); job ended $TOOK s after the kill"
}

# The link of host 2 is cut mid-decode (in the bridge's namespace): both sides time out.
mh_drill_link_cut() {
    start_long_decode cut 120 --timeout 5 || { mh_wait; return 1; }
    local mark
    mark=$(now)
    $CLUSTER link 2 down
    mh_wait "$mark"
    $CLUSTER link 2 up
    expect_failed_within 30 || return 1
    # mpirun's keepalive (scripts/cluster.sh) or tp's --timeout, whichever comes first.
    if grep -qF "lost communication with a remote daemon" <<<"$OUT"; then
        expect_text "Remote daemon: " || return 1
        expect_text "on node $A2" || return 1
    else
        expect_text "timed out after 5s" || return 1
        expect_text "rank 1 = $A2" || return 1
    fi
    expect_text "rank 0 on $A1: " || return 1
    expect_nothing_left || return 1
    echo "ended $TOOK s after the cut: $(grep -m1 -o "rank 0 on $A1: [^(]*" <<<"$OUT")"
}

# Host 2 runs another build (the same binary with another build id).
mh_drill_other_build() {
    local other=$WORK/tp-other
    cp "$TP" "$other"
    python3 - "$other" <<'EOF' || return 1
import subprocess, sys
path = sys.argv[1]
notes = subprocess.run(["readelf", "-n", path], capture_output=True, text=True).stdout
ids = [l.split(":", 1)[1].strip() for l in notes.splitlines() if "Build ID:" in l]
if not ids:
    sys.exit("the binary has no GNU build id to change")
old = bytes.fromhex(ids[0])
data = open(path, "rb").read()
if data.count(old) != 1:
    sys.exit("the build id is not unique in the file")
new = bytes([old[0] ^ 0xFF]) + old[1:]
open(path, "wb").write(data.replace(old, new))
EOF
    mh_run otherbuild 60 "TP_CLUSTER_BIND_2=$other:$TP" -- 2 -- "$TP" selftest --backend mpi
    expect_failed_within 20 || return 1
    expect_text "another build than rank 0" || return 1
    expect_text "rank 1 on $A2" || return 1
    expect_text "rank 0 on $A1" || return 1
    expect_nothing_left || return 1
    grep -m1 -o "1 of 2 ranks run another build.*" <<<"$OUT" | cut -c1-200
}

# Host 2 has no model file at the path: the job stops before loading, naming host 2.
mh_drill_model_missing() {
    mkdir -p "$WORK/empty"
    mh_run nomodel 60 "TP_CLUSTER_BIND_2=$WORK/empty:$(dirname "$MODEL")" -- \
        2 -- "$TP" generate --model "$MODEL" --max-tokens 4 --backend mpi "Hi"
    expect_failed_within 20 || return 1
    expect_text "missing or differs on $A2" || return 1
    expect_text "rank 1 on $A2: cannot open it" || return 1
    expect_nothing_left || return 1
    grep -m1 -o "rank 1 on $A2: cannot open it[^;]*" <<<"$OUT" | head -1 | cut -c1-160
}

# Host 2's model file has the same size but one byte of its header differs (the model's
# name in the metadata): the job stops before loading, naming host 2.
mh_drill_model_differs() {
    local other=$WORK/other-model.gguf
    cp "$MODEL" "$other"
    python3 - "$other" <<'EOF' || return 1
import sys
path = sys.argv[1]
with open(path, "r+b") as f:
    head = f.read(1 << 20)
    at = head.find(b"general.name")
    if at < 0:
        sys.exit("no general.name key in the first MiB of the model")
    # key, then type (u32) and string length (u64), then the value's first byte
    value = at + len(b"general.name") + 4 + 8
    f.seek(value)
    f.write(bytes([head[value] ^ 0x20]))
EOF
    mh_run othermodel 60 "TP_CLUSTER_BIND_2=$other:$MODEL" -- \
        2 -- "$TP" generate --model "$MODEL" --max-tokens 4 --backend mpi "Hi"
    expect_failed_within 20 || return 1
    expect_text "missing or differs on $A2" || return 1
    expect_nothing_left || return 1
    grep -o "rank [01] on [0-9.]*: [0-9]* bytes[^;)]*" <<<"$OUT" | head -2
}

# Host 2's model file is 4 KiB longer (same header).
mh_drill_model_size_differs() {
    local other=$WORK/longer-model.gguf
    cp "$MODEL" "$other"
    truncate -s +4096 "$other"
    mh_run longermodel 60 "TP_CLUSTER_BIND_2=$other:$MODEL" -- \
        2 -- "$TP" generate --model "$MODEL" --max-tokens 4 --backend mpi "Hi"
    expect_failed_within 20 || return 1
    expect_text "missing or differs on $A2" || return 1
    expect_nothing_left || return 1
    grep -o "rank [01] on [0-9.]*: [0-9]* bytes[^;)]*" <<<"$OUT" | head -2
}

# A hostfile naming an address no host answers: refused before launching, named.
mh_drill_unreachable_host() {
    local hf=$WORK/hostfile-unreachable gone
    gone=${A1%.*}.99
    printf '%s slots=1\n%s slots=1\n' "$A1" "$gone" >"$hf"
    mh_run unreachable 60 -- 2 --hostfile "$hf" -- "$TP" selftest --backend mpi
    expect_failed_within 10 || return 1
    expect_text "host $gone" || return 1
    expect_nothing_left || return 1
    grep -m1 "$gone" <<<"$OUT" | cut -c1-160
}

# Host 2 exists but its cable is cut, and `run` does not ping first: mpirun's agent (as ssh
# would) cannot reach it, and mpirun says it could not start its daemon there.
mh_drill_unreachable_host_mpirun() {
    $CLUSTER link 2 down
    mh_run unreachable-mpirun 60 TP_CLUSTER_PROBE=0 -- 2 -- "$TP" selftest --backend mpi
    $CLUSTER link 2 up
    expect_failed_within 20 || return 1
    expect_text "cannot reach $A2" || return 1
    expect_text "unable to reliably start one or more daemons" || return 1
    expect_nothing_left || return 1
    grep -m1 "cannot reach $A2" <<<"$OUT" | cut -c1-160
}
