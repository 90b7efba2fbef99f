"""Lab: how often each model breaks its first tool call, sampled at T=1 (the demo's temperature), and where in the
call it breaks (the name, the arguments, the closing tag). N train-split prompts per tool; MODEL_DIR... are policy
directories (a demo run's var/demo/<run>/policies/policy-vN, or the warm start).

    .venv/bin/python docs/lab/first_call_breakage.py N MODEL_DIR [MODEL_DIR ...]

A lab script, not part of the package and not tested: session 35's table in docs/experiments.md came from it (about
10 s a model for N=200 on one thread). It predicted the gate: the versions it finds breaking 3-7% of first calls are
the ones the malformed guardrail held in the demo.
"""
import collections
import json
import random
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flywheel.demo import tasks, warm_start

torch.set_num_threads(1)
N, MODELS = int(sys.argv[1]), sys.argv[2:]
tok = AutoTokenizer.from_pretrained("var/models/tiny-warm")
rng = random.Random(7)
parts = {t: [tasks.make_part(rng, "train", {t: 1.0}) for _ in range(N)] for t in tasks.TOOLS}

def region(text, at):
    head = text[:at]
    if '"arguments"' not in head:
        return "name"
    if head.rstrip().endswith(('{', '"arguments":', '"arguments": {')):
        return "args-open"
    if "}}" in head:
        return "close"
    return "args"

for m in MODELS:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32).eval()
    out, where, EX = {}, collections.Counter(), []
    for t, ps in parts.items():
        enc, ids = warm_start.sample_batch(model, tok, [[tasks.user_message(p)] for p in ps], 40)
        texts = tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        bad = [x for x in texts if tasks.parse_reply(x).kind not in ("tool_call", "answer")]
        out[t] = round(len(bad) / len(texts), 3)
        for x in bad:
            where[region(x, tasks.malformed_from(x))] += 1
            if len(EX) < 8:
                EX.append(x)
    print(m, json.dumps(out), round(sum(out.values()) / len(out), 3), dict(where), flush=True)
    print("   ", json.dumps(EX)[:900], flush=True)
