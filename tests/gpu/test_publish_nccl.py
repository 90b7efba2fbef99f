"""Full-weight publish over NCCL (vLLM's weight-transfer API) into a GPU vLLM server.

Skipped without CUDA (tests/gpu/conftest.py); NOT run on the CPU machines this project was built on.
It starts its own vLLM on a free port with a NCCL weight-transfer config, publishes a perturbed
copy of the tiny base model with transport "nccl", and compares vLLM's logprobs with transformers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.fixtures import models as synthetic
from flywheel.serving import publisher, vllm_client
from flywheel.serving.tier import TierConfig

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "var" / "models" / "tiny-base"
PROMPT = [5, 17, 33, 60, 61, 62, 100, 7]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_nccl_full_weight_publish_matches_the_published_weights(tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(BASE), "--port", str(port),
           "--served-model-name", "policy-v0", "--dtype", "float32", "--gpu-memory-utilization", "0.2",
           "--weight-transfer-config", '{"backend": "nccl"}']
    log = open(tmp_path / "vllm.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=2).read()
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, (tmp_path / "vllm.log").read_text()[-3000:]
                time.sleep(1)
        vdir = synthetic.make_full_version(BASE, tmp_path / "policy-v1", 1, seed=5)
        tier = TierConfig(servers=[url], transport="nccl", base_model=str(BASE))
        publisher.publish(vdir, tier, register=False)
        assert vllm_client.weight_version(url) == 1
        out = vllm_client.http("POST", f"{url}/v1/completions", {"model": "policy-v0", "prompt": PROMPT, "max_tokens": 8,
                                                                  "temperature": 0, "logprobs": 1, "return_token_ids": True})
        choice = out["choices"][0]
        ref = synthetic.reference_logprobs(synthetic.load_reference(BASE, vdir), PROMPT, choice["token_ids"])
        gap = max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], ref))
        assert gap < 1e-3, f"vLLM logprobs differ from the NCCL-published weights by {gap:.2e}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
