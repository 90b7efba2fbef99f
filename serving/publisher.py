"""Weight publisher: make every vLLM server of the tier serve a policy version, then register it.

The learner hands over a finished directory (docs/CONTRIBUTING.md, "Policy versions"):

    var/policies/policy-v<N>/  policy.json + PEFT adapter (kind "lora") or full HF weights (kind "full")

`publish(version_dir)`:
1. validates the directory before touching any server (a corrupt adapter or mismatched weights
   raise PublishError and nothing changes: the old version keeps serving);
2. pushes it to the servers of the tier:
   - lora: every server; POST /v1/load_lora_adapter under the served name policy-v<N>; adapters that are no
     longer routed (neither champion, challenger nor among the newest few) are unloaded first so
     the server stays within --max-loras;
   - full: a server holds one version, so a full version goes only to servers no live version
     needs (`full_targets`): one server keeps each of the champion and the control (and a pending
     challenger is replaced), so champion, challenger and control are served at the same time and
     a publish never replaces the champion's weights. No free server: PublishError (or, with
     `replace_live`, the old one-server behaviour).
   - full, transport "http": POST /pause?mode=wait (running requests finish on the old weights,
     new ones queue), /collective_rpc reload_weights from the directory, /reset_prefix_cache (vLLM
     keeps the old weights' cached KV otherwise), /update_weight_version, POST /resume. A failed
     reload is undone by reloading the weights the server held before.
     A tied-embedding model reloads exactly only when its file holds lm_head.weight equal to the
     embeddings (flywheel.learner.model.write_tied_head says why; the learner writes it so): a
     version or restore directory without it is refused before any server is touched.
   - full, transport "nccl": vLLM's weight-transfer API (NCCL broadcast from this process),
     for a GPU tier started with a NCCL weight-transfer config. Built against vLLM 0.32's
     documented API; NOT tested here (no GPU on these machines).
3. registers an MLflow model version with its lineage: tags policy_version, kind, base_model,
   learner_step, data_window, parent_version, learner_run_id and episodes_* (the range of episodes
   trained since the parent); run_id = the learner run; source = the directory's file:// URI or,
   with artifact_source, the learner run's artifact copy (a source another host can read). The gate
   adds gate_run_id, the run of the decision. It then points the `challenger` alias at it.

A server that fails keeps its old version; the others are still updated, and PublishError lists
each failure. The requests themselves are flywheel.serving.vllm_client's. Run by hand:
`flywheel publish var/policies/policy-v3`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.base.config import setting
from flywheel.base.versions import EMBED_KEY, FULL_FILES, HEAD_KEY, LORA_FILES, parse_version, version_name
from flywheel.serving import vllm_client
from flywheel.serving.tier import TierConfig

log = logging.getLogger(__name__)



class PublishError(RuntimeError):
    """A version was refused or could not be pushed; the message says why and which servers kept the old one."""


@dataclass(frozen=True)
class PolicyVersion:
    """A validated policy version directory."""

    path: Path
    version: int
    kind: str  # "lora" | "full"
    meta: dict[str, Any]

    @property
    def name(self) -> str:
        return version_name(self.version)

    @property
    def weight_bytes(self) -> int:
        files = LORA_FILES if self.kind == "lora" else FULL_FILES
        return sum((self.path / f).stat().st_size for f in files)


@dataclass
class PublishResult:
    """What a publish did, per server."""

    version: int
    kind: str
    served_name: str  # the model name a client sends to get this version
    pushed: list[str] = field(default_factory=list)  # servers now serving it
    failed: dict[str, str] = field(default_factory=dict)  # server -> reason
    unloaded: dict[str, list[str]] = field(default_factory=dict)  # server -> LoRA names freed
    push_s: dict[str, float] = field(default_factory=dict)  # server -> seconds
    model_version: str | None = None  # MLflow model version number


# ---------------------------------------------------------------------------------------------
# Validation (no server touched)
# ---------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise PublishError(f"{path}: missing") from exc
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PublishError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise PublishError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _tensor_shapes(path: Path, check_finite: bool = True) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a safetensors file. With check_finite every tensor is read, so a truncated file or
    NaN/inf weights are refused here rather than half-loaded by a server."""
    if not path.is_file():
        raise PublishError(f"{path}: missing")
    try:
        # numpy first: ~10x faster than torch here (torch's thread pool fights the vLLM server for the
        # same cores); numpy has no bfloat16, so such files are read through torch
        try:
            shapes = _read_tensors(path, "np", check_finite)
        except TypeError:
            shapes = _read_tensors(path, "pt", check_finite)
    except PublishError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a bad header or short file
        raise PublishError(f"{path}: not a valid safetensors file ({type(exc).__name__}: {exc})") from exc
    if not shapes:
        raise PublishError(f"{path}: holds no tensors")
    return shapes


