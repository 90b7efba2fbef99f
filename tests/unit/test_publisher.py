"""Publisher validation, LoRA slot bookkeeping and the push sequence against a fake vLLM: refused directories
never reach a server, a failed server keeps its old version, a failed reload is undone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.fixtures import models as synthetic
from flywheel.serving import publisher, vllm_client
from flywheel.serving.publisher import (
    PolicyVersion,
    PublishError,
    keep_set,
    load_version,
)
from flywheel.serving.registry import RegisteredVersion
from flywheel.serving.tier import TierConfig
from flywheel.serving.vllm_client import ServerError

BASE = Path(__file__).resolve().parents[2] / "var" / "models" / "tiny-base"


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (BASE / "model.safetensors").is_file():
        pytest.skip(f"no tiny base model at {BASE}; run `flywheel model init`")
    return synthetic.make_lora_version(BASE, tmp_path_factory.mktemp("v") / "policy-v3", 3, rank=4)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_policy(d: Path, **changes: object) -> None:
    meta = json.loads((d / "policy.json").read_text())
    (d / "policy.json").write_text(json.dumps({**meta, **changes}))


def test_valid_lora_directory_loads(lora_dir: Path) -> None:
    pv = load_version(lora_dir, TierConfig(base_model=str(BASE)))
    assert (pv.version, pv.kind, pv.name) == (3, "lora", "policy-v3")


@pytest.mark.parametrize("changes, message", [
    ({"kind": "delta"}, "kind"),
    ({"policy_version": 0}, "positive integer"),
    ({"policy_version": "3"}, "positive integer"),
    ({"policy_version": 4}, "directory name says version 3"),
])
def test_bad_policy_json_is_refused(lora_dir: Path, tmp_path: Path, changes: dict, message: str) -> None:
    d = _copy(lora_dir, tmp_path / "policy-v3")
    _edit_policy(d, **changes)
    with pytest.raises(PublishError, match=message):
        load_version(d, TierConfig(base_model=str(BASE)))


def test_rank_above_server_limit_and_missing_files_are_refused(lora_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(PublishError, match="exceeds the servers' max_lora_rank"):
        load_version(lora_dir, TierConfig(base_model=str(BASE), max_lora_rank=2))
    d = _copy(lora_dir, tmp_path / "policy-v3")
    (d / "adapter_model.safetensors").unlink()
    with pytest.raises(PublishError, match="missing"):
        load_version(d, TierConfig(base_model=str(BASE)))
    with pytest.raises(PublishError, match="not a directory"):
        load_version(tmp_path / "nope", TierConfig(base_model=str(BASE)))


def test_nan_weights_are_refused(lora_dir: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    d = _copy(lora_dir, tmp_path / "policy-v3")
    tensors = load_file(str(d / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    save_file(tensors, str(d / "adapter_model.safetensors"))
    with pytest.raises(PublishError, match="NaN or inf"):
        load_version(d, TierConfig(base_model=str(BASE)))


def test_keep_set_keeps_routed_new_and_newest() -> None:
    assert keep_set({1, 2}, [1, 2, 5, 6, 7], 8, keep_newest=2) == {1, 2, 7, 8}
    assert keep_set(set(), [], 1, keep_newest=2) == {1}


def test_served_name_of_full_weights_is_the_base_name() -> None:
    tier = TierConfig()
    assert publisher.served_name(4, "full", tier) == "policy-v0"
    assert publisher.served_name(4, "lora", tier) == "policy-v4"


# ---------------------------------------------------------------------------------------------
# The push sequence, against an in-memory vLLM (vllm_client.http replaced; no network)
# ---------------------------------------------------------------------------------------------
class FakeVllm:
    """Servers by base URL: their served names, full-weight version and paused flag; `calls` records every request."""

    def __init__(self, servers: dict[str, list[str]], down: tuple[str, ...] = (), bad_weights: str = "") -> None:
        self.models = {s: list(names) for s, names in servers.items()}
        self.version = {s: 0 for s in servers}
        self.paused = {s: False for s in servers}
        self.down, self.bad_weights = down, bad_weights
        self.calls: list[str] = []

    def http(self, method: str, url: str, body: dict | None = None, timeout: float = 60.0) -> object:
        scheme, _, host, path = url.split("/", 3)  # "http://a/v1/models" -> "http://a", "v1/models"
        server = f"{scheme}//{host}"
        self.calls.append(f"{method} {path}")
        if server in self.down:
            raise ServerError(f"{method} {url} -> connection refused")
        body = body or {}
        if path == "v1/models":
            return {"data": [{"id": name} for name in self.models[server]]}
        if path == "v1/load_lora_adapter":
            self.models[server].append(body["lora_name"])
        elif path == "v1/unload_lora_adapter":
            self.models[server].remove(body["lora_name"])
        elif path == "weight_info":
            return {"weight_version": f"policy-v{self.version[server]}"}
        elif path.startswith("pause"):
            self.paused[server] = True
        elif path == "resume":
            self.paused[server] = False
        elif path == "is_paused":
            return {"is_paused": self.paused[server]}
        elif path == "collective_rpc":
            if body["kwargs"]["weights_path"] == self.bad_weights:
                raise ServerError(f"POST {url} -> HTTP 500: shape mismatch")
        elif path == "update_weight_version":
            self.version[server] = int(body["new_version"].removeprefix("policy-v"))
        return None


class FakeRegistry:
    name = "flywheel-test"

    def __init__(self, aliases: dict[str, int], managed: set[int], broken: bool = False) -> None:
        self._aliases, self.managed, self.broken = dict(aliases), managed, broken
        self.registered: list[int] = []
        self.calls: list[dict] = []  # every register call's source, tags and run_id

    def aliases(self) -> dict[str, int]:
        if self.broken:
            raise ConnectionError("mlflow down")
        return dict(self._aliases)

    def versions(self) -> list[RegisteredVersion]:
        return [RegisteredVersion(v, str(v), "lora", "", {}) for v in sorted(self.managed)]

    def register(self, policy_version: int, source: str, tags: dict[str, str], description: str = "",
                 run_id: str | None = None) -> RegisteredVersion:
        self.registered.append(policy_version)
        self.calls.append({"source": source, "tags": tags, "run_id": run_id})
        return RegisteredVersion(policy_version, "7", tags["kind"], source, tags)

    def set_alias(self, alias: str, policy_version: int) -> None:
        self._aliases[alias] = policy_version


def _lora_tier(*servers: str) -> TierConfig:
    return TierConfig(servers=list(servers), base_model=str(BASE), keep_loras=1, max_loras=4)


def test_publish_lora_unloads_only_unrouted_managed_adapters(lora_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeVllm({"http://a": ["policy-v0", "policy-v1", "policy-v2", "policy-v4", "policy-v5", "policy-v9"]})
    monkeypatch.setattr(vllm_client, "http", fake.http)
    reg = FakeRegistry({"champion": 1, "challenger": 2}, managed={1, 2, 4, 5})
    result = publisher.publish(lora_dir, _lora_tier("http://a/"), registry=reg)
    assert result.pushed == ["http://a"], f"pushed to {result.pushed}, failed {result.failed}"
    # kept: routed 1 and 2, the new 3, the newest 5; policy-v9 belongs to another registry
    assert result.unloaded == {"http://a": ["policy-v4"]}
    assert sorted(fake.models["http://a"]) == ["policy-v0", "policy-v1", "policy-v2", "policy-v3", "policy-v5",
                                               "policy-v9"]
    assert (result.model_version, reg.registered, reg.aliases()["challenger"]) == ("7", [3], 3)


LINEAGE = {"learner_run_id": "0123abcd", "parent_version": 2, "learner_step": 40,
           "data_window": {"cursor": {"episodes/0": 9}, "episodes_trained": 320,
                           "since_parent": {"count": 32, "steps": 4, "first_step": 37, "last_step": 40,
                                            "first_call_ts": "2026-01-01T00:00:01.000000Z",
                                            "last_call_ts": "2026-01-01T00:05:00.000000Z",
                                            "min_policy_version": 1, "max_policy_version": 2}}}


def test_registry_tags_carry_the_lineage_of_a_version(tmp_path: Path) -> None:
    tags = publisher._registry_tags(PolicyVersion(tmp_path, 3, "lora", {**LINEAGE, "created_ts": "t"}))
    assert (tags["learner_run_id"], tags["parent_version"], tags["learner_step"]) == ("0123abcd", "2", "40"), tags
    assert json.loads(tags["data_window"]) == LINEAGE["data_window"], "the whole window stays one JSON tag"
    assert (tags["episodes_count"], tags["episodes_first_step"], tags["episodes_last_step"]) == ("32", "37", "40"), tags
    assert (tags["episodes_first_call_ts"], tags["episodes_last_call_ts"]) == ("2026-01-01T00:00:01.000000Z",
                                                                               "2026-01-01T00:05:00.000000Z"), tags
    assert (tags["episodes_min_policy_version"], tags["episodes_max_policy_version"]) == ("1", "2"), tags
    bare = publisher._registry_tags(PolicyVersion(tmp_path, 3, "lora", {"data_window": {"synthetic": True},
                                                                         "learner_run_id": None}))
    assert bare == {"kind": "lora", "data_window": '{"synthetic": true}'}, "no lineage recorded: no lineage tags"


def test_publish_links_the_learner_run_and_registers_a_file_uri(lora_dir: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    d = _copy(lora_dir, tmp_path / "policy-v3")
    _edit_policy(d, **LINEAGE)
    monkeypatch.setattr(vllm_client, "http", FakeVllm({"http://a": ["policy-v0"]}).http)
    reg = FakeRegistry({}, managed=set())
    publisher.publish(d, _lora_tier("http://a"), registry=reg)
    [call] = reg.calls
    assert call["run_id"] == "0123abcd" and call["tags"]["parent_version"] == "2", call
    assert call["source"] == d.resolve().as_uri() and call["source"].startswith("file:///"), call["source"]
    assert publisher.local_source(call["source"]) == str(d.resolve()), "the gate and the learner read it back as a path"
    publisher.publish(lora_dir, _lora_tier("http://a"), registry=reg, artifact_source=True)
    assert reg.calls[-1]["run_id"] is None and reg.calls[-1]["source"] == lora_dir.resolve().as_uri(), \
        "no learner run (tracking was off): no link, and nothing to log artifacts to"


def test_artifact_source_is_a_copy_under_the_learner_run(lora_dir: Path, tmp_path: Path) -> None:
    from flywheel.base import tracking
    from flywheel.serving.registry import Registry

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    registry = Registry(uri, "lineage")
    run_id = registry.client.create_run(tracking.experiment_id("learner", uri)).info.run_id
    pv = PolicyVersion(lora_dir, 3, "lora", {"learner_run_id": run_id})
    source = publisher.version_source(pv, registry, artifacts=True)
    assert source.startswith("file:///") and source.endswith(f"/{run_id}/artifacts/policy-v3"), source
    copied = Path(publisher.local_source(source))
    assert sorted(f.name for f in copied.iterdir()) == sorted(f.name for f in lora_dir.iterdir()), copied
    assert publisher.version_source(pv, registry, artifacts=False) == lora_dir.as_uri()
    registry.register(3, source, {"kind": "lora"}, run_id=run_id)
    assert registry.client.get_model_version("lineage", "1").run_id == run_id
    assert publisher.version_source(pv, registry, artifacts=True) == lora_dir.as_uri(), \
        "registered already: register keeps the first source, so nothing is copied again"


def test_publish_failed_server_keeps_old_version_and_challenger_stays(lora_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeVllm({"http://a": ["policy-v0"], "http://b": ["policy-v0"]}, down=("http://b",))
    monkeypatch.setattr(vllm_client, "http", fake.http)
    reg = FakeRegistry({"champion": 1}, managed={1})
    with pytest.raises(PublishError, match="failed on 1 of 2 server.*http://b"):
        publisher.publish(lora_dir, _lora_tier("http://a", "http://b"), registry=reg)
    assert "policy-v3" in fake.models["http://a"], "the healthy server should still have been updated"
    assert reg.registered == [3], "a version live somewhere is registered"
    assert "challenger" not in reg.aliases(), "a partly pushed version must not become challenger"


def test_publish_with_unreadable_registry_pushes_without_unloading(lora_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeVllm({"http://a": ["policy-v0", "policy-v1", "policy-v2"]})
    monkeypatch.setattr(vllm_client, "http", fake.http)
    view = publisher.read_registry(load_version(lora_dir, _lora_tier("http://a")), _lora_tier("http://a"),
                                   FakeRegistry({}, set(), broken=True), register=True)
    assert (view.routed, view.managed, type(view.error)) == (set(), set(), ConnectionError)
    with pytest.raises(PublishError, match="NOT registered"):
        publisher.publish(lora_dir, _lora_tier("http://a"), registry=FakeRegistry({}, {1, 2}, broken=True))
    assert sorted(fake.models["http://a"]) == ["policy-v0", "policy-v1", "policy-v2", "policy-v3"]


def test_failed_full_reload_restores_the_old_weights_and_resumes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeVllm({"http://a": ["policy-v0"]}, bad_weights=str(tmp_path / "policy-v3"))
    fake.version["http://a"] = 2
    monkeypatch.setattr(vllm_client, "http", fake.http)
    pv = PolicyVersion(tmp_path / "policy-v3", 3, "full", {})
    with pytest.raises(ServerError, match="shape mismatch"):
        publisher.push_full_http("http://a", pv, TierConfig(policies_dir=str(tmp_path)), restore_dir=tmp_path / "v2")
    assert fake.calls == ["GET weight_info", "POST pause?mode=wait", "POST collective_rpc", "POST collective_rpc",
                          "POST reset_prefix_cache", "POST update_weight_version", "POST resume", "GET is_paused"]
    assert (fake.version["http://a"], fake.paused["http://a"]) == (2, False), "the old version, serving again"


def test_weight_version_and_prefix_cache_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"weight_info": {"weight_version": "policy-v7"}, "reset_prefix_cache": {"success": False}}
    monkeypatch.setattr(vllm_client, "http", lambda method, url, body=None, timeout=60.0: answers[url.rsplit("/", 1)[1]])
    assert vllm_client.weight_version("http://a") == 7
    answers["weight_info"] = {"weight_version": None}
    assert vllm_client.weight_version("http://a") == 0, "a server still on its start-up weights holds version 0"
    with pytest.raises(ServerError, match="refused"):
        vllm_client.reset_prefix_cache("http://a")


def test_full_targets_keep_one_server_per_live_version() -> None:
    held = {"http://a": 0, "http://b": 0, "http://c": 0}
    # at the start every server holds the base, which is champion and control: one keeps it
    assert publisher.full_targets(held, {0}, 1) == ["http://b", "http://c"]
    # champion v1 on b and c, control v0 on a, a new challenger v2: one of the champion's servers frees up
    assert publisher.full_targets({"http://a": 0, "http://b": 1, "http://c": 1}, {0, 1}, 2) == ["http://c"]
    # the old challenger's server is free; an unreachable server is never a target
    assert publisher.full_targets({"http://a": 0, "http://b": 1, "http://c": 2, "http://d": None}, {0, 1}, 3) == ["http://c"]
    assert publisher.full_targets({"http://a": 0, "http://b": 1}, {0, 1}, 2) == []


def test_full_publish_never_replaces_the_champion_or_the_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeVllm({"http://a": ["policy-v0"], "http://b": ["policy-v0"], "http://c": ["policy-v0"]})
    fake.version.update({"http://a": 0, "http://b": 1, "http://c": 2})
    monkeypatch.setattr(vllm_client, "http", fake.http)
    monkeypatch.setattr(publisher, "load_version", lambda d, tier=None: PolicyVersion(Path(d), 3, "full", {}))
    (tmp_path / "policy-v3").mkdir()
    for name in publisher.FULL_FILES:  # only their sizes are read (the log line); validation is stubbed above
        (tmp_path / "policy-v3" / name).write_text("{}")
    tier = TierConfig(servers=["http://a", "http://b", "http://c"], control_share=0.2, policies_dir=str(tmp_path))
    reg = FakeRegistry({"champion": 1, "challenger": 2}, managed={1, 2})
    result = publisher.publish(tmp_path / "policy-v3", tier, registry=reg)
    assert result.pushed == ["http://c"] and fake.version == {"http://a": 0, "http://b": 1, "http://c": 3}
    assert reg.aliases()["challenger"] == 3
    # two servers, champion v1 and control v0: nowhere to put a challenger
    two = TierConfig(servers=["http://a", "http://b"], control_share=0.2, policies_dir=str(tmp_path))
    with pytest.raises(PublishError, match="no server is free"):
        publisher.publish(tmp_path / "policy-v3", two, registry=FakeRegistry({"champion": 1}, managed={1}))
    assert fake.version["http://b"] == 1, "the champion's weights were replaced"
    # a one-server tier may opt into replacing, as before
    one = TierConfig(servers=["http://b"], replace_live=True, policies_dir=str(tmp_path))
    assert publisher.publish(tmp_path / "policy-v3", one, registry=FakeRegistry({"champion": 1}, managed={1})).pushed == ["http://b"]
    # an unreadable registry: which server holds the champion is unknown, so nothing is pushed
    fake.version["http://c"] = 2
    with pytest.raises(PublishError, match="registry unreadable"):
        publisher.publish(tmp_path / "policy-v3", tier, registry=FakeRegistry({}, set(), broken=True))
    assert fake.version["http://c"] == 2
