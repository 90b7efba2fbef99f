"""Synthetic policy versions and reference logprobs, for the publish tests and `flywheel bench weights`.

A real version comes from the learner; these are made from the base model in a second so the
serving path can be checked on its own: a PEFT LoRA adapter with random (non-zero) A and B, or
full weights with seeded noise. `reference_logprobs` scores tokens with transformers/peft in fp32,
the ground truth vLLM's logprobs are compared with.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_policy_json(out_dir: Path, version: int, kind: str, base_model: Path, parent: int = 0,
                      learner_step: int = 0) -> None:
    meta = {"policy_version": version, "kind": kind, "base_model": str(base_model),
            "created_ts": _dt.datetime.now(_dt.timezone.utc).isoformat(), "learner_step": learner_step,
            "data_window": {"synthetic": True}, "parent_version": parent}
    (out_dir / "policy.json").write_text(json.dumps(meta, indent=1))


def make_lora_version(base_model: Path, out_dir: Path, version: int, seed: int = 0, rank: int = 8,
                      scale: float = 0.05) -> Path:
    """A PEFT adapter on every projection, with random A and B (a zero B would change nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS,
                                                  lora_dropout=0.0, init_lora_weights=False))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * scale)
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out_dir))
    write_policy_json(out_dir, version, "lora", base_model)
    return out_dir


def make_full_version(base_model: Path, out_dir: Path, version: int, seed: int = 0, noise: float = 0.02) -> Path:
    """The base weights plus seeded noise, saved as HF safetensors with config.json."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * noise)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    write_policy_json(out_dir, version, "full", base_model)
    return out_dir


def load_reference(base_model: Path, version_dir: Path | None = None) -> Any:
    """The fp32 transformers model of a version: base, base + adapter, or full weights."""
    import torch
    from transformers import AutoModelForCausalLM

    if version_dir is None:
        return AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32).eval()
    kind = json.loads((version_dir / "policy.json").read_text())["kind"]
    if kind == "full":
        return AutoModelForCausalLM.from_pretrained(str(version_dir), dtype=torch.float32).eval()
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(version_dir)).eval()


def reference_logprobs(model: Any, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """log p(completion token t | prompt, earlier completion tokens) under `model`, fp32."""
    import torch

    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # [seq, vocab]
    logp = torch.log_softmax(logits, dim=-1)
    start = len(prompt_ids)
    return [float(logp[start - 1 + i, tok]) for i, tok in enumerate(completion_ids)]
