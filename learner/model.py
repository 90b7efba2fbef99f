"""The trained policy: the base model with a peft LoRA adapter (default) or all weights trainable.

`token_logprobs` scores served completion tokens exactly as served: prompt and completion ids
are concatenated without re-tokenisation, right-padded, and each completion token's logprob is
read from the position before it. In float32 this matches vLLM's logprobs of the same tokens
within 1e-3 (tests/integration/test_learner_parity.py).

Sampling settings. The behaviour logprobs are vLLM's processed ones (`--logprobs-mode
processed_logprobs`): the log-probability of the distribution each token was actually drawn
from, after temperature, top-k and top-p. So the learner scores tokens under the same
processing, from each row's logged sampling parameters (`processed_log_softmax`); rows at
temperature 1 without truncation take the plain log-softmax, exactly as before. Rows whose
settings cannot be reproduced (greedy, min_p, penalties, logit_bias) never get here: the episode
stream refuses them (learner/data.py `unsupported_sampling`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

# a tied model's two names for its one matrix: the hand-off's, which serving reads too (flywheel.base.versions)
from flywheel.base.versions import EMBED_KEY, HEAD_KEY
from flywheel.learner.config import LearnerConfig
from flywheel.learner.data import Episode
from flywheel.learner.dist import Sharded, local_device, shard_module

log = logging.getLogger(__name__)


def write_tied_head(model_dir: Path) -> bool:
    """Store a tied model's output head in its model.safetensors as a bitwise copy of the input embeddings.

    Why: HF's save drops lm_head.weight of a tied model, and vLLM's in-place reload_weights then
    leaves its lm_head stale. The reload puts each layer on the meta device and re-runs a layer's
    post-load processing only when the file fed that layer; with embed_tokens alone, lm_head is put
    back unprocessed, and on CPU its processing is the GEMM packing (dispatch_cpu_unquantized_gemm
    copies the weight into a oneDNN or sgl handle), so logits kept the old head while the embedding
    lookup used the new matrix: neither version. With both names and equal bits each layer is
    reloaded and repacked from the same values: the reload is exact (tests/integration/test_tied_reload.py).
    A fresh load (server start) skips the alias and loads one matrix. Returns whether the file changed.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from flywheel.base.atomic import Durability, write_with

    path = Path(model_dir) / "model.safetensors"
    with safe_open(str(path), framework="pt") as fh:
        metadata = fh.metadata() or {"format": "pt"}
        tensors = {key: fh.get_tensor(key) for key in fh.keys()}
    if EMBED_KEY not in tensors:
        raise ValueError(f"{path}: a tied model without {EMBED_KEY}; only Qwen2/Llama-style names are supported")
    if HEAD_KEY in tensors:
        if not torch.equal(tensors[HEAD_KEY], tensors[EMBED_KEY]):
            raise ValueError(f"{path}: config ties the embeddings but {HEAD_KEY} differs from {EMBED_KEY}")
        return False
    tensors[HEAD_KEY] = tensors[EMBED_KEY].clone()  # its own storage: safetensors refuses shared tensors
    write_with(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata), Durability.DURABLE)
    return True


# a transformers PreTrainedModel (torch's Module stub types its methods as tensors)
def ties_embeddings(model: Any) -> bool:
    """The HF model shares one Parameter between its input embeddings and its output head."""
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


