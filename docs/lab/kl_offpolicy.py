"""Lab: the demo's learner, off-policy, under each KL anchor: does the KL to policy-v0 hold the first calls together
while the names move, and does it pull the names back?

The demo's learner trains on what the arms served: about 60% of a batch from policy-v0 (the control, and the champion
until a promotion) and 40% from the challenger, a snapshot of the learner published every 20 steps. This loop does the
same offline from the warm start: each step samples 64 first calls (60% from v0, 40% from the last published
snapshot), rewards them (call_is_correct), and trains with the learner's loss (positive-only normalized advantages,
TIS against the sampler's own logprobs, sequence aggregation, lr 4e-4) plus the KL term under test:

    none    no KL
    k3      k3 on the sampled tokens against v0 (the recipe until session 36)
    exact   the full-vocabulary KL(new || v0) at each completion position

Every 10 steps it measures the current weights: p(production name) per lookup on the train prompts (exact, as the
pre-flight does) and, sampled at T=1, N first calls per tool: malformed share and share right.

    .venv/bin/python docs/lab/kl_offpolicy.py STEPS SEED N KIND [KIND ...]

Not part of the package and not tested; session 36's table in docs/experiments.md came from it.
"""
import copy
import json
import random
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flywheel.demo import preflight, tasks, warm_start
from flywheel.learner import loss as learner_loss

torch.set_num_threads(2)
STEPS, SEED, N, KINDS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
WARM, BATCH, V0_SHARE, PUBLISH, COEF = "var/models/tiny-warm", 64, 0.6, 20, 0.1
tok = AutoTokenizer.from_pretrained(WARM)
probe = preflight.probe_parts(24, "train")
mrng = random.Random(7)
measure_parts = {t: [tasks.make_part(mrng, "train", {t: 1.0}) for _ in range(N)] for t in tasks.TOOLS}


def measure(model):
    model.eval()
    names = {t: round(v[t], 3) for t, v in warm_start.naming_probabilities(model, tok, probe).items()}
    bad, right = {}, {}
    torch.manual_seed(1)
    with torch.no_grad():
        for t, ps in measure_parts.items():
            (_, _), _, texts = preflight._sample(model, tok, ps, 40)
            bad[t] = round(sum(tasks.parse_reply(x).kind == "malformed_call" for x in texts) / len(ps), 3)
            right[t] = round(sum(tasks.call_is_correct(p, x) for p, x in zip(ps, texts)) / len(ps), 3)
    model.train()
    return {"production_name": names, "malformed": bad, "right": right,
            "malformed_mean": round(sum(bad.values()) / len(bad), 4),
            "right_mean": round(sum(right.values()) / len(right), 4)}


def pad_to(x, width, value):
    return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)  # left: prompts are left-padded


def run(kind):
    random.seed(SEED)
    torch.manual_seed(SEED)
    ref = AutoModelForCausalLM.from_pretrained(WARM, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(WARM, dtype=torch.float32)
    served = copy.deepcopy(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.0)
    rng = random.Random(SEED)
    hist = [{"step": 0, **measure(model)}]
    t0 = time.time()
    for step in range(1, STEPS + 1):
        parts = [tasks.make_part(rng, "train", tasks.PRODUCTION_MIX) for _ in range(BATCH)]
        n0 = int(BATCH * V0_SHARE)
        groups = []
        with torch.no_grad():
            for sampler, ps in ((ref, parts[:n0]), (served, parts[n0:])):
                (ids, att), mask, texts = preflight._sample(sampler, tok, ps, 40)
                sampler.eval()
                groups.append((ids, att, mask, texts, preflight._token_logprobs(sampler, ids, att)))
        width = max(g[0].shape[1] for g in groups)
        ids = torch.cat([pad_to(g[0], width, tok.pad_token_id) for g in groups])
        att = torch.cat([pad_to(g[1], width, 0) for g in groups])
        mask = torch.cat([pad_to(g[2], width, 0.0) for g in groups])
        old = torch.cat([pad_to(g[4], width, 0.0) for g in groups])
        texts = groups[0][3] + groups[1][3]
        rewards = [float(tasks.call_is_correct(p, t)) for p, t in zip(parts, texts)]
        adv = learner_loss.advantages(rewards, [f"tool_use.{p.tool}" for p in parts], [None] * len(parts), None,
                                      group_relative=True, normalize=True, batch_baseline=True, positive_only=True)
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
        full = torch.log_softmax(logits, dim=-1)
        logp = torch.cat([torch.zeros_like(old[:, :1]), full.gather(-1, ids[:, 1:, None]).squeeze(-1)], dim=1)
        kw = {}
        if kind != "none":
            with torch.no_grad():
                ref_full = torch.log_softmax(ref(input_ids=ids, attention_mask=att).logits[:, :-1].float(), dim=-1)
            if kind == "k3":
                kw = {"logp_ref": torch.cat([torch.zeros_like(old[:, :1]),
                                             ref_full.gather(-1, ids[:, 1:, None]).squeeze(-1)], dim=1)}
            else:
                kl = (full.exp() * (full - ref_full)).sum(-1)
                kw = {"kl_exact": torch.cat([torch.zeros_like(old[:, :1]), kl], dim=1)}
        loss, stats = learner_loss.policy_loss(logp, old, mask, torch.tensor(adv), kind="tis", tis_cap=2.0,
                                               ppo_eps=0.2, token_normalizer=float(BATCH), agg="sequence",
                                               kl_coef=COEF if kind != "none" else 0.0, **kw)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % PUBLISH == 0:
            served.load_state_dict(model.state_dict())
        if step % 10 == 0:
            hist.append({"step": step, "elapsed_s": round(time.time() - t0), **measure(model)})
            h = hist[-1]
            print(kind, SEED, step, "malformed", h["malformed_mean"], "right", h["right_mean"],
                  json.dumps(h["production_name"]), json.dumps(h["malformed"]), flush=True)
    return hist


out = {k: run(k) for k in KINDS}
print(json.dumps({"seed": SEED, "steps": STEPS, "n": N, "runs": out}))
