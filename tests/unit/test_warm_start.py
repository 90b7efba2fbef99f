"""The warm start is the same on every build: a fixed step count in a process with pinned numerics, bit-identical
weights from two builds; its record names each tool's naming probabilities, and a build outside the band fails."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flywheel.demo import tasks, warm_start
from flywheel.demo.warm_start import WarmStartSettings

BASE = Path(__file__).resolve().parents[2] / "var" / "models" / "tiny-base"  # make test's `model` target builds it
SHORT = WarmStartSettings(max_steps=12, eval_every=6, loss_parts=4, eval_parts_per_tool=2, batch_size=8,
                          max_new_tokens=24, check_band=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("warm") / "a"
    return warm_start.run(BASE, out, SHORT), out


def test_two_builds_on_one_machine_give_bit_identical_weights(built: tuple[dict, Path], tmp_path: Path) -> None:
    a, a_dir = built
    b = warm_start.run(BASE, tmp_path / "b", SHORT)
    assert a["weights_sha256"] == b["weights_sha256"]
    assert (a_dir / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert [h["heldout_loss"] for h in a["history"]] == [h["heldout_loss"] for h in b["history"]]
    assert a["tools"] == b["tools"], "the record's sampled figures are seeded too"
    # what was pinned is recorded, and the build really ran under it (a child process, since this one is not pinned)
    assert a["pins"]["env"] == warm_start.PINS and a["pins"]["torch_threads"] == warm_start.THREADS
    assert a["pins"]["deterministic_algorithms"] is True
    assert a["pins"]["mkl_branch"] in (None, warm_start.PINS["MKL_CBWR"]), "MKL ran another branch than the pinned"
    assert a["steps"] == SHORT.max_steps and [h["step"] for h in a["history"]] == [6, 12]
    # the check can fail: another seed is another model
    other = warm_start.run(BASE, tmp_path / "c", WarmStartSettings(**{**SHORT.__dict__, "seed": 1}))
    assert other["weights_sha256"] != a["weights_sha256"]


def test_the_record_gives_per_tool_naming_probabilities_of_every_generation(built: tuple[dict, Path]) -> None:
    record, out = built
    assert set(record["tools"]) == set(tasks.TOOLS)
    for tool, rec in record["tools"].items():
        assert list(rec["naming"]) == list(tasks.TOOL_NAMES[tool])
        assert 0.0 <= sum(rec["naming"].values()) <= 1.0 + 1e-6
        assert rec["production_name"] == rec["naming"][tool]
        assert rec["parts"] == SHORT.eval_parts_per_tool
    assert json.loads((out / "warm_start.json").read_text()) == record


def test_every_tool_name_is_one_token_at_the_calls_name_slot() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(BASE))
    for tool in tasks.TOOLS:
        part = tasks.make_part(random.Random(0), mix={tool: 1.0})
        prefix, names = warm_start.name_slot(tok, part)  # asserts each name is one token after the opening
        assert len(set(names)) == len(tasks.GENERATIONS)


def test_a_build_outside_the_band_is_refused_naming_the_figure() -> None:
    inside = {"production_name": 0.33, "first_call_any_name": 0.95}
    tools = {t: dict(inside) for t in tasks.TOOLS}
    assert warm_start.band_breaches(tools) == []
    tools["country"]["production_name"] = 0.97  # the base already knows production's name: no drift to adapt to
    tools["weather"]["first_call_any_name"] = 0.3  # the skill is not there
    tools["add"]["first_call_any_name"] = 0.02  # recorded, not banded: the warm start does not form the digit copy
    breaches = warm_start.band_breaches(tools)
    assert len(breaches) == 2, breaches
    assert "weather: first call right under any generation's name = 0.300" in breaches[0]
    assert "country: p(production name 'country') = 0.970" in breaches[1]


def test_the_build_process_refuses_to_run_unpinned() -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in warm_start.PINS}
    done = subprocess.run([sys.executable, "-m", "flywheel.demo.warm_start", "{}"], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 2 and "not pinned" in done.stderr


@pytest.mark.parametrize("generation", range(len(tasks.GENERATIONS)))
def test_demonstrations_name_tools_by_their_generation(generation: int) -> None:
    part = tasks.Part("weather", {"city": "rome"}, "weather in rome")
    call = tasks.parse_reply(tasks.demonstration(part, generation)[1]["content"])
    assert call.tool == tasks.TOOL_NAMES["weather"][generation]


def test_a_lora_warm_start_writes_plain_merged_weights_that_moved(tmp_path: Path) -> None:
    """A real model's warm start (the smollm2 recipe) trains a LoRA adapter and merges it: vLLM then serves policy-v0
    as a plain model and the learner adapts it; the tiny base stands in for the real one here."""
    from safetensors.torch import load_file

    lora = WarmStartSettings(**{**SHORT.__dict__, "lora_rank": 4, "lr": 1e-2})
    record = warm_start.run(BASE, tmp_path / "lora", lora)
    out = tmp_path / "lora"
    assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").is_file()
    merged, base = load_file(str(out / "model.safetensors")), load_file(str(BASE / "model.safetensors"))
    assert set(merged) == set(base), "merged weights keep the base's tensor names (no lora_A/lora_B, no base_model.)"
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (merged[q] - base[q]).abs().max() > 1e-4, "the adapter was merged into the projections"
    assert (merged["model.embed_tokens.weight"] == base["model.embed_tokens.weight"]).all(), "only the targets moved"
    assert record["settings"]["lora_rank"] == 4
    assert warm_start.is_current(out, BASE, settings=lora)
    assert not warm_start.is_current(out, BASE, settings=SHORT), "another training recipe is another policy-v0"


def test_a_record_from_before_a_setting_existed_counts_it_at_its_default(built: tuple[dict, Path],
                                                                        tmp_path: Path) -> None:
    record, out = built
    older = tmp_path / "older"
    older.mkdir()
    (older / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    settings = {k: v for k, v in record["settings"].items() if k not in ("lora_rank", "lora_alpha")}
    (older / "warm_start.json").write_text(json.dumps({**record, "settings": settings}))
    assert warm_start.is_current(older, BASE, settings=SHORT)
    assert not warm_start.is_current(older, BASE, settings=WarmStartSettings(**{**SHORT.__dict__, "lora_rank": 8}))


def test_a_tokenizer_that_splits_tool_names_gives_success_figures_without_naming() -> None:
    class Splitting:
        def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
            return {"input_ids": list(range(len(text)))}

    assert not warm_start.names_are_tokens(Splitting())
    assert warm_start.band_breaches({"weather": {"production_name": None, "first_call_any_name": 1.0}}) == [
        "weather: no p(production name): its names are not single tokens of this tokenizer"]


def test_mkl_reports_the_branch_it_runs_and_falls_back_silently_from_one_it_lacks() -> None:
    import os

    pinned = warm_start.mkl_branch({**os.environ, **warm_start.PINS})
    if pinned is None:
        pytest.skip("this torch does not use MKL: MKL_CBWR pins nothing here")
    assert pinned == warm_start.PINS["MKL_CBWR"], "COMPATIBLE is the branch MKL honours on every x86-64 CPU"
    # what the AVX2 pin did on an AMD CPU: a branch MKL does not offer here runs as AUTO, with no warning
    assert warm_start.mkl_branch({**os.environ, "MKL_CBWR": "AVX512_E9,STRICT"}) == "AUTO"


def test_a_build_refuses_a_pin_mkl_did_not_honour(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warm_start, "mkl_branch", lambda env=None: "AUTO,STRICT")
    with pytest.raises(warm_start.PinNotHonoured, match="AUTO,STRICT"):
        warm_start._pin_torch()


def test_a_build_under_other_pins_is_not_current(built: tuple[dict, Path], tmp_path: Path) -> None:
    record, out = built
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    env = {**record["pins"]["env"], "MKL_CBWR": "AVX2,STRICT"}  # the pin before COMPATIBLE
    (other / "warm_start.json").write_text(json.dumps({**record, "pins": {**record["pins"], "env": env}}))
    assert warm_start.is_current(out, BASE, settings=SHORT)
    assert not warm_start.is_current(other, BASE, settings=SHORT), "another machine's weights served as this one's"


def test_a_dialogues_turns_train_as_one_sequence_with_the_same_loss() -> None:
    """join_turns puts a demonstration's call turn and answer turn in one sequence (the call turn is the answer
    turn's prefix): half the rows, and the loss of the separate rows, since a token sees only the tokens before it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BASE)
    model = AutoModelForCausalLM.from_pretrained(BASE, torch_dtype=torch.float64).eval()
    rng = random.Random(3)
    parts = [tasks.make_part(rng, "train") for _ in range(6)]
    examples = warm_start._examples(tok, parts, [i % len(tasks.GENERATIONS) for i in range(len(parts))])
    sequences = warm_start.join_turns(examples)
    assert len(examples) == 12 and len(sequences) == 6
    for (p1, c1), (p3, c3), (ids, labels) in zip(examples[::2], examples[1::2], sequences):
        assert ids == p3 + c3 and [t for t in labels if t != -100] == c1 + c3
    unrelated = ([1, 2, 3], [4]), ([1, 2, 5, 6], [7])  # a prompt that does not start with the sequence: its own row
    assert warm_start.join_turns(list(unrelated)) == [([1, 2, 3, 4], [-100, -100, -100, 4]),
                                                      ([1, 2, 5, 6, 7], [-100] * 4 + [7])]

    def loss(batch: tuple) -> float:
        ids, labels, mask = batch
        with torch.no_grad():
            return float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)

    separate = [(p + c, [-100] * len(p) + c) for p, c in examples]
    joined = warm_start._batch(examples, tok.pad_token_id)
    assert joined[0].shape[0] == 6
    assert loss(joined) == pytest.approx(loss(warm_start._pad(separate, tok.pad_token_id)), rel=1e-6)

