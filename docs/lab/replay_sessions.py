"""Lab: the demo's learning on whole sessions, offline. From the warm start, sample full tool-use sessions (up to 3
turns, production's tool server), reward each turn as the builder does (call_correct per call turn, task success for
the answer turn, malformed -0.5 from its broken token), train with the learner's loss (positive-only, LOO per task
type, sequence agg, lr 4e-4 with 10-step warm-up), then measure malformed calls per tool on fresh sessions.

    .venv/bin/python docs/lab/replay_sessions.py STEPS VARIANT [SEED] [SESSIONS_PER_TOOL]

VARIANT: "from" (the penalty charged from the token where the call broke), "whole" (to the whole reply), "kl0.1"
(an exact full-vocabulary KL to the warm start on every row, coefficient 0.1). A lab script, not part of the package
and not tested: session 33's table in docs/experiments.md came from it (about 2 minutes a run on one thread).
"""
import json
import random
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flywheel.demo import tasks, warm_start
from flywheel.learner import loss as L

STEPS, VARIANT = int(sys.argv[1]), sys.argv[2]
SEED = int(sys.argv[3]) if len(sys.argv) > 3 else 0
MODEL = "var/models/tiny-warm"
torch.set_num_threads(1)
random.seed(SEED)
torch.manual_seed(SEED)
tok = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
ref = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32) if "kl" in VARIANT else None
opt = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.0)
rng = random.Random(SEED)


def turn_batch(dialogues):
    """ids, attention, completion mask, reply texts, completion width offset."""
    model.eval()
    enc, out = warm_start.sample_batch(model, tok, dialogues, 40)
    model.train()
    width = enc["input_ids"].shape[1]
    comp = out[:, width:]
    is_eos = (comp == tok.eos_token_id).int()
    after = (torch.cumsum(is_eos, 1) - is_eos) > 0
    mask = torch.zeros_like(out, dtype=torch.float32)
    mask[:, width:] = (~after).float()
    att = torch.cat([enc["attention_mask"], (~after).long()], 1)
    texts = [tok.decode(r[~after[i]], skip_special_tokens=True) for i, r in enumerate(comp)]
    return out, att, mask, texts, width, comp, after


def run_sessions(parts):
    """Play every part's session in lockstep; returns rows: (turn batch index, row index, part, kind, reward, penalty,
    malformed char) and the turn batches."""
    dialogues = {i: [tasks.user_message(p)] for i, p in enumerate(parts)}
    done, rows, batches, answers = set(), [], [], {}
    for turn in range(3):
        active = [i for i in dialogues if i not in done]
        if not active:
            break
        b = turn_batch([dialogues[i] for i in active])
        batches.append(b)
        for j, i in enumerate(active):
            text = b[3][j]
            parsed = tasks.parse_reply(text)
            dialogues[i].append({"role": "assistant", "content": text})
            if parsed.kind == "answer":
                answers[i] = parsed.answer
                done.add(i)
                rows.append([len(batches) - 1, j, i, "answer", None, 0.0, None])
                continue
            if parsed.kind == "tool_call":
                ok, output = tasks.run_tool(parsed.tool or "", parsed.arguments)
                r = float(tasks.call_matches(parts[i], parsed.tool, parsed.arguments))
                rows.append([len(batches) - 1, j, i, "call", r, 0.0, None])
            else:
                ok, output = False, "error: malformed tool call"
                rows.append([len(batches) - 1, j, i, "malformed", 0.0, -0.5, tasks.malformed_from(text), text])
            dialogues[i].append(tasks.tool_message(output, f"call{turn}"))
    for row in rows:
        if row[3] == "answer":
            row[4] = float(tasks.check_part(parts[row[2]], answers.get(row[2])))
    success = {i: tasks.check_part(parts[i], answers.get(i)) for i in range(len(parts))}
    return rows, batches, success


def logps(ids, att):
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1)
    tok_lp = lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(tok_lp[:, :1]), tok_lp], 1), lp


def char_to_token(comp_row, after_row, char):
    ids = comp_row[~after_row].tolist()
    for k in range(len(ids)):
        if len(tok.decode(ids[: k + 1], skip_special_tokens=True)) > char:
            return k
    return len(ids) - 1


def step(k):
    for g in opt.param_groups:
        g["lr"] = 4e-4 * min(1.0, k / 10)
    parts = [tasks.make_part(rng, "train", tasks.PRODUCTION_MIX) for _ in range(32)]
    rows, batches, success = run_sessions(parts)
    rewards = [r[4] + r[5] for r in rows]
    types = [f"tool_use.{parts[r[2]].tool}" for r in rows]
    adv = L.advantages(rewards, types, [None] * len(rows), None, group_relative=True, normalize=True,
                       batch_baseline=True, positive_only=True, penalties=[r[5] for r in rows])
    opt.zero_grad()
    n = float(len(rows))
    for bi, (ids, att, mask, texts, width, comp, after) in enumerate(batches):
        sel = [(ri, r) for ri, r in enumerate(rows) if r[0] == bi]
        a = torch.zeros(ids.shape[0])
        m = mask.clone()
        for ri, r in sel:
            a[r[1]] = adv[ri]
            if r[6] is not None and "whole" not in VARIANT:  # trained from the malformed token on
                t = char_to_token(comp[r[1]], after[r[1]], r[6])
                m[r[1], width:width + t] = 0.0
        keep = (a != 0)
        if "kl" not in VARIANT and not keep.any():
            continue
        lp, full = logps(ids, att)
        loss, _ = L.policy_loss(lp, lp.detach(), m, a, kind="tis", tis_cap=2.0, ppo_eps=0.2, token_normalizer=n,
                                agg="sequence")
        if ref is not None:
            with torch.no_grad():
                rlp = torch.log_softmax(ref(input_ids=ids, attention_mask=att).logits[:, :-1].float(), -1)
            kl = (full.exp() * (full - rlp)).sum(-1)  # exact KL(new || ref) per position [B, T-1]
            cm = mask[:, 1:]
            coef = float(VARIANT.split("kl")[1] or 0.1)
            loss = loss + coef * ((kl * cm).sum(1) / cm.sum(1).clamp(min=1)).sum() / n
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    mal = sum(r[3] == "malformed" for r in rows) / len(rows)
    return sum(success.values()) / len(parts), mal


def measure(n_per_tool=int(sys.argv[4]) if len(sys.argv) > 4 else 120):
    mrng = random.Random(99)
    out = {}
    with torch.no_grad():
        for tool in tasks.TOOLS:
            parts = [tasks.make_part(mrng, "train", {tool: 1.0}) for _ in range(n_per_tool)]
            rows, _, success = run_sessions(parts)
            calls = [r for r in rows if r[3] != "answer"]
            EXAMPLES.extend(r[7] for r in calls if r[3] == "malformed")
            out[tool] = {"success": round(sum(success.values()) / len(parts), 3),
                         "malformed": round(sum(r[3] == "malformed" for r in calls) / max(1, len(calls)), 3),
                         "calls": len(calls)}
    return out


EXAMPLES = []
t0 = time.time()
print("start", json.dumps(measure()), flush=True)
for k in range(1, STEPS + 1):
    s, m = step(k)
    print(f"step {k} success {s:.2f} malformed {m:.3f} {time.time() - t0:.0f}s", flush=True)
print("end", VARIANT, SEED, json.dumps(measure()), f"{time.time() - t0:.0f}s", flush=True)
import collections

print("examples", json.dumps(EXAMPLES[-40:]))
ends = collections.Counter("cut-close" if e.rstrip().endswith("</") else "other" for e in EXAMPLES)
print("kinds", dict(ends))
