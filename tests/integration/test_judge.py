"""The LLM judge against the real local vLLM (the tiny model), through the portable path: the `openai` client with
`response_format` json_schema. Every score parses; an endpoint that requires an API key (a small forwarder in
front of vLLM that checks Authorization, standing in for a hosted judge) refuses a judge without the key and
answers one with it; a hung endpoint is a timeout, retried within the request and queued for a later pass.
"""

from __future__ import annotations

import datetime as dt
import http.server
import json
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pytest

from bench.fixtures import sessions as synthetic
from flywheel.ingest import lake
from flywheel.rewards import builder as episodes
from flywheel.rewards import config, judge

RUBRIC = config.Rubric("t", "1", "Rate how well the answer solves the task: 1 bad, 5 perfect.")
KEY = "sk-test-judge-key"
TOML = """
[task_types.default]
judge = true
{weight}
[judge]
model = "policy-v0"
timeout_s = {timeout}
retries = 0
chars_per_token = 1.8
max_tokens = 900
"""


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A TCP endpoint that accepts and never answers (a hung judge server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.fixture
def keyed_endpoint(vllm_url: str) -> Iterator[str]:
    """An endpoint that requires `Authorization: Bearer KEY` (401 otherwise) and forwards to the real vLLM."""

    class Forward(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 -- http.server's name
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.headers.get("authorization") != f"Bearer {KEY}":
                return self._send(401, b'{"error": {"message": "invalid API key", "type": "invalid_request_error"}}')
            request = urllib.request.Request(vllm_url + self.path, body, {"content-type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=60) as resp:
                    self._send(resp.status, resp.read())
            except urllib.error.HTTPError as exc:
                self._send(exc.code, exc.read())

        def _send(self, code: int, payload: bytes) -> None:
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_every_score_parses_through_response_format_and_is_cached(vllm_url: str, tmp_path: Path) -> None:
    j = judge.Judge(vllm_url, "policy-v0", config.JudgeSettings(timeout_s=30), cache_dir=tmp_path / "cache")
    texts = [f"TASK: add {i} and {i + 1}\nANSWER: {2 * i + 1}" for i in range(8)] + ["", "x" * 1500]
    results = [j.score(t, RUBRIC) for t in texts]
    bad = [(t[:30], r) for t, r in zip(texts, results) if r.status != "ok" or r.score not in range(1, 6)]
    assert not bad, f"unparsed judge answers: {bad}"
    again = [j.score(t, RUBRIC) for t in texts]
    assert [r.status for r in again] == ["cached"] * len(texts)
    assert [r.score for r in again] == [r.score for r in results]
    assert j.calls == len(texts) and j.cache_hits == len(texts)
    bumped = config.Rubric("t", "2", RUBRIC.text)
    assert j.score(texts[0], bumped).status == "ok", "a new rubric version must not hit the old cache entry"


def test_vllms_choice_output_is_kept_as_an_option(vllm_url: str) -> None:
    j = judge.Judge(vllm_url, "policy-v0", config.JudgeSettings(timeout_s=30, output="choice"), cache_dir=None)
    results = [j.score(f"TASK: {i}", RUBRIC) for i in range(4)]
    assert all(r.status == "ok" and r.score in range(1, 6) for r in results), results


def test_an_endpoint_that_requires_a_key_refuses_a_judge_without_it(keyed_endpoint: str) -> None:
    settings = config.JudgeSettings(timeout_s=30, retries=2, backoff_s=0.1)
    without = judge.Judge(keyed_endpoint, "policy-v0", settings, cache_dir=None).score("TASK: x", RUBRIC)
    assert without.score is None and without.status.startswith("error: HTTP 401"), without
    assert without.attempts == 1 and not without.retryable, f"a 401 is not retried: {without}"
    wrong = judge.Judge(keyed_endpoint, "policy-v0", settings, cache_dir=None, api_key="sk-wrong").score("TASK: x", RUBRIC)
    assert wrong.status.startswith("error: HTTP 401"), wrong
    keyed = judge.Judge(keyed_endpoint, "policy-v0", settings, cache_dir=None, api_key=KEY)
    results = [keyed.score(f"TASK: add {i} and 1", RUBRIC) for i in range(3)]
    assert all(r.status == "ok" and r.score in range(1, 6) for r in results), results


def test_timeout_is_recorded_and_retried_within_the_request(silent_endpoint: str) -> None:
    once = judge.Judge(silent_endpoint, "policy-v0", config.JudgeSettings(timeout_s=0.5, retries=0), cache_dir=None)
    result = once.score("TASK: x", RUBRIC)
    assert result.status == "timeout" and result.score is None and result.retryable, result
    assert 0.4 < result.latency_s < 5, result
    assert result.r_judge(0.5) is None
    twice = judge.Judge(silent_endpoint, "policy-v0", config.JudgeSettings(timeout_s=0.3, retries=1, backoff_s=0.1),
                        cache_dir=None)
    result = twice.score("TASK: x", RUBRIC)
    assert (result.status, result.attempts, twice.calls) == ("timeout", 2, 2), result


def build_with_judge(tmp_path: Path, url: str, timeout: float, weight: str = "") -> tuple[list[dict], episodes.Builder]:
    root = str(tmp_path / "lake")
    feed = synthetic.LakeFeeder(root)
    start = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
    for i in range(3):
        b = synthetic.SessionBuilder(f"judge-{i}", start, task_type="default").begin()
        b.llm_call(text=f"what is {i} + {i}?")
        b.tool()
        b.llm_call(text="and the answer?")
        b.end()
        feed.write("events", b.events)
    cfg = episodes.EpisodesConfig(lake_root=root, state_dir=str(tmp_path / "state"), var_dir=str(tmp_path / "var"),
                                  judge_url=url)
    builder = episodes.Builder(cfg, config.parse(TOML.format(timeout=timeout, weight=weight)))
    builder.run_pass()
    files = lake.list_files(root, "episodes")
    return pa.concat_tables([lake.read_file(root, f) for f in files]).to_pylist(), builder


def test_builder_scores_whole_trajectories_with_the_real_judge(vllm_url: str, tmp_path: Path) -> None:
    rows, builder = build_with_judge(tmp_path, vllm_url, timeout=30)
    builder.close()
    assert len(rows) == 6
    for r in rows:
        detail = json.loads(r["reward_detail"])["judge"]
        assert detail["status"] == "ok" and detail["score"] in range(1, 6) and r["judge_score"] == detail["score"], detail
        assert detail["version"] == "policy-v0/default@1" and not detail["shadow"], detail
        assert r["r_judge"] == pytest.approx(0.5 * (detail["score"] - 3) / 2)
        assert r["reward"] == pytest.approx(r["r_judge"] + r["r_outcome"] + r["r_parallel"] + r["r_finish"] + r["r_penalty"])


def test_builder_in_shadow_mode_stores_the_score_and_leaves_the_reward(vllm_url: str, tmp_path: Path) -> None:
    rows, builder = build_with_judge(tmp_path, vllm_url, timeout=30, weight="judge_weight = 0.0")
    builder.close()
    assert len(rows) == 6 and all(r["judge_score"] in range(1, 6) for r in rows), [r["judge_score"] for r in rows]
    assert {r["r_judge"] for r in rows} == {0.0}
    assert all(r["reward"] == pytest.approx(r["r_outcome"] + r["r_penalty"]) for r in rows)


def test_builder_emits_despite_a_hung_judge_and_queues_a_retry(silent_endpoint: str, tmp_path: Path) -> None:
    rows, builder = build_with_judge(tmp_path, silent_endpoint, timeout=0.3)
    assert len(rows) == 6, "a hung judge must not hold episodes back"
    assert all(r["r_judge"] is None and r["judge_score"] is None for r in rows)
    assert {json.loads(r["reward_detail"])["judge"]["status"] for r in rows} == {"timeout"}
    assert sorted(q["session_id"] for q in builder.state.judge_retry) == ["judge-0", "judge-1", "judge-2"]
    builder.close()