def _read_tensors(path: Path, framework: str, check_finite: bool) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    with safe_open(str(path), framework=framework) as fh:
        for key in fh.keys():
            if not check_finite:  # shapes only: the header is enough, no tensor is read
                shapes[key] = tuple(fh.get_slice(key).get_shape())
                continue
            tensor = fh.get_tensor(key)
            if framework == "np":
                import numpy as np

                finite = not np.issubdtype(tensor.dtype, np.floating) or bool(np.isfinite(tensor).all())
            else:
                import torch

                finite = not tensor.is_floating_point() or bool(torch.isfinite(tensor).all())
            if not finite:
                raise PublishError(f"{path}: tensor {key} holds NaN or inf")
            shapes[key] = tuple(tensor.shape)
    return shapes


def _check_lora(path: Path, tier: TierConfig) -> None:
    config = _read_json(path / "adapter_config.json")
    rank = config.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise PublishError(f"{path}/adapter_config.json: r={rank!r} is not a positive rank")
    if rank > tier.max_lora_rank:
        raise PublishError(f"{path}: LoRA rank {rank} exceeds the servers' max_lora_rank {tier.max_lora_rank}")
    if not config.get("target_modules"):
        raise PublishError(f"{path}/adapter_config.json: no target_modules")
    shapes = _tensor_shapes(path / "adapter_model.safetensors")
    bad = [k for k, s in shapes.items() if "lora_A" in k and s[0] != rank] + \
          [k for k, s in shapes.items() if "lora_B" in k and s[-1] != rank]
    if bad:
        raise PublishError(f"{path}: tensors {bad[:3]} do not have rank {rank} from adapter_config.json")
    if not any("lora_A" in k for k in shapes):
        raise PublishError(f"{path}/adapter_model.safetensors: no lora_A/lora_B tensors")


