"""Synthetic inputs for the learner's tests and benchmark: a tiny random model and episode files.

Episode rows are written exactly as the episode builder publishes them (lake.write_file with
schema.episode_arrow_schema()), so the learner reads them through its real input path.
"""

from __future__ import annotations

import datetime as _dt
import random
import uuid
from pathlib import Path
from typing import Any, Iterable

from ingest import lake, schema

SOURCE = "synthetic"


def tiny_model(out: Path, seed: int = 0, vocab_size: int = 512, hidden: int = 128, layers: int = 2) -> Path:
    """A random untied Qwen2 causal LM (head_dim 64, as vLLM's CPU attention needs) saved in HF format."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 3,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2,
                         pad_token_id=0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def episode_row(*, prompt: list[int], completion: list[int], logprobs: list[float], reward: float,
                policy_version: int = 0, task_type: str = "t", group_id: str | None = None,
                episode_id: str | None = None, label_version: int = 1, loss_mask: list[int] | None = None
                ) -> dict[str, Any]:
    """One row of the episodes table with every required column filled."""
    now = _dt.datetime.now(_dt.timezone.utc)
    return {
        "episode_id": episode_id or uuid.uuid4().hex, "label_version": label_version, "session_id": "s-" + uuid.uuid4().hex[:8],
        "agent_id": "main", "parent_agent_id": None, "task_type": task_type, "group_id": group_id,
        "model": f"policy-v{policy_version}", "policy_version": policy_version, "prompt_token_ids": prompt,
        "completion_token_ids": completion, "completion_logprobs": logprobs,
        "loss_mask": loss_mask if loss_mask is not None else [1] * len(completion), "reward": reward,
        "r_outcome": reward, "r_judge": None, "r_parallel": 0.0, "r_finish": 0.0, "r_penalty": 0.0,
        "reward_detail": None, "critical_steps": 1, "call_ts": now, "session_end_ts": now, "last_outcome_ts": now,
        "emitted_ts": now,
    }


def random_rows(n: int, *, seed: int = 0, vocab_size: int = 512, prompt_len: int = 16, completion_len: int = 16,
                policy_version: int = 0, task_type: str = "t") -> list[dict[str, Any]]:
    """Rows with random tokens, plausible behaviour logprobs and 0/1 rewards."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        rows.append(episode_row(
            prompt=[rng.randrange(3, vocab_size) for _ in range(prompt_len)],
            completion=[rng.randrange(3, vocab_size) for _ in range(completion_len)],
            logprobs=[-rng.uniform(5.5, 7.0) for _ in range(completion_len)],
            reward=float(rng.random() < 0.5), policy_version=policy_version, task_type=task_type,
            episode_id=f"ep-{seed}-{uuid.UUID(int=rng.getrandbits(128)).hex[:12]}"))
    return rows


def write_episodes(root: str | Path, rows: Iterable[dict[str, Any]], seq: int, source: str = SOURCE,
                   partition: int = 0) -> lake.LakeFile:
    """Publish rows as one episodes file; `seq` numbers files of a source (file i covers [seq, seq])."""
    import pyarrow as pa

    table = pa.Table.from_pylist(list(rows), schema=schema.episode_arrow_schema())
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    return lake.write_file(str(root), "episodes", date, source, partition, seq, seq, table)


def sample_rows(vllm_url: str, model: str, prompts: list[list[int]], *, n: int, max_tokens: int,
                policy_version: int, reward_fn: Any, task_type: str = "t", temperature: float = 1.0,
                timeout: float = 120.0) -> list[dict[str, Any]]:
    """Sample n completions per prompt from a real vLLM server and turn them into episode rows.

    Token ids and behaviour logprobs are the server's own (return_token_ids + logprobs), exactly
    what the capture proxy logs in production; `reward_fn(completion_ids) -> float`. The n samples
    of one prompt share a group_id, so they get group-relative advantages.
    """
    import json
    import urllib.request

    rows: list[dict[str, Any]] = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "n": n, "temperature": temperature,
                "logprobs": 0, "return_token_ids": True, "ignore_eos": True}
        request = urllib.request.Request(f"{vllm_url.rstrip('/')}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=timeout) as response:
            choices = json.loads(response.read())["choices"]
        group = uuid.uuid4().hex
        for choice in choices:
            ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            rows.append(episode_row(prompt=list(prompt), completion=ids, logprobs=logprobs,
                                    reward=float(reward_fn(ids)), policy_version=policy_version,
                                    task_type=task_type, group_id=group))
    return rows
