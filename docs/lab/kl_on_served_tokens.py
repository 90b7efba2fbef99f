"""Lab: what the learner's KL term sees. On first calls sampled by the warm start (policy-v0, as most demo rows are),
the k3 estimate the learner computes on the served tokens against the exact full-vocabulary KL(new || v0) at the same
positions, for each policy directory given. Session 35 (docs/experiments.md) came from it; not part of the package.

    .venv/bin/python docs/lab/kl_on_served_tokens.py POLICY_DIR [POLICY_DIR ...]
"""
import random
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flywheel.demo import tasks, warm_start

torch.set_num_threads(1)
tok = AutoTokenizer.from_pretrained("var/models/tiny-warm")
ref = AutoModelForCausalLM.from_pretrained("var/models/tiny-warm", dtype=torch.float32).eval()
rng = random.Random(3)
parts = [tasks.make_part(rng, "train", {t: 1.0}) for t in tasks.TOOLS for _ in range(60)]
torch.manual_seed(0)
enc, ids = warm_start.sample_batch(ref, tok, [[tasks.user_message(p)] for p in parts], 40)  # served by v0
w = enc["input_ids"].shape[1]
comp = ids[:, w:]
is_eos = (comp == tok.eos_token_id).int()
mask = ((torch.cumsum(is_eos, 1) - is_eos) == 0).float()
att = torch.cat([enc["attention_mask"], mask.long()], 1)


def full(m):
    with torch.no_grad():
        return torch.log_softmax(m(input_ids=ids, attention_mask=att).logits[:, w - 1:-1].float(), -1)

r = full(ref)
for d in sys.argv[1:]:
    new = full(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval())
    tok_new = new.gather(-1, comp[..., None]).squeeze(-1)
    tok_ref = r.gather(-1, comp[..., None]).squeeze(-1)
    dlt = tok_ref - tok_new
    k3 = (torch.exp(dlt) - dlt - 1).clamp(max=10.0)
    exact = (new.exp() * (new - r)).sum(-1)
    n = mask.sum()
    top = (exact * mask).flatten().topk(5).values
    print(d.split('/')[-3][-6:], d.split('/')[-1], f"k3 mean {(k3*mask).sum()/n:.4f}  exact mean {(exact*mask).sum()/n:.4f}  "
          f"exact share of positions > 0.05: {((exact > 0.05).float()*mask).sum()/n:.3f}  top {top.tolist()}")
