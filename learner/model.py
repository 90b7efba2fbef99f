"""The trained policy: the base model with a peft LoRA adapter (default) or all weights trainable.

`token_logprobs` scores served completion tokens exactly as served: prompt and completion ids
are concatenated without re-tokenisation, right-padded, and each completion token's logprob is
read from the position before it. In float32 this matches vLLM's logprobs of the same tokens
within 1e-3 (tests/integration/test_learner_parity.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from flywheel.learner.config import LearnerConfig
from flywheel.learner.data import Episode

log = logging.getLogger(__name__)


@dataclass
class Policy:
    """The trainable module plus what publishing and the KL anchor need to know about it."""

    module: torch.nn.Module  # PeftModel (lora) or the HF model (full)
    mode: str
    base_model: str
    vocab_size: int
    device: torch.device
    ref_module: torch.nn.Module | None = None  # full mode with a KL anchor: a frozen copy of the base

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The base model for the KL anchor: the adapter disabled (lora) or the frozen copy (full)."""
        if self.mode != "lora":
            if self.ref_module is None:
                raise RuntimeError("full mode keeps a frozen base copy only when loaded with kl_coef > 0")
            yield self.ref_module
            return
        with self.module.disable_adapter():
            yield self.module

    # -- checkpoint state (trainable weights only: the base is re-read from base_model) -------
    def weights_state(self) -> dict[str, torch.Tensor]:
        if self.mode == "lora":
            from peft import get_peft_model_state_dict

            return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(self.module).items()}
        return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def load_weights_state(self, state: dict[str, torch.Tensor]) -> None:
        if self.mode == "lora":
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.module, state)
            unexpected = getattr(result, "unexpected_keys", [])
            assert not unexpected, f"checkpoint adapter has keys this model lacks: {unexpected[:3]}"
        else:
            self.module.load_state_dict(state, strict=True)

    def load_published(self, path: Path | None) -> None:
        """Make the trainable weights those of a published version directory (None: policy-v0, the base).

        In place (the optimizer keeps its parameter references). Full mode reads the directory as an
        HF model, so it briefly holds a second copy of the weights.
        """
        if self.mode == "lora":
            if path is None:
                # lora_B = 0 makes every adapter a no-op: exactly the base model
                for name, param in self.module.named_parameters():
                    if "lora_B" in name:
                        param.data.zero_()
                return
            from peft import set_peft_model_state_dict
            from peft.utils import load_peft_weights

            result = set_peft_model_state_dict(self.module, load_peft_weights(str(path), device=str(self.device)))
            unexpected = getattr(result, "unexpected_keys", [])
            assert not unexpected, f"{path}: adapter has keys this model lacks: {unexpected[:3]}"
            return
        from transformers import AutoModelForCausalLM

        dtype = next(self.module.parameters()).dtype
        source = AutoModelForCausalLM.from_pretrained(str(path or self.base_model), dtype=dtype)
        self.module.load_state_dict(source.state_dict(), strict=True)

    # -- publishing -------------------------------------------------------------------------
    def save_weights(self, out: Path) -> str:
        """Write the servable weights into `out` (adapter or full HF weights); returns the kind."""
        if self.mode == "lora":
            # adapter_model.safetensors + adapter_config.json: the layout /v1/load_lora_adapter reads
            self.module.save_pretrained(str(out), safe_serialization=True)
            config_path = out / "adapter_config.json"
            config = json.loads(config_path.read_text())
            config["base_model_name_or_path"] = str(Path(self.base_model).resolve())
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
            return "lora"
        model = self.module
        dtype = next(model.parameters()).dtype
        model.save_pretrained(str(out), safe_serialization=True)
        if dtype != torch.float32:
            log.info("model: saved %s weights (the server loads them in its own --dtype)", dtype)
        return "full"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA device")
    return torch.device(name)


