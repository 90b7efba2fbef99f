"""Publishing policy versions into the real vLLM server and MLflow registry.

Each test uses its own registered model and policy version numbers far above anything a learner
produces (7_000_000+), so it never touches another engineer's adapters. Full-weight tests hold
`vllm_weights_lock` and put the base weights back before releasing it.
"""

from __future__ import annotations

import json
import random
import threading
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from bench.fixtures import models as synthetic
from flywheel.base import tracking
from flywheel.serving import publisher, vllm_client
from flywheel.serving.publisher import PublishError
from flywheel.serving.registry import Registry
from flywheel.serving.router import Router, logged_version
from flywheel.serving.tier import TierConfig
from flywheel.serving.vllm_client import http

PROMPT = [5, 17, 33, 60, 61, 62, 100, 7]
TOLERANCE = 1e-4


def _version() -> int:
    return random.randint(7_000_000, 7_999_999)


@pytest.fixture
def tier(vllm_url: str, mlflow_uri: str, base_model_dir: Path, tmp_path: Path) -> Iterator[TierConfig]:
    # replace_live: these tests check the push mechanics on the one shared server, so a full version
    # replaces the base there; that a live version keeps its server is tested with two servers
    # (test_promote.py, tests/unit/test_publisher.py)
    cfg = TierConfig(servers=[vllm_url], mlflow_tracking_uri=mlflow_uri, base_model=str(base_model_dir),
                     policies_dir=str(tmp_path), registered_model=f"test-publish-{uuid.uuid4().hex[:10]}",
                     replace_live=True)
    yield cfg
    registry = Registry(cfg.mlflow_tracking_uri, cfg.registered_model)
    resident = set(vllm_client.served_models(vllm_url))
    for rv in registry.versions():  # free this test's adapter slots on the shared server
        if rv.kind == "lora" and f"policy-v{rv.policy_version}" in resident:
            http("POST", f"{vllm_url}/v1/unload_lora_adapter", {"lora_name": f"policy-v{rv.policy_version}"})


