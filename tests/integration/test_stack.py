"""The foundation: the real Kafka, vLLM and MLflow that `flywheel infra up` starts behave as the loop needs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from flywheel import stack as stack_mod

REPO = Path(__file__).resolve().parents[2]


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # some vLLM endpoints (load_lora_adapter) answer plain text
        return {"text": text}


def _complete(vllm_url: str, model: str, prompt_ids: list[int], max_tokens: int = 8) -> tuple[list[int], list[float]]:
    out = _post(f"{vllm_url}/v1/completions", {
        "model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0,
        "logprobs": 0, "return_token_ids": True, "ignore_eos": True,
    })
    choice = out["choices"][0]
    return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])


def _reference_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    import torch

    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits.float()
    logp = torch.log_softmax(logits[0, len(prompt_ids) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(completion_ids)[:, None])[:, 0].tolist()


PROMPT = [1, 298, 201, 57, 74, 288, 223, 348, 223, 20, 319, 223, 21, 33, 2, 201, 1, 306, 201]


def test_kafka_round_trip_through_a_consumer_group(kafka_bootstrap, new_topic):
    from kafka import KafkaConsumer, KafkaProducer

    topic = new_topic("roundtrip", partitions=2)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    for i in range(20):
        producer.send(topic, key=f"s{i % 3}".encode(), value=f"m{i}".encode())
    producer.flush()
    producer.close()

    group = f"g-{uuid.uuid4().hex[:8]}"

    def consumer() -> KafkaConsumer:
        return KafkaConsumer(topic, bootstrap_servers=kafka_bootstrap, group_id=group, auto_offset_reset="earliest",
                             enable_auto_commit=False, consumer_timeout_ms=8000)

    first = consumer()
    seen: list[bytes] = []
    for msg in first:
        seen.append(msg.value)
        if len(seen) == 12:
            break
    first.commit()
    first.close()

    second = consumer()  # restarts from the committed offsets: the rest, nothing twice
    rest = [msg.value for msg in second]
    second.close()
    assert len(seen) == 12 and len(rest) == 8, f"first read {len(seen)}, after restart {len(rest)} (want 12 + 8)"
    assert sorted(seen + rest) == sorted(f"m{i}".encode() for i in range(20))


def test_vllm_returns_token_ids_and_logprobs(vllm_url, stack):
    ids, logprobs = _complete(vllm_url, stack.served_model_name, PROMPT, max_tokens=6)
    assert len(ids) == 6 and len(logprobs) == 6, f"{len(ids)} ids, {len(logprobs)} logprobs"
    assert all(isinstance(i, int) for i in ids)
    assert all(lp <= 0.0 for lp in logprobs), logprobs


def test_lora_hot_load_matches_peft(vllm_url, base_model_dir, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                     init_lora_weights=False)  # random A and B: the adapter visibly changes the model
    peft_model = get_peft_model(model, cfg).eval()
    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(adapter_dir)
    name = f"test-lora-{uuid.uuid4().hex[:8]}"
    _post(f"{vllm_url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)})
    try:
        ids, served = _complete(vllm_url, name, PROMPT)
        reference = _reference_logprobs(peft_model, PROMPT, ids)
        diff = max(abs(a - b) for a, b in zip(served, reference))
        base_ids, base_served = _complete(vllm_url, "policy-v0", PROMPT)
        base_reference = _reference_logprobs(peft_model, PROMPT, base_ids)
        base_diff = max(abs(a - b) for a, b in zip(base_served, base_reference))
    finally:
        _post(f"{vllm_url}/v1/unload_lora_adapter", {"lora_name": name})
    assert diff < 1e-4, f"vLLM LoRA logprobs differ from PEFT's by {diff:.2e} (limit 1e-4)"
    assert base_diff > 1e-3, f"the adapter should change the model, but the base matches it within {base_diff:.2e}"


def test_full_weight_reload_matches_new_weights(vllm_url, base_model_dir, tmp_path, vllm_weights_lock):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    new_dir = tmp_path / "full"
    model.save_pretrained(new_dir, safe_serialization=True)
    try:
        _post(f"{vllm_url}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(new_dir)}})
        ids, served = _complete(vllm_url, "policy-v0", PROMPT)
        reference = _reference_logprobs(model, PROMPT, ids)
        diff = max(abs(a - b) for a, b in zip(served, reference))
    finally:
        from flywheel.serving.publisher import reload_full

        reload_full(vllm_url, base_model_dir.resolve(), 0)  # base weights back, and no cached KV of the perturbed ones
    assert diff < 1e-4, f"after reload_weights vLLM logprobs differ from the new weights by {diff:.2e} (limit 1e-4)"
    base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32).eval()
    ids, served = _complete(vllm_url, "policy-v0", PROMPT)
    restored = max(abs(a - b) for a, b in zip(served, _reference_logprobs(base, PROMPT, ids)))
    assert restored < 1e-4, f"base weights not restored: diff {restored:.2e}"


def test_mlflow_records_a_run_with_metric_and_artifact(mlflow_uri, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    from flywheel.base import tracking

    client = tracking.client(mlflow_uri)
    exp_id = tracking.experiment_id(f"test-stack-{uuid.uuid4().hex[:8]}", mlflow_uri)
    run = client.create_run(exp_id)
    client.log_metric(run.info.run_id, "reward", 0.5, step=1)
    note = tmp_path / "note.txt"
    note.write_text("hello")
    client.log_artifact(run.info.run_id, str(note))
    client.set_terminated(run.info.run_id)
    again = MlflowClient(tracking_uri=tracking.absolute_uri(mlflow_uri)).get_run(run.info.run_id)
    assert again.data.metrics["reward"] == 0.5
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["note.txt"]
    stored = tracking.artifacts_root(mlflow_uri)
    assert any(stored.rglob("note.txt")), f"artifact not under the store's artifact folder {stored}"
    assert mlflow.__version__


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flywheel(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flywheel.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_infra_up_twice_is_harmless_and_down_leaves_nothing(tmp_path):
    """A private broker (own ports, own var dir) so the shared stack is untouched."""
    kafka_port, controller = _free_port(), _free_port()
    env = {"FLYWHEEL_VAR_DIR": str(tmp_path / "var"), "FLYWHEEL_INFRA_KAFKA_PORT": str(kafka_port),
           "FLYWHEEL_INFRA_KAFKA_CONTROLLER_PORT": str(controller), "FLYWHEEL_INFRA_MLFLOW_PORT": str(_free_port()),
           "FLYWHEEL_INFRA_VLLM_PORT": str(_free_port()), "FLYWHEEL_INFRA_PARTS": "kafka"}
    first = _flywheel("infra", "up", env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    pid_file = tmp_path / "var" / "run" / "kafka.pid.json"
    pid = json.loads(pid_file.read_text())["pid"]
    second = _flywheel("infra", "up", env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert json.loads(pid_file.read_text())["pid"] == pid, "a second `up` must not start another broker"
    assert "already healthy" in second.stderr + second.stdout
    down = _flywheel("infra", "down", env=env)
    assert down.returncode == 0, down.stdout + down.stderr
    time.sleep(0.5)
    assert not Path(f"/proc/{pid}").exists(), f"broker pid {pid} still running after down"
    assert not pid_file.exists()
    cfg = stack_mod.load_stack_config([])
    assert not stack_mod._port_busy("127.0.0.1", kafka_port), f"port {kafka_port} still bound after down"
    assert cfg.kafka_port == 9092  # the shared stack's config was not touched by the private one


def test_busy_port_gets_a_clear_error(tmp_path):
    port = _free_port()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", port))
        blocker.listen(1)
        env = {"FLYWHEEL_VAR_DIR": str(tmp_path / "var"), "FLYWHEEL_INFRA_MLFLOW_PORT": str(port),
               "FLYWHEEL_INFRA_PARTS": "mlflow"}
        out = _flywheel("infra", "up", env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    text = " ".join((out.stdout + out.stderr).split())
    assert f"port {port} is already in use" in text, text


@pytest.mark.parametrize("bad", ["--kafka-port=abc"])
def test_bad_config_is_one_clear_line(bad):
    out = _flywheel("infra", "status", bad)
    assert out.returncode == 2
    assert "kafka_port" in out.stderr, out.stderr


def test_the_test_session_records_into_its_own_mlflow_store_not_the_demos(mlflow_uri):
    """`make test` must leave nothing (test-gate-* models, test experiments) in the registry `make demo` shows."""
    from flywheel.base import defaults, tracking

    assert tracking.absolute_uri(mlflow_uri) != tracking.absolute_uri(defaults.MLFLOW_TRACKING_URI), mlflow_uri
    # every process a test starts resolves the same store (the flat FLYWHEEL_MLFLOW_TRACKING_URI)
    code = ("from flywheel.base.config import load_config; from flywheel.learner.config import LearnerConfig; "
            "print(load_config(LearnerConfig, [], 'flywheel learner').mlflow_tracking_uri)")
    child = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip().splitlines()[-1] == mlflow_uri, child.stdout
