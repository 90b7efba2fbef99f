"""The HTTP client of one vLLM server: the OpenAI routes the gate uses and the admin calls a publish makes.

Every call is one JSON request with a timeout; a failed request raises ServerError carrying the
server's own error text, so callers catch one type whatever failed (refused, down, timed out).

    served_models / weight_version                what a server serves now (/v1/models, /weight_info)
    load_lora_adapter / unload_lora_adapter       runtime LoRA slots (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    pause / resume / is_paused                    hold new requests around a full-weight reload
    reload_weights / reset_prefix_cache /         swap full weights in place and record their version
      update_weight_version                         (VLLM_SERVER_DEV_MODE endpoints)
    world_size                                    the server's NCCL world (weight-transfer path)

Who may call the admin endpoints: only the publishing side (flywheel.serving.publisher, and the
promoter when it makes the tier serve a restored version), never an agent. vLLM serves them
without authentication, and any caller reaching them can swap the weights every session is
served with or stall the tier. So the vLLM servers listen on loopback or a private network
(infra/stack.py binds 127.0.0.1) and agents reach them only through the capture proxy
(flywheel.serving.proxy), which forwards nothing but /v1/chat/completions, /v1/completions and
/v1/models.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from flywheel.base.versions import parse_version, version_name


class ServerError(RuntimeError):
    """A request to a vLLM server failed; the message names the request and the server's answer."""


def http(method: str, url: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> Any:
    """One JSON request; raises ServerError with the server's own error text."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise ServerError(f"{method} {url} -> HTTP {exc.code}: {detail}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ServerError(f"{method} {url} -> {exc}") from exc
    try:
        return json.loads(text) if text.strip() else None
    except json.JSONDecodeError:  # some endpoints (load_lora_adapter) answer plain text
        return text


# -- what a server serves ---------------------------------------------------------------------
def served_models(server: str, timeout: float = 10.0) -> list[str]:
    """The model names a server answers to: its base served name and every resident LoRA adapter."""
    return [m["id"] for m in http("GET", f"{server}/v1/models", timeout=timeout)["data"]]


def weight_version(server: str, timeout: float = 10.0) -> int:
    """The full-weight version a server holds (0 while it still has the weights it started with)."""
    reported = http("GET", f"{server}/weight_info", timeout=timeout).get("weight_version")
    return parse_version(str(reported)) or 0


# -- LoRA slots -------------------------------------------------------------------------------
def load_lora_adapter(server: str, name: str, path: Path | str, timeout: float = 60.0) -> None:
    """Load the adapter directory `path` (readable by the server) under the served name `name`."""
    http("POST", f"{server}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, timeout)


def unload_lora_adapter(server: str, name: str, timeout: float = 60.0) -> None:
    """Free the LoRA slot of the adapter served as `name`."""
    http("POST", f"{server}/v1/unload_lora_adapter", {"lora_name": name}, timeout)


# -- full weights (dev-mode admin endpoints) --------------------------------------------------
def pause(server: str, timeout: float = 60.0) -> None:
    """Pause with mode=wait: running requests finish on the current weights, new ones queue until resume."""
    http("POST", f"{server}/pause?mode=wait", None, timeout)


def resume(server: str, timeout: float = 60.0) -> None:
    """Let queued and new requests run again."""
    http("POST", f"{server}/resume", None, timeout)


def is_paused(server: str, timeout: float = 60.0) -> bool:
    return bool(http("GET", f"{server}/is_paused", None, timeout).get("is_paused"))


def reload_weights(server: str, path: Path | str, timeout: float = 60.0) -> None:
    """Reload full weights in place from a directory the server can read (collective_rpc reload_weights)."""
    http("POST", f"{server}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
         timeout)


def reset_prefix_cache(server: str, timeout: float = 60.0) -> None:
    """Drop the server's cached prefix KV; call it after new weights are in and before requests run.

    vLLM keeps prefix-cache blocks across reload_weights (by design: vllm#46125 leaves the reset to
    the caller), so the new weights would decode on KV the old ones computed for every cached
    prefix: the agent's system prompt and each earlier turn of a session. /pause clears the cache
    by default in this vLLM (its clear_cache flag is marked deprecated), but a reload without a
    pause kept it: in tests/integration/test_publish.py a 300-token cached prompt decoded 1.29 nats
    away from the restored base weights; the demo's start reloads policy-v0 that way, the NCCL
    path never pauses. It only succeeds when no request holds blocks: call it paused or idle.
    """
    out = http("POST", f"{server}/reset_prefix_cache", None, timeout)
    if isinstance(out, dict) and out.get("success") is False:
        raise ServerError(f"{server}: /reset_prefix_cache refused (requests still hold cache blocks)")


def update_weight_version(server: str, version: int, timeout: float = 60.0) -> None:
    """Record the weights a server holds as policy-v<version> (what /weight_info reports from now on)."""
    http("POST", f"{server}/update_weight_version", {"new_version": version_name(version)}, timeout)


def world_size(server: str, timeout: float = 60.0) -> int:
    """The server's world size without data parallelism (its tensor-parallel ranks)."""
    return int(http("GET", f"{server}/get_world_size?include_dp=false", timeout=timeout)["world_size"])