@dataclass
class Policy:
    """The trainable module plus what publishing and the KL anchor need to know about it."""

    # PeftModel (lora) or a transformers PreTrainedModel (full): nn.Modules whose HF methods (save_pretrained,
    # disable_adapter) torch's Module type does not know, so Any
    module: Any
    mode: str
    base_model: str
    vocab_size: int
    device: torch.device
    ref_module: torch.nn.Module | None = None  # full mode with a KL anchor: a frozen copy of the base
    sharded: Sharded | None = None  # --shard fsdp2 under torchrun: module is fully_shard'ed (learner/dist.py)

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
        """The checkpointed weights, full tensors on CPU (sharded: rank 0's copy from the last gather)."""
        entries = self.sharded.weights if self.sharded is not None else self.module.state_dict()
        if self.mode == "lora":
            from peft import get_peft_model_state_dict

            entries = get_peft_model_state_dict(self.module, state_dict=entries)
        return {k: v.detach().cpu().clone() for k, v in entries.items()}

    def load_weights_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights_state()'s form (full tensors) on every rank: a sharded rank keeps its shards."""
        if self.sharded is not None:
            state = self.sharded.local_state(state)
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
        HF model, so it briefly holds a second copy of the weights. Sharded, each rank loads its shards
        and rank 0 also its gathered copy, from the same file: no collective, so rank 0 may rebase alone.
        """
        if self.mode == "lora":
            if path is None:
                # lora_B = 0 makes every adapter a no-op: exactly the base model
                for name, param in self.module.named_parameters():
                    if "lora_B" in name:
                        param.data.zero_()
                if self.sharded is not None:
                    self.sharded.weights = {k: torch.zeros_like(v) if "lora_B" in k else v
                                            for k, v in self.sharded.weights.items()}
                return
            from peft import set_peft_model_state_dict
            from peft.utils import load_peft_weights

            adapter = load_peft_weights(str(path), device=str(self.device))
            if self.sharded is not None:
                self.sharded.weights = adapter_entries(self.sharded.weights, adapter)
                adapter = self.sharded.local_state(adapter)
            result = set_peft_model_state_dict(self.module, adapter)
            unexpected = getattr(result, "unexpected_keys", [])
            assert not unexpected, f"{path}: adapter has keys this model lacks: {unexpected[:3]}"
            return
        from transformers import AutoModelForCausalLM

        dtype = next(self.module.parameters()).dtype
        source = AutoModelForCausalLM.from_pretrained(str(path or self.base_model), dtype=dtype).state_dict()
        if self.sharded is not None:
            self.sharded.weights = {k: source[k].detach().cpu().clone() for k in self.sharded.names}
            source = self.sharded.local_state(source)
        self.module.load_state_dict(source, strict=True)

    # -- publishing -------------------------------------------------------------------------
    def save_weights(self, out: Path) -> str:
        """Write the servable weights into `out` (adapter or full HF weights); returns the kind."""
        if self.mode == "lora":
            # adapter_model.safetensors + adapter_config.json: the layout /v1/load_lora_adapter reads
            self.module.save_pretrained(str(out), safe_serialization=True, state_dict=self._full_entries())
            config_path = out / "adapter_config.json"
            config = json.loads(config_path.read_text())
            config["base_model_name_or_path"] = str(Path(self.base_model).resolve())
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
            return "lora"
        model = self.module
        dtype = next(model.parameters()).dtype
        model.save_pretrained(str(out), safe_serialization=True, state_dict=self._full_entries())
        if ties_embeddings(model):
            write_tied_head(out)  # else vLLM's in-place reload keeps the old head (write_tied_head says why)
        if dtype != torch.float32:
            log.info("model: saved %s weights (the server loads them in its own --dtype)", dtype)
        return "full"

    def _full_entries(self) -> dict[str, torch.Tensor] | None:
        """What save_pretrained writes: the gathered full copy when sharded, else the module's own state (None)."""
        return dict(self.sharded.weights) if self.sharded is not None else None


