"""llama.cpp's prompt-lookup decoding (llama-cpp-python's LlamaPromptLookupDecoding) against its
plain decoding on the edit workload of `tp bench decode --spec ngram`: the same chat prompt
(the code of tp_engine::bench_spec::EDIT_SOURCE and the rename instruction), greedy, end of
sequence ignored, N generated tokens, median of R runs each. Prints one JSON line per thread
count and mode. Usage: llama_cpp_spec.py MODEL GEN REPEATS THREADS(1,2) SOURCE_FILE"""
import json
import statistics
import sys
import time

import llama_cpp
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

model, gen, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
threads = [int(t) for t in sys.argv[4].split(",")]
source = open(sys.argv[5]).read()
message = ("Rename the variable `records` to `entries` everywhere in this Python code and print the "
           "whole code, changing nothing else:\n\n```python\n" + source + "```")
# Qwen2.5's chat template with its default system message (what tp's encode_chat produces).
prompt = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
          "<|im_start|>user\n" + message + "<|im_end|>\n<|im_start|>assistant\n")

for n_threads in threads:
    for mode in ["plain", "prompt-lookup"]:
        draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if mode == "prompt-lookup" else None
        llm = Llama(model_path=model, n_ctx=1024 + gen, n_threads=n_threads, n_threads_batch=n_threads,
                    n_batch=512, draft_model=draft, logits_all=draft is not None, verbose=False)
        ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        speeds = []
        for rep in range(repeats + 1):
            llm.reset()
            llm.eval(ids)
            t = time.perf_counter()
            n = 0
            for _ in llm.generate(ids, top_k=1, temp=0.0, reset=False):
                n += 1
                if n == gen:
                    break
            if rep > 0:
                speeds.append((gen - 1) / (time.perf_counter() - t))
        print(json.dumps({"peer": "llama.cpp", "version": llama_cpp.__version__, "threads": n_threads,
                          "mode": mode, "prompt_tokens": len(ids),
                          "decode_tok_s": round(statistics.median(speeds), 1)}), flush=True)
