#!/usr/bin/env bash
# A cluster of N "hosts" on this machine, made of Linux network namespaces, and mpirun across
# them: try multi-host runs (and their faults) without a second machine. Root only (needs
# CAP_NET_ADMIN). How it is built and why: docs/multi-host.md.
#
# Usage:
#   scripts/cluster.sh up N [--rate RATE]    make hosts 1..N (an existing cluster is removed first);
#                                            RATE (1gbit, 10gbit, 500mbit ...) limits each host's
#                                            link in both directions (tbf)
#   scripts/cluster.sh down                  remove everything `up` made: processes inside the
#                                            hosts (orted, ranks), namespaces, veths, bridge, state
#                                            (idempotent; also cleans a half-made cluster)
#   scripts/cluster.sh run N [MPIRUN-ARGS...] -- COMMAND [ARGS...]
#                                            mpirun from host 1, one rank on each of hosts 1..N
#                                            (or on the hosts of a --hostfile among the
#                                            MPIRUN-ARGS); every host is pinged first; exits
#                                            with mpirun's status
#   scripts/cluster.sh status                hosts, addresses, rate, processes inside
#   scripts/cluster.sh addr K                host K's address
#   scripts/cluster.sh exec K COMMAND...     run COMMAND inside host K's namespace
#   scripts/cluster.sh pids K                ids of the processes running on host K
#   scripts/cluster.sh link K down|up        cut or reconnect host K's cable (in the bridge namespace)
#
# Environment:
#   TP_CLUSTER=tpc            name of the cluster: namespaces NAME-br (the bridge) and NAME-h1..hN,
#                             state in /tmp/tp-cluster-NAME; give each concurrent cluster its own
#   TP_CLUSTER_SUBNET=10.213.7  first three octets of the private /24; host K is SUBNET.K. It exists
#                             only inside the namespaces (no route out, the root namespace untouched)
#   TP_CLUSTER_BIND_K="SRC:DST ..."  (test aid, read by `run`) processes on host K see SRC at DST
#                             (bind mounts private to that host), e.g. another model file or binary
#   TP_CLUSTER_PIN=0          leave the hosts unpinned; by default host K runs on cores of its own
#                             (nproc / N each, as separate machines would), see host_cpus
#   TP_CLUSTER_PROBE=0        (drill aid) `run` skips the ping of every host, so that mpirun itself
#                             meets an unreachable host
#   TP_*, RUST_BACKTRACE, RUST_LOG   set when calling `run`: forwarded to every rank (mpirun -x),
#                             as a real cluster needs (ranks on other hosts start from a clean
#                             environment, as over ssh: PATH, HOME, TP_HOST)
#
# Every rank sees TP_HOST (its host's address), which tp uses to name hosts in errors.
#
# Example:
#   sudo scripts/cluster.sh up 2 --rate 1gbit
#   sudo scripts/cluster.sh run 2 -- target/release/tp generate --backend mpi "Hello"
#   sudo scripts/cluster.sh down
set -euo pipefail

NAME=${TP_CLUSTER:-tpc}
SUBNET=${TP_CLUSTER_SUBNET:-10.213.7}
STATE=/tmp/tp-cluster-$NAME
BR=$NAME-br
MAX_HOSTS=32

die() {
    echo "cluster.sh: $*" >&2
    exit 1
}

host_ns() { echo "$NAME-h$1"; }
host_addr() { echo "$SUBNET.$1"; }

# The CPUs host K of N runs on: a share of this machine's cores of its own, as a real host has
# (nproc / N cores each, at least one; hosts share cores only when N exceeds them). Without
# this every host's orted binds its one rank to core 0 and all "hosts" share one core.
# TP_CLUSTER_PIN=0 leaves the hosts unpinned (the scheduler places them).
host_cpus() {
    local k=$1 n=$2 cores per first
    cores=$(nproc)
    per=$((cores / n))
    ((per >= 1)) || per=1
    first=$((((k - 1) * per) % cores))
    if ((per == 1)); then echo "$first"; else echo "$first-$((first + per - 1))"; fi
}

# The command prefix that pins host K of N (empty with TP_CLUSTER_PIN=0).
pin_prefix() {
    [[ ${TP_CLUSTER_PIN:-1} == 0 ]] && return 0
    echo "taskset -c $(host_cpus "$1" "$2")"
}

check_name() {
    [[ $NAME =~ ^[a-z][a-z0-9]{0,7}$ ]] ||
        die "TP_CLUSTER=$NAME: use 1-8 lowercase letters or digits, starting with a letter"
    [[ $SUBNET =~ ^(10|192\.168|172\.(1[6-9]|2[0-9]|3[01]))(\.[0-9]{1,3}){1,2}$ ]] &&
        [[ $(tr -cd . <<<"$SUBNET" | wc -c) -eq 2 ]] ||
        die "TP_CLUSTER_SUBNET=$SUBNET: give the first three octets of a private /24, e.g. 10.213.7"
}