def tied_config(config: dict[str, Any]) -> bool:
    """A model config (config.json) that shares one matrix between input embeddings and output head (a
    multimodal config may say so in its text_config; transformers writes the key, Qwen2 and Llama default to False)."""
    text: dict[str, Any] = config["text_config"] if isinstance(config.get("text_config"), dict) else {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def tied_head_problem(path: Path, equal: bool = True) -> str | None:
    """Why vLLM's in-place reload of the model directory `path` would not be exact, or None.

    A tied model must carry lm_head.weight beside the embeddings (learner.model.write_tied_head): the reload
    re-processes only the layers the file feeds, so without it the server's output head keeps the old weights.
    equal: also check the two are bitwise equal (reads both tensors; off: the header only).
    """
    if not tied_config(_read_json(path / "config.json")):
        return None
    shapes = _tensor_shapes(path / "model.safetensors", check_finite=False)
    if HEAD_KEY not in shapes or EMBED_KEY not in shapes:
        return (f"{path}: tied embeddings but model.safetensors lacks "
                f"{HEAD_KEY if EMBED_KEY in shapes else EMBED_KEY}; vLLM's in-place reload would keep the old output "
                f"head. Add it with flywheel.learner.model.write_tied_head({str(path)!r})")
    if equal:
        import torch
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
            if not torch.equal(fh.get_tensor(HEAD_KEY), fh.get_tensor(EMBED_KEY)):
                return f"{path}: tied embeddings but {HEAD_KEY} differs from {EMBED_KEY}"
    return None


def _check_full(path: Path, tier: TierConfig) -> None:
    problem = tied_head_problem(path)
    if problem is not None:
        raise PublishError(problem)
    shapes = _tensor_shapes(path / "model.safetensors")
    base_weights = Path(tier.base_model) / "model.safetensors"
    if base_weights.is_file():
        base_shapes = _tensor_shapes(base_weights, check_finite=False)
        if tied_config(_read_json(path / "config.json")):
            # a tied base saved by transformers has no lm_head.weight; the version must (tied_head_problem)
            base_shapes.setdefault(HEAD_KEY, shapes.get(HEAD_KEY, ()))
        missing = sorted(set(base_shapes) - set(shapes))
        extra = sorted(set(shapes) - set(base_shapes))
        wrong = sorted(k for k in set(shapes) & set(base_shapes) if shapes[k] != base_shapes[k])
        if missing or extra or wrong:
            raise PublishError(f"{path}: weights do not fit the served architecture of {tier.base_model} "
                               f"(missing {missing[:3]}, unexpected {extra[:3]}, wrong shape {wrong[:3]})")


def load_version(version_dir: Path | str, tier: TierConfig | None = None) -> PolicyVersion:
    """Read and validate a policy version directory; raises PublishError naming what is wrong."""
    tier = tier or TierConfig()
    path = Path(version_dir).resolve()
    if not path.is_dir():
        raise PublishError(f"{path}: not a directory")
    meta = _read_json(path / "policy.json")
    version, kind = meta.get("policy_version"), meta.get("kind")
    if not isinstance(version, int) or isinstance(version, bool) or version <= 0:
        raise PublishError(f"{path}/policy.json: policy_version={version!r} must be a positive integer (0 is "
                           "the base model)")
    named = parse_version(path.name)
    if named is not None and named != version:
        raise PublishError(f"{path}: directory name says version {named}, policy.json says {version}")
    if kind not in ("lora", "full"):
        raise PublishError(f"{path}/policy.json: kind={kind!r} is not 'lora' or 'full'")
    (_check_lora if kind == "lora" else _check_full)(path, tier)
    return PolicyVersion(path, version, kind, meta)


def version_dir_of(version: int, tier: TierConfig) -> Path:
    """Where a version's weights live (version 0: the base model)."""
    if version == 0:
        return Path(tier.base_model).resolve()
    return (Path(tier.policies_dir) / version_name(version)).resolve()


# ---------------------------------------------------------------------------------------------
# Pushing to one vLLM server
# ---------------------------------------------------------------------------------------------
def local_source(source: str) -> str:
    """A registered version's source as a path a server on this host can read: file:// URIs become paths, other
    URIs (an MLflow artifact store: mlflow-artifacts:/, s3://, runs:/) are downloaded to a local folder first."""
    if source.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return unquote(urlparse(source).path)
    if "://" in source or source.startswith(("runs:/", "models:/", "mlflow-artifacts:/")):
        import mlflow

        return str(mlflow.artifacts.download_artifacts(artifact_uri=source))
    return source


def lora_name(version: int) -> str:
    return version_name(version)


def keep_set(routed: set[int], resident: list[int], new: int, keep_newest: int) -> set[int]:
    """LoRA versions that stay resident: the routed ones, the new one and the newest `keep_newest`."""
    newest = sorted(set(resident) | {new}, reverse=True)[:keep_newest]
    return set(routed) | {new} | set(newest)


def push_lora(server: str, pv: PolicyVersion, tier: TierConfig, routed: set[int], managed: set[int]) -> list[str]:
    """Load the adapter on one server (idempotent); returns the adapter names unloaded to make room.

    Only versions of this tier's own registry (`managed`) are ever unloaded: a shared server may hold
    adapters that another registry (another team, another test) still routes to.
    """
    names = vllm_client.served_models(server, tier.http_timeout_s)
    resident = [v for v in (parse_version(n) for n in names if n_is_lora(n, tier)) if v is not None and v in managed]
    keep = keep_set(routed, resident, pv.version, tier.keep_loras)
    unloaded: list[str] = []
    for version in sorted(set(resident) - keep):
        name = lora_name(version)
        vllm_client.unload_lora_adapter(server, name, tier.http_timeout_s)
        unloaded.append(name)
    if pv.name not in names:
        vllm_client.load_lora_adapter(server, pv.name, pv.path, tier.http_timeout_s)
    if pv.name not in vllm_client.served_models(server, tier.http_timeout_s):
        raise vllm_client.ServerError(f"{server}: {pv.name} accepted but not listed in /v1/models")
    return unloaded


def n_is_lora(name: str, tier: TierConfig) -> bool:
    """A served name is a LoRA adapter unless it is the base served name (the full weights)."""
    return name != tier.base_served_name


def reload_full(server: str, path: Path | str, version: int, timeout: float = 60.0) -> None:
    """Load full weights from a directory the server can read and record them as policy-v<version>.

    The one sequence every full-weight load goes through (publish, restore, the demo's start, the
    tests' restores): reload_weights, then reset_prefix_cache (else cached prefixes decode on the old
    weights' KV; vllm_client.reset_prefix_cache says why), then update_weight_version (what the router
    and the gate read). It does not pause: a caller with traffic in flight pauses around it
    (push_full_http), an idle caller need not.
    A tied model's directory without lm_head.weight is refused first (tied_head_problem): the server
    keeps what it had.
    """
    if (Path(path) / "config.json").is_file():  # without one the server's own refusal says more
        try:
            problem = tied_head_problem(Path(path), equal=False)  # the header only: a restore need not read weights
        except PublishError as exc:  # callers handle a failed reload as ServerError (push_full_http restores)
            raise vllm_client.ServerError(str(exc)) from exc
        if problem is not None:
            raise vllm_client.ServerError(problem)
    vllm_client.reload_weights(server, path, timeout)
    vllm_client.reset_prefix_cache(server, timeout)
    vllm_client.update_weight_version(server, version, timeout)


def _resume(server: str, tier: TierConfig) -> None:
    """Resume, and make sure: a pause that outlived our request timeout may land after a first resume."""
    for attempt in range(5):
        try:
            vllm_client.resume(server, tier.http_timeout_s)
            paused = vllm_client.is_paused(server, tier.http_timeout_s)
        except vllm_client.ServerError as exc:
            log.error("publish: resume of %s failed (%s), attempt %d", server, exc, attempt + 1)
            paused = True
        if not paused:
            return
        time.sleep(0.5 * (attempt + 1))
    raise vllm_client.ServerError(f"{server}: still paused after 5 resume attempts; POST {server}/resume by hand")


def push_full_http(server: str, pv: PolicyVersion, tier: TierConfig, restore_dir: Path | None = None) -> None:
    """Pause (running requests finish), reload in place, record the version, resume; undo a failed reload.

    `restore_dir` holds the weights the server had before (default: the tier's policy directory of the
    version /weight_info reports, or the base model for version 0).
    """
    before = vllm_client.weight_version(server, tier.http_timeout_s)
    try:
        # mode=wait: in-flight requests complete on the old weights; new ones wait and run on the new.
        # Waiting for in-flight requests is legitimate, so this call gets the long timeout.
        vllm_client.pause(server, tier.pause_timeout_s)
        try:
            reload_full(server, pv.path, pv.version, tier.http_timeout_s)
        except vllm_client.ServerError as exc:
            log.error("publish: reload of %s on %s failed (%s); restoring policy-v%d", pv.name, server, exc, before)
            try:
                reload_full(server, restore_dir or version_dir_of(before, tier), before, tier.http_timeout_s)
            except vllm_client.ServerError as restore_exc:
                raise vllm_client.ServerError(f"{exc}; restoring policy-v{before} ALSO failed: {restore_exc}") from exc
            raise
    finally:
        _resume(server, tier)  # also after a failed or timed-out pause: a paused server serves nobody
    now = vllm_client.weight_version(server, tier.http_timeout_s)
    if now != pv.version:
        raise vllm_client.ServerError(f"{server}: /weight_info reports policy-v{now} after loading {pv.name}")


def push_full_nccl(server: str, pv: PolicyVersion, tier: TierConfig, master_port: int = 29555) -> None:
    """Broadcast full weights over NCCL with vLLM's weight-transfer API (GPU tier only; UNTESTED here).

    The server must be started with a NCCL weight-transfer config and a world size of 1 + its
    tensor-parallel size; this process becomes NCCL rank 0 and needs a CUDA device. Written against
    vllm.distributed.weight_transfer (NCCLTrainerWeightTransferEngine, HTTPVLLMWeightSyncClient)
    of vLLM 0.32; the README marks this path as untested on these CPU-only machines.
    """
    import socket

    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    if not torch.cuda.is_available():
        raise vllm_client.ServerError("transport nccl needs a CUDA device in the publishing process")
    world = vllm_client.world_size(server, tier.http_timeout_s)
    # transformers' stub of .cuda
    model = AutoModelForCausalLM.from_pretrained(str(pv.path), dtype="auto").cuda()  # type: ignore[call-arg]
    client = HTTPVLLMWeightSyncClient(server, timeout=tier.http_timeout_s)
    init = NCCLTrainerInitInfo(master_address=socket.gethostbyname(socket.gethostname()), master_port=master_port,
                               world_size=1 + world, rank=0)
    engine = NCCLTrainerWeightTransferEngine.trainer_init(init, client=client, source=ModuleSource(model))
    try:
        engine.send_weights()
        vllm_client.reset_prefix_cache(server, tier.http_timeout_s)
        vllm_client.update_weight_version(server, pv.version, tier.http_timeout_s)
    finally:
        engine.shutdown()
        client.shutdown_weight_transfer_engine()


# ---------------------------------------------------------------------------------------------
# publish
# ---------------------------------------------------------------------------------------------
def _registry_tags(pv: PolicyVersion) -> dict[str, str]:
    """The model version's tags from policy.json, lineage included: learner_run_id, parent_version and the
    episodes trained since the parent (data_window.since_parent) one tag each as episodes_<key>, so a search
    can filter on them."""
    def text(value: Any) -> str:
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)

    tags = {"kind": pv.kind}
    for key in ("base_model", "learner_step", "data_window", "parent_version", "created_ts", "learner_run_id"):
        if pv.meta.get(key) is not None:
            tags[key] = text(pv.meta[key])
    window = pv.meta.get("data_window")
    since = window.get("since_parent") if isinstance(window, dict) else None
    for key, value in sorted((since if isinstance(since, dict) else {}).items()):
        if value is not None:
            tags[f"episodes_{key}"] = text(value)
    return tags


