#!/usr/bin/env bash
# Runs every test of the workspace, the MPI suites under mpirun included.
# Needs OpenMPI (Debian: apt-get install libopenmpi-dev openmpi-bin libclang-dev).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
    echo "error: OpenMPI is missing; the MPI tests cannot run." >&2
    echo "       install it: sudo apt-get install -y libopenmpi-dev openmpi-bin libclang-dev" >&2
    exit 1
fi
# mpirun refuses root unless told; CI and containers run as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

cargo test --workspace --features tp-comm/mpi,tp-cli/mpi,tp-nn/mpi,tp-train/mpi "$@"