def load_policy(cfg: LearnerConfig) -> Policy:
    """Load the base model and make it trainable as configured (same seed -> same LoRA init)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = resolve_device(cfg.device)
    dtype = torch.float32 if cfg.dtype == "float32" else torch.bfloat16
    hf_config = AutoConfig.from_pretrained(cfg.base_model)
    if cfg.mode == "full" and getattr(hf_config, "tie_word_embeddings", False):
        # vLLM's in-place reload of tied embeddings matched neither old nor new weights (design.md facts)
        raise RuntimeError(f"mode=full needs an untied model; {cfg.base_model} ties its embeddings (use mode=lora)")

    def load_base() -> Any:
        # eager attention: identical maths on CPU and GPU, and no sdpa kernel choice changing logprobs
        base = AutoModelForCausalLM.from_pretrained(cfg.base_model, dtype=dtype, attn_implementation="eager").to(device)
        base.config.use_cache = False
        return base

    model = load_base()
    torch.manual_seed(cfg.seed)
    if cfg.mode == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, bias="none",
                          target_modules=list(cfg.lora_targets), task_type="CAUSAL_LM")
        module: torch.nn.Module = get_peft_model(model, lora)
    else:
        module = model
        for p in module.parameters():
            p.requires_grad_(True)
    module.train()  # no dropout in these models; train() only matters for modules that have it
    n_train = sum(p.numel() for p in module.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in module.parameters())
    log.info("model: %s from %s on %s (%s), %d of %d parameters trainable", cfg.mode, cfg.base_model, device,
             cfg.dtype, n_train, n_all)
    ref = None
    if cfg.mode == "full" and cfg.kl_coef > 0:
        # a second copy of the base: full training has no adapter to switch off (memory: one more model)
        ref = load_base().eval().requires_grad_(False)
    return Policy(module, cfg.mode, cfg.base_model, int(hf_config.vocab_size), device, ref)


@dataclass
class Packed:
    """A right-padded micro-batch. L = longest prompt+completion, T = longest completion."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    gather_pos: torch.Tensor  # [B, T] position whose logits predict completion token t
    targets: torch.Tensor  # [B, T] completion token ids (0 on padding)
    mask: torch.Tensor  # [B, T] loss_mask, 0 on padding
    logp_old: torch.Tensor  # [B, T] behaviour logprobs, 0 on padding


def pack(episodes: Sequence[Episode], device: torch.device) -> Packed:
    """Concatenate each row's prompt and completion ids (as served) and right-pad the batch."""
    B = len(episodes)
    L = max(e.seq_len for e in episodes)
    T = max(len(e.completion_ids) for e in episodes)
    input_ids = torch.zeros(B, L, dtype=torch.long)
    attention = torch.zeros(B, L, dtype=torch.long)
    gather_pos = torch.zeros(B, T, dtype=torch.long)
    targets = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    logp_old = torch.zeros(B, T)
    for i, e in enumerate(episodes):
        ids = list(e.prompt_ids) + list(e.completion_ids)
        P, C = len(e.prompt_ids), len(e.completion_ids)
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        # the logits at position P-1+t predict completion token t
        gather_pos[i, :C] = torch.arange(P - 1, P - 1 + C)
        targets[i, :C] = torch.tensor(e.completion_ids)
        mask[i, :C] = torch.tensor(e.loss_mask, dtype=torch.float32)
        logp_old[i, :C] = torch.tensor(e.behaviour_logprobs, dtype=torch.float32)
    return Packed(input_ids.to(device), attention.to(device), gather_pos.to(device), targets.to(device),
                  mask.to(device), logp_old.to(device))


def token_logprobs(module: torch.nn.Module, packed: Packed) -> torch.Tensor:
    """[B, T] logprob of each completion token under `module` (float32 log-softmax)."""
    out = module(input_ids=packed.input_ids, attention_mask=packed.attention_mask, use_cache=False)
    logits: torch.Tensor = out.logits  # [B, L, V]
    idx = packed.gather_pos[:, :, None].expand(-1, -1, logits.shape[-1])  # [B, T, V]
    picked = torch.gather(logits, 1, idx).float()  # [B, T, V]: only the completion positions
    logp = torch.log_softmax(picked, dim=-1)  # [B, T, V]
    return torch.gather(logp, 2, packed.targets[:, :, None]).squeeze(-1)  # [B, T]


def describe(policy: Policy) -> dict[str, Any]:
    return {"mode": policy.mode, "base_model": policy.base_model, "device": str(policy.device)}