need_root() {
    [[ $(id -u) -eq 0 ]] ||
        die "must run as root (it creates network namespaces); try: sudo $0 $*"
    command -v ip >/dev/null || die "the ip command is missing: apt-get install iproute2"
}

# Hosts of the running cluster (0 when none).
hosts_up() {
    if [[ -f $STATE/hosts ]]; then cat "$STATE/hosts"; else echo 0; fi
}

# The namespaces this cluster owns (also those of a half-made one).
our_namespaces() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$NAME-(br|h[0-9]+)\$" || true
}

# Processes inside this cluster's namespaces: only what runs on our "hosts" (mpirun, orted, ranks).
our_pids() {
    local ns
    for ns in $(our_namespaces); do
        ip netns pids "$ns" 2>/dev/null || true
    done | sort -un
}

cmd_down() {
    local pids pid i ns
    pids=$(our_pids)
    if [[ -n $pids ]]; then
        echo "cluster.sh: stopping $(wc -w <<<"$pids") process(es) left on the hosts: $(tr '\n' ' ' <<<"$pids")" >&2
        for pid in $pids; do kill -TERM "$pid" 2>/dev/null || true; done
        for i in $(seq 1 20); do
            pids=$(our_pids)
            [[ -z $pids ]] && break
            sleep 0.1
        done
        for pid in $pids; do kill -KILL "$pid" 2>/dev/null || true; done
        for i in $(seq 1 20); do
            [[ -z $(our_pids) ]] && break
            sleep 0.1
        done
    fi
    # Deleting a namespace destroys its end of each veth, and with it the pair.
    for ns in $(our_namespaces); do
        ip netns del "$ns" 2>/dev/null || true
    done
    rm -rf "$STATE"
    [[ -z $(our_namespaces) ]] || die "could not delete namespaces: $(our_namespaces | tr '\n' ' ')"
}

# ADDR answers from host 1: ping when installed, else a TCP probe of port 9 (a refused
# connection proves the host is there).
probe() {
    local addr=$1
    if command -v ping >/dev/null; then
        ip netns exec "$(host_ns 1)" ping -c 1 -W 1 -q "$addr" >/dev/null 2>&1
    else
        local out
        out=$(ip netns exec "$(host_ns 1)" timeout 2 bash -c "exec 3<>/dev/tcp/$addr/9" 2>&1) && return 0
        grep -q "refused" <<<"$out"
    fi
}

# tbf on one device; burst: 10 ms of traffic at RATE, at least 256 KiB.
shape() {
    local ns=$1 dev=$2 rate=$3 bits burst
    bits=$(rate_bits "$rate")
    burst=$((bits / 8 / 100))
    ((burst >= 262144)) || burst=262144
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$rate" burst "$burst" latency 20ms
}

rate_bits() {
    local r=${1%bit} mult=1
    case $r in
        *k) mult=1000 r=${r%k} ;;
        *m) mult=1000000 r=${r%m} ;;
        *g) mult=1000000000 r=${r%g} ;;
    esac
    echo $((r * mult))
}

write_agent() {
    local n=$1 k
    {
        echo '#!/bin/sh'
        echo "# OpenMPI rsh agent of the cluster \"$NAME\", written by scripts/cluster.sh up."
        echo '# OpenMPI runs `agent [OPTIONS] HOST COMMAND...` to start its daemon on HOST; instead of'
        echo "# ssh this enters HOST's namespace and runs COMMAND with a clean environment, as ssh would."
        echo 'while [ $# -gt 0 ]; do case $1 in -*) shift ;; *) break ;; esac; done'
        echo 'host=$1; shift'
        echo 'case $host in'
        for k in $(seq 1 "$n"); do
            echo "    $(host_addr "$k")) k=$k; pin=\"$(pin_prefix "$k" "$n")\" ;;"
        done
        echo "    *) echo \"cluster agent: \$host is no host of the cluster $NAME (hosts $(host_addr 1)..$(host_addr "$n")); fix the hostfile\" >&2; exit 255 ;;"
        echo 'esac'
        echo '# Like ssh, fail when HOST does not answer from here (host 1): otherwise the daemon would'
        echo '# start and wait forever to reach mpirun.'
        echo 'if command -v ping >/dev/null; then'
        echo '    ping -c 1 -W 2 -q "$host" >/dev/null 2>&1 && up=1'
        echo 'else'
        echo '    timeout 2 bash -c "exec 3<>/dev/tcp/$host/9" 2>&1 | grep -q refused && up=1'
        echo 'fi'
        echo 'if [ -z "${up:-}" ]; then'
        echo "    echo \"cluster agent: cannot reach \$host from $(host_addr 1): no answer (as ssh: connect to host \$host: No route to host)\" >&2"
        echo '    exit 255'
        echo 'fi'
        echo 'binds=$(eval "printf %s \"\${TP_CLUSTER_BIND_$k:-}\"")'
        echo "exec \$pin ip netns exec $NAME-h\$k env -i PATH=\"\$PATH\" HOME=\"\$HOME\" TP_HOST=\"\$host\" BINDS=\"\$binds\" \\"
        echo "    sh -c 'for b in \$BINDS; do mount --bind \"\${b%%:*}\" \"\${b#*:}\" || exit 1; done; unset BINDS; eval \"\$1\"' sh \"\$*\""
    } >"$STATE/agent"
    chmod 755 "$STATE/agent"
}