def version_source(pv: PolicyVersion, registry: Any, artifacts: bool) -> str:
    """The source a version is registered with: its directory as a file:// URI (any host that mounts the same path
    reads it; local_source turns it back into a path), or with `artifacts` a copy logged as artifacts of the
    learner's run (<run artifact URI>/policy-v<N>), readable wherever the tracking store's artifacts are.

    artifacts is off by default: the copy costs the weights' size (14 MB of full weights in the demo) on the
    artifact store and its time on every publish. Without a learner run (tracking was off) there is nothing to
    log to: file://. Already registered: nothing is copied again (register returns the existing version).
    """
    run_id = pv.meta.get("learner_run_id")
    if not (artifacts and run_id) or registry.find(pv.version) is not None:
        return pv.path.as_uri()
    start = time.perf_counter()
    registry.client.log_artifacts(run_id, str(pv.path), pv.name)
    uri = f"{registry.client.get_run(run_id).info.artifact_uri.rstrip('/')}/{pv.name}"
    log.info("publish: %s logged to the artifacts of learner run %s in %.2f s (%s)", pv.name, run_id,
             time.perf_counter() - start, uri)
    return uri


def served_name(version: int, kind: str, tier: TierConfig) -> str:
    """The model name clients send for a version: its adapter name, or the base name for full weights."""
    return tier.base_served_name if kind == "full" or version == 0 else lora_name(version)