def _complete(url: str, model: str, max_tokens: int = 8, prompt: list[int] = PROMPT) -> tuple[list[int], list[float]]:
    # ignore_eos: every request produces exactly max_tokens, so a cut-short request is visible
    out = http("POST", f"{url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "logprobs": 1, "return_token_ids": True,
                                                  "ignore_eos": True})
    choice = out["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _max_gap(url: str, model: str, base: Path, version_dir: Path | None, prompt: list[int] = PROMPT) -> float:
    ids, served = _complete(url, model, prompt=prompt)
    ref = synthetic.reference_logprobs(synthetic.load_reference(base, version_dir), prompt, ids)
    return max(abs(a - b) for a, b in zip(served, ref))


def test_lora_version_serves_its_weights_and_is_registered_as_challenger(tier: TierConfig, vllm_url: str,
                                                                          base_model_dir: Path, tmp_path: Path) -> None:
    v = _version()
    vdir = synthetic.make_lora_version(base_model_dir, tmp_path / f"policy-v{v}", v, seed=11)
    registry = Registry(tier.mlflow_tracking_uri, tier.registered_model)
    learner_run = registry.client.create_run(tracking.experiment_id("test-publish", tier.mlflow_tracking_uri)).info.run_id
    meta = json.loads((vdir / "policy.json").read_text())
    since = {"count": 24, "steps": 3, "first_step": 4, "last_step": 6, "min_policy_version": 0, "max_policy_version": 0,
             "first_call_ts": "2026-01-01T00:00:01.000000Z", "last_call_ts": "2026-01-01T00:02:00.000000Z"}
    meta.update(learner_run_id=learner_run, data_window={**meta["data_window"], "since_parent": since})
    (vdir / "policy.json").write_text(json.dumps(meta))
    result = publisher.publish(vdir, tier)
    assert result.pushed == [vllm_url] and result.served_name == f"policy-v{v}"
    gap = _max_gap(vllm_url, result.served_name, base_model_dir, vdir)
    assert gap < TOLERANCE, f"vLLM logprobs differ from peft fp32 by {gap:.2e} (limit {TOLERANCE})"
    base_gap = _max_gap(vllm_url, result.served_name, base_model_dir, None)
    assert base_gap > 1e-2, f"adapter changes nothing ({base_gap:.2e}); the comparison would prove nothing"
    assert registry.aliases() == {"challenger": v}
    found = registry.find(v)
    tags = found.tags
    assert tags["kind"] == "lora" and tags["policy_version"] == str(v) and "data_window" in tags, tags
    assert (tags["parent_version"], tags["learner_run_id"]) == ("0", learner_run), tags
    assert (tags["episodes_count"], tags["episodes_first_step"], tags["episodes_last_step"]) == ("24", "4", "6"), tags
    assert tags["episodes_last_call_ts"] == since["last_call_ts"], tags
    mv = registry.client.get_model_version(tier.registered_model, found.model_version)
    assert mv.run_id == learner_run, f"model version linked to run {mv.run_id!r}, not the learner's {learner_run}"
    assert found.source == vdir.resolve().as_uri(), f"source {found.source!r} is not the directory's file:// URI"
    assert publisher.local_source(found.source) == str(vdir.resolve())
    assert publisher.publish(vdir, tier).pushed == [vllm_url], "publishing again is idempotent"


def test_corrupt_adapter_is_refused_and_previous_version_keeps_serving(tier: TierConfig, vllm_url: str,
                                                                        base_model_dir: Path, tmp_path: Path) -> None:
    good = _version()
    good_dir = synthetic.make_lora_version(base_model_dir, tmp_path / f"policy-v{good}", good, seed=12)
    publisher.publish(good_dir, tier)
    before = _complete(vllm_url, f"policy-v{good}")
    bad = good + 1
    bad_dir = synthetic.make_lora_version(base_model_dir, tmp_path / f"policy-v{bad}", bad, seed=13)
    weights = bad_dir / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a half-written file
    with pytest.raises(PublishError, match="not a valid safetensors"):
        publisher.publish(bad_dir, tier)
    assert f"policy-v{bad}" not in vllm_client.served_models(vllm_url)
    assert Registry(tier.mlflow_tracking_uri, tier.registered_model).aliases() == {"challenger": good}
    assert _complete(vllm_url, f"policy-v{good}") == before, "the previous version changed after a refused publish"
    (bad_dir / "adapter_config.json").write_text("{not json")
    with pytest.raises(PublishError, match="adapter_config.json"):
        publisher.publish(bad_dir, tier)


def test_unreachable_server_is_reported_and_the_others_still_get_the_version(tier: TierConfig, vllm_url: str,
                                                                             base_model_dir: Path, tmp_path: Path) -> None:
    v = _version()
    vdir = synthetic.make_lora_version(base_model_dir, tmp_path / f"policy-v{v}", v, seed=14)
    two = tier.with_changes(servers=[vllm_url, "http://127.0.0.1:9"])
    with pytest.raises(PublishError, match="127.0.0.1:9") as info:
        publisher.publish(vdir, two)
    assert "1 of 2 server(s)" in str(info.value)
    assert f"policy-v{v}" in vllm_client.served_models(vllm_url)
    assert "challenger" not in Registry(tier.mlflow_tracking_uri, tier.registered_model).aliases(), \
        "a version that is not on every server must not become the challenger"


def test_full_weight_version_serves_its_weights_and_base_is_restored(tier: TierConfig, vllm_url: str,
                                                                     base_model_dir: Path, tmp_path: Path,
                                                                     vllm_weights_lock: None) -> None:
    v = _version()
    vdir = synthetic.make_full_version(base_model_dir, tmp_path / f"policy-v{v}", v, seed=21)
    try:
        result = publisher.publish(vdir, tier)
        assert result.served_name == tier.base_served_name
        assert vllm_client.weight_version(vllm_url) == v
        gap = _max_gap(vllm_url, result.served_name, base_model_dir, vdir)
        assert gap < TOLERANCE, f"vLLM logprobs differ from the published full weights by {gap:.2e}"
        route = Router(tier).route("any-session")
        assert (route.model, route.policy_version) == (tier.base_served_name, v), route
    finally:
        publisher.reload_full(vllm_url, base_model_dir.resolve(), 0, tier.http_timeout_s)
    assert _max_gap(vllm_url, tier.base_served_name, base_model_dir, None) < TOLERANCE


def test_full_weight_version_does_not_decode_on_the_old_weights_cached_prefix(tier: TierConfig, vllm_url: str,
                                                                              base_model_dir: Path, tmp_path: Path,
                                                                              vllm_weights_lock: None) -> None:
    # a prompt of many KV blocks, as an agent's system prompt and earlier turns are: vLLM caches its
    # prefix under the base weights, and keeps it across reload_weights unless the publisher resets it
    long_prompt = [(7 * i) % 400 + 5 for i in range(300)]
    _complete(vllm_url, tier.base_served_name, prompt=long_prompt)
    v = _version()
    vdir = synthetic.make_full_version(base_model_dir, tmp_path / f"policy-v{v}", v, seed=22)
    try:
        publisher.publish(vdir, tier)
        gap = _max_gap(vllm_url, tier.base_served_name, base_model_dir, vdir, prompt=long_prompt)
        assert gap < TOLERANCE, f"after a full publish a cached prompt decodes {gap:.2e} away from the new weights"
    finally:
        publisher.reload_full(vllm_url, base_model_dir.resolve(), 0, tier.http_timeout_s)
    gap = _max_gap(vllm_url, tier.base_served_name, base_model_dir, None, prompt=long_prompt)
    assert gap < TOLERANCE, f"after restoring the base a cached prompt decodes {gap:.2e} away from the base weights"


def test_tied_or_misshapen_full_weights_are_refused(tier: TierConfig, base_model_dir: Path, tmp_path: Path) -> None:
    import json

    v = _version()
    vdir = synthetic.make_full_version(base_model_dir, tmp_path / f"policy-v{v}", v, seed=22)
    config = json.loads((vdir / "config.json").read_text())
    # untied weights under a tied config: the head differs from the embeddings, so no reload could be exact
    (vdir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(PublishError, match="lm_head.weight differs"):
        publisher.load_version(vdir, tier)


def _stream_requests(url: str, model: str, stop: threading.Event, results: list, errors: list) -> None:
    while not stop.is_set():
        try:
            before = vllm_client.weight_version(url)
            ids, _ = _complete(url, model, max_tokens=24)
            after = vllm_client.weight_version(url)
            results.append((tuple(ids), before, after))
        except Exception as exc:  # collected: the assertion below reports them
            errors.append(repr(exc))


def test_publish_while_requests_stream_fails_none_of_them(tier: TierConfig, vllm_url: str, base_model_dir: Path,
                                                          tmp_path: Path, vllm_weights_lock: None) -> None:
    lora_v, full_v = _version(), _version()
    lora_dir = synthetic.make_lora_version(base_model_dir, tmp_path / f"policy-v{lora_v}", lora_v, seed=31)
    full_dir = synthetic.make_full_version(base_model_dir, tmp_path / f"policy-v{full_v}", full_v, seed=32)
    stop, results, errors = threading.Event(), [], []
    threads = [threading.Thread(target=_stream_requests, args=(vllm_url, tier.base_served_name, stop, results, errors))
               for _ in range(3)]
    for t in threads:
        t.start()
    try:
        while len(results) < 3:
            stop.wait(0.05)
        publisher.publish(lora_dir, tier)
        publisher.publish(full_dir, tier)
        mark = len(results)
        while len(results) < mark + 3:
            stop.wait(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        publisher.reload_full(vllm_url, base_model_dir.resolve(), 0, tier.http_timeout_s)
    assert not errors, f"{len(errors)} of {len(results) + len(errors)} streamed requests failed: {errors[:3]}"
    assert all(len(ids) == 24 for ids, _, _ in results), "a request was cut short by the publish"
    by_version: dict[int, set[tuple[int, ...]]] = {}
    for ids, before, after in results:
        version = logged_version(before, after)
        if version is not None:  # None: a reload fell inside this request's bracket; the proxy drops such a sample
            by_version.setdefault(version, set()).add(ids)
    assert {0, full_v} <= set(by_version), f"requests saw versions {sorted(by_version)}"
    # greedy decoding: one version gives one token sequence, so a logged version that disagrees with
    # the weights that really answered would show up as two sequences under one version
    assert all(len(seqs) == 1 for seqs in by_version.values()), {v: len(s) for v, s in by_version.items()}
    assert by_version[0] != by_version[full_v], "base and published full weights gave the same completion"


def test_registry_outage_still_pushes_and_says_the_version_is_not_registered(tier: TierConfig, vllm_url: str,
                                                                              base_model_dir: Path, tmp_path: Path) -> None:
    v = _version()
    vdir = synthetic.make_lora_version(base_model_dir, tmp_path / f"policy-v{v}", v, seed=15)
    # a store nobody can create (MLflow makes missing parent folders, but none can exist under /proc)
    broken = tier.with_changes(mlflow_tracking_uri="sqlite:////proc/no-such-store/mlflow.db")
    try:
        with pytest.raises(PublishError, match="NOT registered"):
            publisher.publish(vdir, broken)
        assert f"policy-v{v}" in vllm_client.served_models(vllm_url), "the servers should still have been updated"
        assert publisher.publish(vdir, tier).model_version is not None, "a rerun with the registry back registers it"
    finally:
        http("POST", f"{vllm_url}/v1/unload_lora_adapter", {"lora_name": f"policy-v{v}"})
