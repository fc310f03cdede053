"""Batch-1 prefill and decode speed of llama.cpp (through llama-cpp-python) on a GGUF file,
measured the way `tp bench decode` measures: a fixed prompt of N tokens in one batched pass,
then M greedy decode steps, median of R runs. Prints one JSON line per thread count."""
import json
import statistics
import sys
import time

import llama_cpp
import numpy as np
from llama_cpp import Llama

model, prompt_tokens, gen_tokens, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
threads = [int(t) for t in sys.argv[5].split(",")]
TEXT = ("The history of the world is a story of people, places and ideas. Rivers carried boats and "
        "trade, cities grew around markets, and writing let merchants keep accounts and poets keep songs. ")

for n_threads in threads:
    llm = Llama(model_path=model, n_ctx=prompt_tokens + gen_tokens + 8, n_threads=n_threads,
                n_threads_batch=n_threads, n_batch=prompt_tokens, logits_all=False, verbose=False)
    ids = []
    while len(ids) < prompt_tokens:
        ids += llm.tokenize(TEXT.encode(), add_bos=False)
    ids = ids[:prompt_tokens]
    n_vocab = llm.n_vocab()
    prefill, decode = [], []
    for rep in range(repeats + 1):  # the first run warms up
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        t_prefill = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(gen_tokens - 1):
            # llm.scores stays zero without logits_all; read the last row directly (numpy argmax
            # keeps Python's per-token cost to microseconds).
            logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
            llm.eval([int(logits.argmax())])
        t_decode = time.perf_counter() - t
        if rep > 0:
            prefill.append(prompt_tokens / t_prefill)
            decode.append((gen_tokens - 1) / t_decode)
    print(json.dumps({"peer": "llama.cpp", "version": llama_cpp.__version__, "threads": n_threads,
                      "prefill_tok_s": round(statistics.median(prefill), 1),
                      "decode_tok_s": round(statistics.median(decode), 1)}), flush=True)