def adapter_entries(entries: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`entries` (the model's names, e.g. ...q_proj.lora_A.default.weight) with the values of an adapter file's
    `adapter` (peft's names, ...q_proj.lora_A.weight: the adapter name left out)."""
    out = dict(entries)
    for name in entries:
        parts = name.split(".")
        short = ".".join(parts[:-2] + parts[-1:]) if len(parts) > 2 and parts[-3].startswith("lora_") else name
        if short in adapter:
            out[name] = adapter[short].detach().cpu().clone()
    missing = [n for n in entries if "lora_" in n and out[n] is entries[n]]
    assert not missing, f"adapter lacks entries of this model: {missing[:3]}"
    return out


def _warn_untied_file(cfg: LearnerConfig, model: torch.nn.Module) -> None:
    """A tied base whose file lacks lm_head.weight trains fine, but serving refuses it as policy-v0's restore target."""
    path = Path(cfg.base_model) / "model.safetensors"
    if cfg.mode != "full" or not ties_embeddings(model) or not path.is_file():
        return
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        if HEAD_KEY in fh.keys():
            return
    log.warning("model: %s ties its embeddings but its file has no %s; the versions this learner writes carry it, "
                "but a reload of the base (policy-v0) will be refused: run "
                "flywheel.learner.model.write_tied_head(%r) once", cfg.base_model, HEAD_KEY, cfg.base_model)


def resolve_device(name: str) -> torch.device:
    """The config's device as this process's (under torchrun: its LOCAL_RANK GPU, made the current one)."""
    device = torch.device(local_device(name, torch.cuda.is_available(), os.environ))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # nccl and DDP's device_ids follow the current device
    return device


def load_policy(cfg: LearnerConfig) -> Policy:
    """Load the base model and make it trainable as configured (same seed -> same LoRA init)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = resolve_device(cfg.device)
    dtype = torch.float32 if cfg.dtype == "float32" else torch.bfloat16
    hf_config = AutoConfig.from_pretrained(cfg.base_model)

    def load_base() -> Any:
        # eager attention: identical maths on CPU and GPU, and no sdpa kernel choice changing logprobs
        base: Any = AutoModelForCausalLM.from_pretrained(cfg.base_model, dtype=dtype, attn_implementation="eager")
        base = base.to(device)
        base.config.use_cache = False
        return base

    model = load_base()
    _warn_untied_file(cfg, model)
    torch.manual_seed(cfg.seed)
    if cfg.mode == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_rank,
                          # peft types it int; a float scale is valid
                          lora_alpha=cfg.lora_alpha,  # type: ignore[arg-type]
                          lora_dropout=0.0, bias="none",
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
    sharded = None
    if cfg.shard == "fsdp2" and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        sharded = shard_module(module, device, trainable_only=cfg.mode == "lora")
    return Policy(module, cfg.mode, cfg.base_model, int(hf_config.vocab_size), device, ref, sharded)


@dataclass
class Packed:
    """A right-padded micro-batch. L = longest prompt+completion, T = longest completion."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    gather_pos: torch.Tensor  # [B, T] position whose logits predict completion token t
    targets: torch.Tensor  # [B, T] completion token ids (0 on padding)
    mask: torch.Tensor  # [B, T] loss_mask, 0 on padding
    logp_old: torch.Tensor  # [B, T] behaviour logprobs, 0 on padding
    sampling: Sampling | None = None  # None: every row at temperature 1 without truncation


@dataclass
class Sampling:
    """Each row's sampling parameters as vLLM applies them (a row without a setting holds the neutral value)."""

    temperature: torch.Tensor  # [B] float32, > 0
    top_k: torch.Tensor  # [B] long, 0 (or V and more): off
    top_p: torch.Tensor  # [B] float32, 1.0: off


# vLLM's defaults for a key the request left out (its SamplingParams; top_k 0 or -1 means off)
NEUTRAL_SAMPLING = (1.0, 0, 1.0)


def sampling_values(sampling: dict[str, Any] | None) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) of a row's logged sampling parameters; a missing or null key is vLLM's default.

    Assumes `unsupported_sampling(sampling)` (learner/data.py) is None: the values are valid numbers.
    """
    s = sampling or {}
    temperature = float(s["temperature"]) if s.get("temperature") is not None else NEUTRAL_SAMPLING[0]
    top_k = int(s["top_k"]) if s.get("top_k") is not None else NEUTRAL_SAMPLING[1]
    top_p = float(s["top_p"]) if s.get("top_p") is not None else NEUTRAL_SAMPLING[2]
    return temperature, max(top_k, 0), top_p


def pack_sampling(episodes: Sequence[Episode]) -> Sampling | None:
    """The rows' sampling tensors, or None when every row is neutral (the plain log-softmax applies)."""
    values = [sampling_values(e.sampling) for e in episodes]
    if all(v == NEUTRAL_SAMPLING for v in values):
        return None
    return Sampling(temperature=torch.tensor([t for t, _, _ in values], dtype=torch.float32),
                    top_k=torch.tensor([k for _, k, _ in values], dtype=torch.long),
                    top_p=torch.tensor([p for _, _, p in values], dtype=torch.float32))


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
    sampling = pack_sampling(episodes)
    if sampling is not None:
        sampling = Sampling(sampling.temperature.to(device), sampling.top_k.to(device), sampling.top_p.to(device))
    return Packed(input_ids.to(device), attention.to(device), gather_pos.to(device), targets.to(device),
                  mask.to(device), logp_old.to(device), sampling)


def truncation_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """[B, T, V] True where vLLM's top-k then top-p drop the token; None when no row truncates.

    scaled: [B, T, V] temperature-scaled logits; top_k, top_p: [B]. The rules of vLLM's sampler
    (v1/sample/ops/topk_topp_sampler.py, apply_top_k_top_p_pytorch): top-k keeps every logit >=
    the k-th largest (ties kept); top-p then renormalises what top-k kept, sorts ascending and
    drops the tokens whose cumulative probability is <= 1 - p (the largest always stays), i.e. it
    keeps each token whose strictly more probable tokens hold less than p, the smallest set
    reaching p. Without gradient: the set is a constant of the step, like vLLM's.
    """
    V = scaled.shape[-1]
    k_on, p_on = (top_k > 0) & (top_k < V), top_p < 1.0  # [B]: vLLM's own "is it on" tests
    if not (bool(k_on.any()) or bool(p_on.any())):
        return None
    with torch.no_grad():
        srt, order = scaled.sort(dim=-1)  # [B, T, V] ascending
        k = torch.where(k_on, top_k, V)[:, None, None].expand(-1, srt.shape[1], 1)  # [B, T, 1]
        kth = srt.gather(-1, V - k)  # [B, T, 1] the k-th largest logit
        drop = (srt < kth) & k_on[:, None, None]
        cum = srt.masked_fill(drop, float("-inf")).softmax(dim=-1).cumsum(dim=-1)  # [B, T, V]
        drop_p = cum <= (1.0 - top_p)[:, None, None]
        drop_p[..., -1] = False
        drop |= drop_p & p_on[:, None, None]
        return torch.zeros_like(drop).scatter(-1, order, drop)


def processed_log_softmax(logits: torch.Tensor, sampling: Sampling, keep: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, V] log-probabilities of the distribution vLLM samples from: logits / T, top-k, top-p, renormalised.

    logits: [B, T, V] float32. keep: [B, T] token ids never truncated (the served tokens: the
    behaviour drew them, so they lay in its truncation set; a policy that has moved since must not
    give one -inf, which would turn the loss's ratio * logp into 0 * inf).
    Gradients flow through the renormalised log-softmax of the kept tokens.
    """
    scaled = logits / sampling.temperature[:, None, None]  # [B, T, V]
    drop = truncation_mask(scaled, sampling.top_k, sampling.top_p)
    if drop is None:
        return torch.log_softmax(scaled, dim=-1)
    if keep is not None:
        drop = drop.scatter(-1, keep[:, :, None], False)
    return torch.log_softmax(scaled.masked_fill(drop, float("-inf")), dim=-1)


def completion_logits(module: torch.nn.Module, packed: Packed) -> torch.Tensor:
    """[B, T, V] float32 logits at the positions that predict the completion tokens."""
    out = module(input_ids=packed.input_ids, attention_mask=packed.attention_mask, use_cache=False)
    logits: torch.Tensor = out.logits  # [B, L, V]
    idx = packed.gather_pos[:, :, None].expand(-1, -1, logits.shape[-1])  # [B, T, V]
    return torch.gather(logits, 1, idx).float()  # [B, T, V]: only the completion positions


def target_logprobs(picked: torch.Tensor, packed: Packed, processed: bool = True) -> torch.Tensor:
    """[B, T] logprob of each completion token from its logits `picked` [B, T, V].

    processed: under each row's sampling parameters (what the behaviour logprobs are); False:
    the plain log-softmax (the model itself: the KL anchor, vLLM's prompt_logprobs).
    """
    if processed and packed.sampling is not None:
        logp = processed_log_softmax(picked, packed.sampling, keep=packed.targets)  # [B, T, V]
    else:
        logp = torch.log_softmax(picked, dim=-1)  # [B, T, V]
    return torch.gather(logp, 2, packed.targets[:, :, None]).squeeze(-1)  # [B, T]


def token_logprobs(module: torch.nn.Module, packed: Packed, processed: bool = True) -> torch.Tensor:
    """[B, T] logprob of each completion token under `module` (float32; see target_logprobs for `processed`)."""
    return target_logprobs(completion_logits(module, packed), packed, processed)


def token_logprobs_and_raw(module: torch.nn.Module, packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] processed, [B, T] plain) logprobs from one forward; the same tensor twice when no row is processed."""
    picked = completion_logits(module, packed)
    logp = target_logprobs(picked, packed)
    return logp, (logp if packed.sampling is None else target_logprobs(picked, packed, processed=False))


def reference_log_softmax(ref: torch.nn.Module, packed: Packed) -> torch.Tensor:
    """[B, T, V] the reference model's plain log-softmax at the completion positions (kl_estimator exact)."""
    return torch.log_softmax(completion_logits(ref, packed), dim=-1)


def token_logprobs_and_exact_kl(module: torch.nn.Module, packed: Packed,
                                ref_full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] processed logprobs, [B, T] KL(module || ref) over the whole vocabulary at each position) from one
    forward; ref_full is reference_log_softmax's [B, T, V]. The KL compares the plain distributions (no sampling
    truncation), as the k3 anchor does."""
    picked = completion_logits(module, packed)
    full = torch.log_softmax(picked, dim=-1)  # [B, T, V]
    return target_logprobs(picked, packed), (full.exp() * (full - ref_full)).sum(dim=-1)


def describe(policy: Policy) -> dict[str, Any]:
    return {"mode": policy.mode, "base_model": policy.base_model, "device": str(policy.device)}