@dataclass
class RegistryView:
    """What publish read from the registry before pushing: which versions it may unload, and from where."""

    registry: Any | None  # None: publishing without registering
    routed: set[int] = field(default_factory=set)  # champion and challenger: never unloaded
    champion: int = 0  # the champion alias (0: none yet, the base serves)
    managed: set[int] = field(default_factory=set)  # versions of this registry: the only ones ever unloaded
    error: Exception | None = None  # the registry was unreadable: nothing unloaded, nothing registered


def read_registry(pv: PolicyVersion, tier: TierConfig, registry: Any | None, register: bool) -> RegistryView:
    """The routed and managed versions; an unreadable registry is logged and returned as the view's error."""
    from flywheel.serving.registry import CHALLENGER, CHAMPION, Registry

    view = RegistryView(registry)
    try:
        if view.registry is None and register:
            view.registry = Registry(tier.mlflow_tracking_uri, tier.registered_model)
        if view.registry is not None:
            aliases = view.registry.aliases()
            view.champion = aliases.get(CHAMPION, 0)
            # a registered control version is routed too (its arm serves it all run): never unloaded
            view.routed = tier.live_versions(view.champion, aliases.get(CHALLENGER)) - {0} | {
                v for a, v in aliases.items() if a in (CHAMPION, CHALLENGER)}
            view.managed = {v.policy_version for v in view.registry.versions()}
    except Exception as exc:  # MLflow down: still push (unloading nothing, since routing is unknown), report below
        view.error = exc
        log.warning("publish: registry %s unreadable (%s); pushing %s without unloading any adapter",
                    tier.registered_model, exc, pv.name)
    return view


