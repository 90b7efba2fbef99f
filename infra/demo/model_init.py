"""`flywheel model init`: build the tiny base model locally, with no network.

No model can be downloaded here, so tests and the demo use a model the project builds
itself: a byte-level BPE tokenizer trained on a generated corpus, a ChatML chat template,
and a small Qwen2-style causal LM (head_dim 64, because vLLM's CPU attention rejects 16;
untied embeddings unless `--tie-word-embeddings`, which builds the shape of most small
open models), saved in Hugging Face format so that vLLM, transformers and peft all load it.
Real deployments skip this and pass their own model directory (`--base-model`).

    flywheel model init                 # var/models/tiny-base (random weights)
    flywheel model init --warm-start    # also var/models/tiny-warm (briefly supervised on the demo task)
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flywheel.base import defaults
from flywheel.base.atomic import Durability, publish
from flywheel.base.config import (
    ConfigError,
    load_config,
    setting,
    setup_logging,
    write_resolved,
)

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, the format of Qwen2 chat models: vLLM's chat endpoint renders prompts with it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WARM_MODEL_DIR = "var/models/tiny-warm"


@dataclass
class ModelInitConfig:
    """Build the tiny base model (tokenizer + Qwen2-style causal LM) under var/models/."""

    action: str = setting("init", "what to do; only 'init' exists")
    out: Path = setting(Path(defaults.BASE_MODEL_DIR), "directory of the base model to write")
    force: bool = setting(False, "rebuild even if the directory already holds a model")
    vocab_size: int = setting(512, "BPE vocabulary size, special tokens included (the demo's tool names come on top, "
                                   "one token each, see build_tokenizer: the model's vocabulary is 526)")
    hidden_size: int = setting(256, "model width")
    num_layers: int = setting(4, "decoder layers")
    num_heads: int = setting(4, "attention heads; head_dim = hidden_size / num_heads must be 64 for vLLM on CPU")
    num_kv_heads: int = setting(4, "key/value heads (grouped-query attention when fewer than num_heads)")
    intermediate_size: int = setting(768, "MLP width")
    max_position_embeddings: int = setting(2048, "context length")
    corpus_lines: int = setting(20000, "lines of generated text the tokenizer is trained on")
    seed: int = setting(0, "seed of the corpus and the initial weights (same seed, same model)")
    tie_word_embeddings: bool = setting(False, "share one matrix between input embeddings and output head, as "
                                               "Qwen2.5 0.5-3B and Llama 3.2 1-3B do (the demo's model is untied)")
    warm_start: bool = setting(False, "also write a warm-started copy, briefly supervised on the demo task")
    warm_out: Path = setting(Path(WARM_MODEL_DIR), "directory of the warm-started model")

    def check(self) -> None:
        if self.action != "init":
            raise ConfigError(f"action: unknown action {self.action!r}; use `flywheel model init`")
        if self.hidden_size % self.num_heads:
            raise ConfigError("hidden_size must be a multiple of num_heads")
        if self.hidden_size // self.num_heads != 64:
            raise ConfigError(
                f"hidden_size / num_heads = {self.hidden_size // self.num_heads}; vLLM's CPU attention "
                "needs head_dim 64"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_heads must be a multiple of num_kv_heads")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ConfigError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (all bytes + special tokens)")


_WORDS = (
    "the a an of to and in is it you that for on with as are be this was have or at by not from but what all "
    "were when we there can more if no out so said do up about who which their will how many file test code "
    "function return value result answer question tool call user assistant system error ok true false none "
    "list add sum multiply lookup weather city number name price stock capital country search read write edit "
    "python json data model train reward agent session task please thanks compute find get set plan step done"
).split()


def _generated_corpus(n: int, rng: random.Random) -> list[str]:
    """Text with the shapes the model will see: prose, numbers, JSON tool calls, ChatML turns."""
    lines: list[str] = []
    for i in range(n):
        kind = i % 4
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14)))
        if kind == 0:
            lines.append(words.capitalize() + rng.choice([".", "?", "!"]))
        elif kind == 1:
            a, b = rng.randint(0, 9999), rng.randint(0, 9999)
            lines.append(f"{words} {a} + {b} = {a + b}; {a} * {b % 100} = {a * (b % 100)}")
        elif kind == 2:
            args = {rng.choice(_WORDS): rng.choice([rng.randint(0, 999), rng.choice(_WORDS)]) for _ in range(2)}
            lines.append('<tool_call>{"name": "%s", "arguments": %s}</tool_call>'
                         % (rng.choice(_WORDS), json.dumps(args)))
        else:
            lines.append(f"<|im_start|>user\n{words}<|im_end|>\n<|im_start|>assistant\n{words[::-1]}<|im_end|>")
    return lines


def _task_tokens() -> list[str]:
    """Words the demo task family wants as single tokens (every harness generation's tool names), when it has any."""
    try:
        from flywheel.demo import tasks
    except ImportError:
        return []
    names = getattr(tasks, "TOOL_NAMES", {})
    return sorted({name for generation in names.values() for name in generation})


def _task_corpus(n: int) -> list[str]:
    """The demo task family's own texts, when infra.tasks provides them (so the BPE merges fit the task)."""
    try:
        from flywheel.demo import tasks
    except ImportError:
        return []
    corpus_lines = getattr(tasks, "corpus_lines", None)
    return list(corpus_lines(n)) if callable(corpus_lines) else []


def build_tokenizer(cfg: ModelInitConfig, out: Path) -> "object":
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(cfg.seed)
    corpus = _generated_corpus(cfg.corpus_lines, rng) + _task_corpus(cfg.corpus_lines)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    # The tool names as whole tokens, as a real model's tokenizer has such words: the naming conventions then differ
    # in one decision, not in length. Not by a larger BPE vocabulary: at 1024 a city became one token in a request
    # (" paris") and another in a call ("paris"), where at 512 both share their pieces, and the warm start copied
    # the city into its call 10-15% of the time instead of nearly always.
    tok.add_tokens(_task_tokens())
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=cfg.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    log.info("model init: tokenizer with %d tokens trained on %d lines", len(fast), len(corpus))
    return fast


def build_model(cfg: ModelInitConfig, tokenizer: Any, out: Path) -> int:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(cfg.seed)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(  # type: ignore[call-arg]  # the stub lags transformers' keyword arguments
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, bos_token_id=pad)
    model.save_pretrained(str(out), safe_serialization=True)
    if cfg.tie_word_embeddings:
        from flywheel.learner.model import write_tied_head

        write_tied_head(out)  # the base is a reload target too (policy-v0): vLLM needs lm_head.weight in it
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model init: Qwen2 %d layers, hidden %d, %d heads of 64, %.2fM parameters",
             cfg.num_layers, cfg.hidden_size, cfg.num_heads, n_params / 1e6)
    return n_params


