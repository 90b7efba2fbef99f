"""The pre-flight's one run on both prompt sets gives the steps of a run per set: its probe reads the model and draws
no random numbers, so what it measures on one set does not change what the loop trains (the integration test
leans on it to measure held-out and production prompts in one 20-step run instead of two)."""

from __future__ import annotations

import random
from pathlib import Path

from flywheel.demo import preflight, warm_start

BASE = Path(__file__).resolve().parents[2] / "var" / "models" / "tiny-base"  # make test's `model` target builds it


def test_the_probe_draws_no_random_numbers_and_leaves_the_model_as_it_was() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(BASE))
    model = AutoModelForCausalLM.from_pretrained(str(BASE), dtype=torch.float32)
    model.train()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    random.seed(5)
    before = (torch.get_rng_state(), random.getstate())
    naming = warm_start.naming_probabilities(model, tok, warm_start.heldout_parts(2, seed=30_000, split="train"))
    assert naming and torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert model.training and all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_one_run_on_both_prompt_sets_measures_what_a_run_per_set_does() -> None:
    small = {"model": BASE, "steps": 2, "batch_size": 4, "probe_parts": 2, "max_new_tokens": 12, "seed": 3}
    both = preflight.run(preflight.PreflightConfig(**small, probe_split="both"))
    for split in ("heldout", "train"):
        alone = preflight.run(preflight.PreflightConfig(**small, probe_split=split))
        assert [h["by_split"][split] for h in both["history"]] == [h["production_name"] for h in alone["history"]]
        for key in ("reward", "malformed"):  # the same sampled calls
            assert [h.get(key) for h in both["history"]] == [h.get(key) for h in alone["history"]]
        assert both["reached_at_by_split"][split] == alone["reached_at"]
    assert both["history"][-1]["production_name"] == both["history"][-1]["by_split"]["heldout"]


def test_a_lookups_probe_is_every_prompt_of_its_split_once() -> None:
    """A lookup's prompts are a closed set, so the probe takes its exact mean: no prompt weighted twice by a draw."""
    from flywheel.demo import tasks

    for split in ("train", "heldout"):
        parts = preflight.probe_parts(6, split)
        for tool in tasks.LOOKUPS:
            texts = [p.text for p in parts if p.tool == tool]
            want = [tasks.prompt_text(t, a, ph) for t, a, ph in tasks.task_space()
                    if t == tool and tasks.split_of(t, a, ph) == split]
            assert sorted(texts) == sorted(want) and len(set(texts)) == len(texts) > 0
        for tool in tasks.ARITHMETIC:
            sampled = [p for p in parts if p.tool == tool]
            assert len(sampled) == 6 and all(tasks.split_of(p.tool, p.args, tasks.phrasing_of(p)) == split
                                             for p in sampled)
