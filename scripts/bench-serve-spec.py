#!/usr/bin/env python3
"""tp serve with and without --spec ngram on the edit workload (tp bench decode's prompt: rename a
variable in given code, chat template), one greedy request of 150 tokens at a time, best of 2
after a warm-up; prints whether every answer is the same text, tokens/s of the whole request
(prefill included) and the server's speculation metrics. Usage: scripts/bench-serve-spec.py MODEL.gguf
(from the repository root, after cargo build -p tp-cli)."""
import json, subprocess, sys, time, urllib.request, re
src = open('crates/tp-engine/src/bench_spec.rs').read()
code = src.split('pub const EDIT_SOURCE: &str = r#"')[1].split('"#;')[0]
msg = "Rename the variable `records` to `entries` everywhere in this Python code and print the whole code, changing nothing else:\n\n```python\n" + code + "```"
def run(extra, tp):
    p = subprocess.Popen(['target/debug/tp','serve','--model',sys.argv[1],'--tp',str(tp),'--port','0','--quiet']+extra, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    addr = re.search(r'http://[0-9.:]+', line).group(0)
    def ask():
        body = json.dumps({"messages":[{"role":"user","content":msg}],"max_tokens":150,"temperature":0,"ignore_eos":True}).encode()
        t=time.time()
        r = json.load(urllib.request.urlopen(urllib.request.Request(addr+'/v1/chat/completions', body, {'Content-Type':'application/json'})))
        return r['choices'][0]['message']['content'], time.time()-t, r['usage']
    ask()  # warm-up
    out = [ask() for _ in range(2)]
    m = urllib.request.urlopen(addr+'/metrics').read().decode()
    spec = [l for l in m.splitlines() if l.startswith('tp_spec_acceptance_rate') or l.startswith('tp_spec_tokens_per_step')]
    p.terminate(); p.wait()
    return out, spec
for tp in [1, 2]:
    plain, _ = run([], tp)
    spec, figs = run(['--spec','ngram'], tp)
    same = all(a[0]==plain[0][0] for a in plain+spec)
    pt = sorted(x[1] for x in plain)[0]; st = sorted(x[1] for x in spec)[0]
    print(f"tp {tp}: same text {same}; plain {150/pt:.1f} tok/s, spec {150/st:.1f} tok/s ({pt/st:.2f}x) {figs}", flush=True)
