"""The policy-version hand-off between the learner and serving, in one place below both.

Version N is served, logged and stored as `policy-v<N>` (0 is the base). The learner writes
<policies_dir>/policy-v<N>/ holding policy.json (its metadata) and either a PEFT adapter (LORA_FILES,
kind "lora") or full Hugging Face weights (FULL_FILES, kind "full"); serving (publisher, router, gate)
reads the same names. A tied model's file also carries the output head (HEAD_KEY) as a copy of the
embeddings (EMBED_KEY): vLLM's in-place reload re-processes only the tensors the file holds.
"""

from __future__ import annotations

import re
from pathlib import Path

PREFIX = "policy-v"
POLICY_META = "policy.json"
LORA_FILES = ("adapter_config.json", "adapter_model.safetensors")
FULL_FILES = ("config.json", "model.safetensors")
WEIGHTS_FILE = "model.safetensors"
EMBED_KEY = "model.embed_tokens.weight"  # Qwen2/Llama-style names
HEAD_KEY = "lm_head.weight"
_NAME = re.compile(r"^policy-v(\d+)$")
# The version logged for a call to a frozen model outside the learner's line (the swarm's sub-agents: the proxy's
# frozen_models). On no line, so no learner trains its rows (learner.data counts them as "frozen").
FROZEN_VERSION = -1


def version_name(version: int) -> str:
    return f"{PREFIX}{int(version)}"


def parse_version(name: str) -> int | None:
    """N for `policy-v<N>`, None for any other name (a base served name, a directory, a typo)."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def version_dir(policies_dir: str | Path, version: int) -> Path:
    """Where the learner writes policy-v<version> and serving reads it."""
    return Path(policies_dir) / version_name(version)