cmd_up() {
    local n=${1:-} rate="" k ns
    [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= MAX_HOSTS)) ||
        die "up needs the number of hosts (1..$MAX_HOSTS), e.g. up 2"
    shift
    while [[ $# -gt 0 ]]; do
        case $1 in
            --rate)
                rate=${2:-}
                shift 2 || die "--rate needs a value, e.g. --rate 1gbit"
                ;;
            --rate=*)
                rate=${1#--rate=}
                shift
                ;;
            *) die "up: unknown option $1 (usage: up N [--rate 1gbit])" ;;
        esac
    done
    if [[ -n $rate ]]; then
        [[ $rate =~ ^[1-9][0-9]*[kmg]?bit$ ]] ||
            die "--rate $rate: give a whole number with kbit, mbit or gbit, e.g. 1gbit or 500mbit"
    fi
    cmd_down
    # A failure (or Ctrl-C) half way leaves nothing behind.
    trap 'exit 130' INT TERM
    trap 'rc=$?; if [[ $rc -ne 0 ]]; then echo "cluster.sh: up failed; removing what it made" >&2; cmd_down; fi' EXIT
    mkdir -p "$STATE"
    ip netns add "$BR"
    ip -n "$BR" link set lo up
    ip -n "$BR" link add br0 type bridge
    ip -n "$BR" link set br0 up
    for k in $(seq 1 "$n"); do
        ns=$(host_ns "$k")
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip -n "$BR" link add "h$k" type veth peer name eth0 netns "$ns"
        ip -n "$BR" link set "h$k" master br0
        ip -n "$BR" link set "h$k" up
        ip -n "$ns" addr add "$(host_addr "$k")/24" dev eth0
        ip -n "$ns" link set eth0 up
        if [[ -n $rate ]]; then
            shape "$ns" eth0 "$rate" # what host k sends
            shape "$BR" "h$k" "$rate" # what host k receives
        fi
    done
    for k in $(seq 1 "$n"); do
        echo "$(host_addr "$k") slots=1"
    done >"$STATE/hostfile"
    echo "${rate:-unshaped}" >"$STATE/rate"
    write_agent "$n"
    echo "$n" >"$STATE/hosts"
    # The bridge forwards at once, but the first launch right after creating it once failed:
    # wait until every host answers.
    for k in $(seq 1 "$n"); do
        local tries=0
        until probe "$(host_addr "$k")"; do
            tries=$((tries + 1))
            ((tries < 10)) || {
                echo "cluster.sh: host $k ($(host_addr "$k")) does not answer host 1" >&2
                false
            }
            sleep 0.3
        done
    done
    trap - EXIT INT TERM
    echo "cluster $NAME: $n host(s) $(host_addr 1)..$(host_addr "$n") (namespaces $(host_ns 1)..$(host_ns "$n"), bridge in $BR), ${rate:-unshaped}"
}

need_up() {
    local n=$1 have
    have=$(hosts_up)
    ((have > 0)) || die "no cluster $NAME is up; run: $0 up $n"
    ((n >= 1 && n <= have)) || die "the cluster $NAME has $have host(s), not $n; run: $0 up $n"
}