def push_to(server: str, pv: PolicyVersion, tier: TierConfig, view: RegistryView, result: PublishResult) -> None:
    """Push to one server and record the outcome in `result`; a failed server keeps its old version."""
    start = time.perf_counter()
    try:
        if pv.kind == "lora":
            result.unloaded[server] = push_lora(server, pv, tier, view.routed, view.managed)
        elif tier.transport == "nccl":
            push_full_nccl(server, pv, tier)
        else:
            push_full_http(server, pv, tier)
    except (vllm_client.ServerError, OSError) as exc:
        result.failed[server] = str(exc)
        log.error("publish: %s NOT pushed to %s, which keeps its old version: %s", pv.name, server, exc)
        return
    result.push_s[server] = time.perf_counter() - start
    result.pushed.append(server)
    log.info("publish: %s (%s, %.1f MB) live on %s in %.3f s", pv.name, pv.kind, pv.weight_bytes / 1e6, server,
             result.push_s[server])


def register_version(pv: PolicyVersion, tier: TierConfig, view: RegistryView, result: PublishResult,
                     challenger: bool, artifact_source: bool = False) -> None:
    """Record the pushed version in MLflow, linked to the learner run that produced it (run_id, when policy.json
    names one) with a source another host can read (version_source); the challenger alias moves only when every
    server took it."""
    from flywheel.serving.registry import CHALLENGER

    try:
        if view.error is not None or view.registry is None:
            raise view.error or RuntimeError("no registry")
        reg = view.registry
        registered = reg.register(pv.version, version_source(pv, reg, artifact_source), _registry_tags(pv),
                                  description=f"{pv.kind} policy version {pv.version} from {pv.path}",
                                  run_id=pv.meta.get("learner_run_id") or None)
        result.model_version = registered.model_version
        if challenger and not result.failed:
            reg.set_alias(CHALLENGER, pv.version)
            log.info("publish: %s is the challenger of %s", pv.name, reg.name)
    except Exception as exc:  # MLflow down: the servers have it, the registry does not; a rerun finishes the job
        raise PublishError(f"{pv.name} is live on {result.pushed} but NOT registered in {tier.registered_model} "
                           f"({type(exc).__name__}: {exc}); rerun `flywheel publish {pv.path}`") from exc


def full_targets(held: dict[str, int | None], live: set[int], new: int) -> list[str]:
    """The servers a new full-weight version goes to: every server but one holder of each live version.

    held: server -> the version it holds (None: unreachable, never a target). A server already on
    `new` is a target (a rerun after a partial publish finishes the job). The holder kept for a live
    version is its first in tier order, so repeated publishes keep the same server for it.
    """
    keep: set[str] = set()
    for version in sorted(live - {new}):
        holders = [s for s, v in held.items() if v == version]
        if holders:
            keep.add(holders[0])
    return [s for s, v in held.items() if v is not None and s not in keep]


