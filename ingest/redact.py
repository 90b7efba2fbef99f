"""Default redaction of secrets and personal data from text before an event leaves the host.

The SDK and the proxy run every text field of an event (prompt and completion text, tool
arguments and output, sub-task descriptions, tags) through a `Redactor`, a plain
`Callable[[str], str]`, in the SDK's background thread, never on the agent's hot path.
`redact_text` is the default; pass your own function to SessionLogger(redact=...) to add
rules, or `redact=None` to turn redaction off.

The default removes what leaks most often from agent traffic:

* e-mail addresses -> `[EMAIL]`
* bearer tokens (`Authorization: Bearer ...`) -> `Bearer [TOKEN]`
* API-key-like strings: well-known prefixes (OpenAI/Anthropic `sk-`, GitHub `ghp_`/`github_pat_`,
  Slack `xox?-`, AWS `AKIA`, Google `AIza`, HF `hf_`) and `key=value` assignments whose key names
  a secret (api_key, token, secret, password) -> `[API_KEY]` / `key=[REDACTED]`

It is deliberately conservative: no entropy heuristics, because hashes and ids in code are
legitimate training data and a false positive silently corrupts a trajectory.
"""

from __future__ import annotations

import re
from typing import Any, Callable

Redactor = Callable[[str], str]

_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
_BEARER = re.compile(r"(?i)\bbearer\s+[A-Za-z0-9\-._~+/]{8,}=*")
_KEY_PREFIXES = re.compile(
    r"\b(?:"
    r"sk-(?:ant-|proj-)?[A-Za-z0-9_\-]{16,}"  # OpenAI, Anthropic
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"  # GitHub
    r"|xox[abposr]-[A-Za-z0-9\-]{10,}"  # Slack
    r"|AKIA[0-9A-Z]{16}"  # AWS access key id
    r"|AIza[0-9A-Za-z_\-]{30,}"  # Google API key
    r"|hf_[A-Za-z0-9]{20,}"  # Hugging Face
    r")"
)
# `api_key = "..."`, `"password": "..."`, `TOKEN=...`: keep the key name (useful context), drop the value.
_ASSIGNMENT = re.compile(
    r"(?i)\b([A-Za-z0-9_\-]*(?:api[_\-]?key|secret|token|passwd|password)[A-Za-z0-9_\-]*)"
    r"(\"?\s*[:=]\s*[\"']?)([^\s\"',;]{6,})"
)
# Cheap pre-check: most text contains none of these, and substring tests run in C at memory speed
# (a case-insensitive alternation regex costs ~40 us on a few hundred characters).
_HINTS = ("bearer", "sk-", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "xox", "akia", "aiza", "hf_",
          "key", "secret", "token", "passw")


def _may_hold_secret(text: str) -> bool:
    if "@" in text:
        return True
    lowered = text.lower()
    return any(hint in lowered for hint in _HINTS)


def redact_text(text: str) -> str:
    """Return `text` with e-mail addresses, bearer tokens and API-key-like strings replaced."""
    if not _may_hold_secret(text):
        return text
    text = _BEARER.sub("Bearer [TOKEN]", text)
    text = _KEY_PREFIXES.sub("[API_KEY]", text)
    text = _ASSIGNMENT.sub(lambda m: f"{m.group(1)}{m.group(2)}[REDACTED]", text)
    return _EMAIL.sub("[EMAIL]", text)


def redact_json(value: Any, redactor: Redactor) -> Any:
    """Apply `redactor` to every string inside a JSON-like value (dict keys are kept as they are)."""
    if isinstance(value, str):
        return redactor(value)
    if isinstance(value, dict):
        return {k: redact_json(v, redactor) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_json(v, redactor) for v in value]
    return value