cmd_run() {
    local n=${1:-} k
    [[ $n =~ ^[0-9]+$ ]] || die "run needs the number of hosts first: run N [MPIRUN-ARGS...] -- COMMAND..."
    shift
    need_up "$n"
    local mpi_args=()
    while [[ $# -gt 0 && $1 != -- ]]; do
        mpi_args+=("$1")
        shift
    done
    [[ ${1:-} == -- ]] || die "run: put -- before the command: run $n [MPIRUN-ARGS...] -- COMMAND..."
    shift
    [[ $# -gt 0 ]] || die "run: no command after --"
    # A hostfile among the mpirun arguments replaces the cluster's (drills name absent hosts).
    local hostfile="" i
    for i in "${!mpi_args[@]}"; do
        case ${mpi_args[$i]} in
            --hostfile | -hostfile | --machinefile | -machinefile) hostfile=${mpi_args[$((i + 1))]:-} ;;
        esac
    done
    if [[ -z $hostfile ]]; then
        hostfile=$STATE/hostfile.$n
        head -n "$n" "$STATE/hostfile" >"$hostfile"
        mpi_args=(--hostfile "$hostfile" "${mpi_args[@]}")
    fi
    [[ -r $hostfile ]] || die "cannot read the hostfile $hostfile"
    local addr
    for addr in $(sed -e 's/#.*//' "$hostfile" | awk 'NF {print $1}'); do
        [[ ${TP_CLUSTER_PROBE:-1} == 0 ]] && break
        probe "$addr" || die "host $addr (in $hostfile) does not answer from host 1 ($(host_addr 1)); is it up, is its link cut? ($0 status)"
    done
    local fwd=() v
    for v in $(compgen -e); do
        case $v in
            TP_HOST | TP_CLUSTER | TP_CLUSTER_*) ;;
            TP_* | RUST_BACKTRACE | RUST_LOG) fwd+=(-x "$v") ;;
        esac
    done
    local binds
    binds=${TP_CLUSTER_BIND_1:-}
    # mpirun runs on host 1 (its rank 0 is a child of it); the agent starts orted on the others.
    # Each host runs on its own cores (pin_prefix); --bind-to none keeps OpenMPI from binding
    # every host's rank to the first core of the machine they all share.
    local pin
    pin=$(pin_prefix 1 "$(hosts_up)")
    exec $pin ip netns exec "$(host_ns 1)" env TP_HOST="$(host_addr 1)" BINDS="$binds" sh -c \
        'for b in $BINDS; do mount --bind "${b%%:*}" "${b#*:}" || exit 1; done; unset BINDS; exec "$@"' sh \
        mpirun --allow-run-as-root -n "$n" --bind-to none \
        --mca plm_rsh_agent "$STATE/agent" --mca plm_rsh_no_tree_spawn 1 \
        --mca btl tcp,self --mca btl_tcp_if_include "$SUBNET.0/24" \
        --mca oob_tcp_if_include "$SUBNET.0/24" --mca mpi_yield_when_idle 1 \
        --mca oob_tcp_keepalive_time 2 --mca oob_tcp_keepalive_intvl 1 --mca oob_tcp_keepalive_probes 3 \
        "${fwd[@]}" "${mpi_args[@]}" "$@"
}

cmd_status() {
    local n k ns
    n=$(hosts_up)
    if ((n == 0)); then
        echo "no cluster $NAME is up"
        [[ -z $(our_namespaces) ]] || echo "leftover namespaces (run down): $(our_namespaces | tr '\n' ' ')"
        return 0
    fi
    echo "cluster $NAME: $n host(s), $(cat "$STATE/rate"), state in $STATE"
    for k in $(seq 1 "$n"); do
        ns=$(host_ns "$k")
        local link procs
        link=$(ip -n "$BR" -o link show "h$k" 2>/dev/null | grep -o 'state [A-Z]*' || echo "state ?")
        procs=$(ip netns pids "$ns" 2>/dev/null | xargs -r ps -o comm= -p 2>/dev/null | sort | uniq -c | awk '{printf "%s%s x%s", s, $2, $1; s=", "}')
        echo "  host $k: $(host_addr "$k") in $ns, link ${link#state }, processes: ${procs:-none}"
    done
}

check_host_arg() {
    local k=${1:-} n
    n=$(hosts_up)
    ((n > 0)) || die "no cluster $NAME is up"
    [[ $k =~ ^[0-9]+$ ]] && ((k >= 1 && k <= n)) || die "no host ${k:-(missing)}: the hosts are 1..$n"
}

main() {
    local cmd=${1:-}
    check_name
    case $cmd in
        up | down | run | exec | link | status | pids)
            need_root "$@"
            ;;
    esac
    case $cmd in
        up)
            shift
            cmd_up "$@"
            ;;
        down)
            cmd_down
            echo "cluster $NAME: down"
            ;;
        run)
            shift
            cmd_run "$@"
            ;;
        status) cmd_status ;;
        addr)
            check_host_arg "${2:-}"
            host_addr "$2"
            ;;
        exec)
            check_host_arg "${2:-}"
            local k=$2
            shift 2
            [[ $# -gt 0 ]] || die "exec $k: no command"
            exec ip netns exec "$(host_ns "$k")" "$@"
            ;;
        pids)
            check_host_arg "${2:-}"
            ip netns pids "$(host_ns "$2")"
            ;;
        link)
            check_host_arg "${2:-}"
            [[ ${3:-} == up || ${3:-} == down ]] || die "link $2: say up or down"
            ip -n "$BR" link set "h$2" "$3"
            ;;
        *)
            sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
            exit 2
            ;;
    esac
}

main "$@"