def held_versions(tier: TierConfig) -> dict[str, int | None]:
    """server -> the full-weight version it holds (None: unreachable, logged), in tier order."""
    held: dict[str, int | None] = {}
    for server in tier.servers:
        server = server.rstrip("/")
        try:
            held[server] = vllm_client.weight_version(server, tier.http_timeout_s)
        except vllm_client.ServerError as exc:
            log.warning("serving: %s unreachable (%s); left out", server, exc)
            held[server] = None
    return held


def _full_servers(pv: PolicyVersion, tier: TierConfig, view: RegistryView, result: PublishResult) -> list[str]:
    """Where a full version goes (see full_targets). An unreachable server is no target and not a failure of this
    publish: the router routes around it, and counting it would keep the challenger alias from moving although
    every target took the version."""
    if view.error is not None:
        raise PublishError(f"{pv.name}: registry unreadable ({view.error}), so which server holds the champion is "
                           "unknown; a full-weight publish would risk replacing it. Nothing pushed")
    held = held_versions(tier)
    live = tier.live_versions(view.champion, None)
    targets = full_targets(held, live, pv.version)
    if not targets and tier.replace_live:
        targets = [s for s, v in held.items() if v is not None]
    if not targets:
        raise PublishError(f"{pv.name}: no server is free: the servers hold {held} and the live versions "
                           f"{sorted(live)} keep one each; a full-weight tier needs a server per live version "
                           "(champion, challenger, control); add a server, or set replace_live for a one-server tier")
    return targets


def publish(version_dir: Path | str, tier: TierConfig | None = None, *, register: bool = True,
            challenger: bool = True, registry: Any | None = None, artifact_source: bool = False) -> PublishResult:
    """Make the tier serve `version_dir` (every server for LoRA, the free ones for full weights), register it in
    MLflow and mark it challenger.

    Raises PublishError when the directory is refused (nothing changed) or when any server failed
    (those servers keep their old version; the message lists them). Safe to call again.
    """
    tier = tier or TierConfig()
    tier.check()  # a tier built in code skips load_config's check; a bad slot policy would evict routed adapters
    pv = load_version(version_dir, tier)
    view = read_registry(pv, tier, registry, register)
    result = PublishResult(pv.version, pv.kind, served_name(pv.version, pv.kind, tier))
    servers = [s.rstrip("/") for s in tier.servers] if pv.kind == "lora" else _full_servers(pv, tier, view, result)
    for server in servers:
        push_to(server, pv, tier, view, result)
    if register and result.pushed:
        register_version(pv, tier, view, result, challenger, artifact_source)
    if result.failed:
        failures = "; ".join(f"{s}: {why}" for s, why in result.failed.items())
        raise PublishError(f"{pv.name} failed on {len(result.failed)} of {len(set(servers) | set(result.failed))} "
                           f"server(s), which keep their old version: {failures}")
    return result


@dataclass
class PublishConfig(TierConfig):
    """Push one policy version directory to the vLLM tier and register it in MLflow."""

    version_dir: str = setting("", "the policy-v<N> directory to publish (also accepted as the first argument)")
    register: bool = setting(True, "record an MLflow model version and point the challenger alias at it")
    artifact_source: bool = setting(False, "log the directory as artifacts of the learner run policy.json names and "
                                           "register that copy as the source (readable from other hosts; costs a "
                                           "copy of the weights per publish); off: the directory's file:// URI")

    def check(self) -> None:
        super().check()
        from flywheel.base.config import ConfigError

        if not self.version_dir:
            raise ConfigError("version_dir: the policy version directory to publish is required")


def main(argv: list[str] | None = None) -> int:
    import sys

    from flywheel.base.config import load_config, setup_logging

    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-"):
        args = ["--version-dir", args[0], *args[1:]]  # `flywheel publish DIR` reads naturally
    cfg = load_config(PublishConfig, args, "flywheel publish")
    setup_logging()
    tier = TierConfig(**{k: getattr(cfg, k) for k in TierConfig.__dataclass_fields__})
    try:
        result = publish(cfg.version_dir, tier, register=cfg.register, artifact_source=cfg.artifact_source)
    except PublishError as exc:
        log.error("publish: %s", exc)
        return 1
    print(json.dumps({"version": result.version, "kind": result.kind, "served_name": result.served_name,
                      "servers": result.pushed, "push_s": result.push_s, "model_version": result.model_version}))
    return 0