def is_model_dir(path: Path) -> bool:
    return ((path / "config.json").is_file() and (path / "model.safetensors").is_file()
            and (path / "tokenizer.json").is_file())


BUILD_RECORD = "flywheel-model-build.json"


def build_identity(cfg: ModelInitConfig) -> dict[str, Any]:
    """What the built model depends on: its shape, its seed and the text its tokenizer was trained on (the task
    family's vocabulary changes with infra/demo/tasks.py). A directory built from another identity is rebuilt."""
    import hashlib

    rng = random.Random(cfg.seed)
    corpus = _generated_corpus(cfg.corpus_lines, rng) + _task_corpus(cfg.corpus_lines)
    corpus.append(" ".join(_task_tokens()))  # the added tokens are part of what the tokenizer is
    fields = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
              "max_position_embeddings", "corpus_lines", "seed", "tie_word_embeddings")
    return {**{k: getattr(cfg, k) for k in fields},
            "corpus_sha256": hashlib.sha256("\n".join(corpus).encode()).hexdigest()}


def init_model(cfg: ModelInitConfig) -> Path:
    """Write the base model (atomically: a half-built directory is never left under the final name)."""
    out = Path(cfg.out)
    identity = build_identity(cfg)
    if is_model_dir(out) and not cfg.force:
        try:
            built = json.loads((out / BUILD_RECORD).read_text())
        except (OSError, ValueError):
            built = None
        if built == identity:
            log.info("model init: %s already holds this model (use --force to rebuild)", out)
            return out
        log.info("model init: %s was built from other settings or another task vocabulary; rebuilding", out)
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = build_tokenizer(cfg, tmp)
    build_model(cfg, tokenizer, tmp)
    write_resolved(cfg, tmp / "flywheel-model-init.toml")
    (tmp / BUILD_RECORD).write_text(json.dumps(identity, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    publish(tmp, out, Durability.ADVISORY)  # rebuilt from its seed if lost
    log.info("model init: base model ready at %s", out)
    return out


def ensure_base_model(path: str | Path = defaults.BASE_MODEL_DIR) -> Path:
    """Build the default tiny model at `path` if it is not there (used by infra up, tests, demo)."""
    return init_model(ModelInitConfig(out=Path(path)))


def run(cfg: ModelInitConfig) -> int:
    base = init_model(cfg)
    if cfg.warm_start:
        from flywheel.demo import warm_start

        # the default settings, as `flywheel demo` without a recipe's [warm] table checks them
        if warm_start.is_current(Path(cfg.warm_out), base, settings=warm_start.WarmStartSettings()) and not cfg.force:
            log.info("model init: %s already holds the warm start of %s (use --force to rebuild)", cfg.warm_out, base)
        else:
            warm_start.run(base, Path(cfg.warm_out))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # `flywheel model init [flags]`: the positional action maps onto the typed config
    if args and not args[0].startswith("-"):
        args = ["--action", args[0]] + args[1:]
    cfg = load_config(ModelInitConfig, args, prog="flywheel model")
    setup_logging()
    return run(cfg)
