"""Every `flywheel bench NAME` runs end to end in a small mode, so a benchmark cannot break unnoticed again
(`flywheel bench weights` failed with PublishError while nothing ran it).

Each bench runs as a user runs it, `python -m flywheel.cli bench NAME ...` from the repository root, on the
session's stack: its own `stack.ensure_up` finds Kafka, MLflow and vLLM healthy and starts nothing (the MLflow
store is the test session's, through FLYWHEEL_MLFLOW_TRACKING_URI, which the `stack` fixture exports). A pass
is exit status 0 and, as the last stdout line, the JSON object the bench documents, with its key fields present
and sane. The figures themselves are not judged: a small run on a shared machine says nothing about speed.

tests/unit/test_bench_small_flags.py checks without the stack that SMALL has every bench and that its flags parse.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pytest

if TYPE_CHECKING:
    from flywheel.stack import StackConfig

REPO = Path(__file__).resolve().parents[2]

# The smallest flags that still run each bench's whole path, and about how long each takes on a quiet 2-core
# machine (set-up included). "{tmp}" is the test's tmp_path, "{kafka}" the session broker's bootstrap.
SMALL: dict[str, list[str]] = {
    # every variant, the outage one included (it starts and kills a private broker: most of the ~40 s)
    # and 20 requests per proxy route beside vLLM directly (the session's vLLM)
    "sidecar": ["--calls", "500", "--warmup", "100", "--burst-calls", "500", "--proxy-requests", "20"],  # ~60 s
    "ingest": ["--events", "500", "--live-rate", "100", "--live-seconds", "3", "--kafka-bootstrap", "{kafka}"],  # ~40 s
    # --new under the 50 sessions of one lake file fails the bench's own check (it still writes one file)
    "episodes": ["--sessions", "50", "--new", "50", "--reps", "1", "--listing-files", "2"],  # ~30 s
    "learner": ["--steps", "1", "--batch-size", "8", "--micro-batch", "4", "--prompt-len", "32",
                "--completion-len", "8", "--publishes", "1"],  # ~60 s
    "weights": ["--reps", "1"],  # ~30 s
    # schedule() wants traffic >= outage_s + 120 s: 2.2 min holds a 10 s outage; the run adds ~30-60 s of set-up,
    # up to --drain-s of drain and ~20 s of audit and clean-up: ~4-5 min in all
    # its pass bar lowered to what it does, so it exits 0 only when nothing was lost or landed twice
    "chaos": ["--minutes", "2.2", "--kills", "2", "--outage-s", "10", "--drain-s", "60", "--var-dir", "{tmp}",
              "--min-kills", "2", "--min-outage-s", "10"],
    "gate": ["--challengers", "20", "--stream-days", "0.01", "--out-dir", "{tmp}"],  # ~20 s
}
SLOW = {"chaos"}  # over ~4 min even when small

# `flywheel bench ingest --vs quixstreams` is a mode of `ingest` with a peer of its own: each side once on 500
# events, one kill. On a fresh clone the Quix environment (var/venvs/quixstreams-*: ~1 min of pip from the package
# index) is built in the background from the session's start (conftest.BackgroundBuild), then ~2 min of runs.
INGEST_VS_QUIX = ["--vs", "quixstreams", "--events", "500", "--rounds", "1", "--lakes", "local", "--live-seconds",
                  "3", "--kill-seconds", "10", "--kills", "1", "--kafka-bootstrap", "{kafka}"]


def small_flags(name: str, tmp: Path, kafka: str) -> list[str]:
    return [flag.format(tmp=tmp, kafka=kafka) for flag in SMALL[name]]


def _positive(result: dict[str, Any], *keys: str) -> None:
    for key in keys:
        value = result.get(key)
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, \
            f"{key} = {value!r}, want a finite number > 0"


def _rate(result: dict[str, Any], *keys: str) -> None:
    for key in keys:
        value = result.get(key)
        assert isinstance(value, (int, float)) and 0.0 <= value <= 1.0, f"{key} = {value!r}, want a rate in [0, 1]"


def check_sidecar(r: dict[str, Any]) -> None:
    _positive(r, "p99_us", "burst_p99_us", "parked_p99_us", "otel_p99_us", "outage_p99_us", "sent")
    assert r.get("delivered") is True, f"the SDK did not deliver everything with the broker up: {r.get('delivered')!r}"
    assert r.get("calls") == 500, f"calls = {r.get('calls')!r}"
    assert r.get("proxy_requests") == 20, f"proxy_requests = {r.get('proxy_requests')!r}"
    _positive(r, *(f"proxy_{route}_p50_ratio" for route in ("chat", "completions", "messages", "responses")))


def check_ingest(r: dict[str, Any]) -> None:
    _positive(r, "raw_consume_events_per_s", "events_per_s", "events_per_s_v1", "ratio", "files", "decode_us")
    # a live event that never became visible counts as inf: every one must have landed
    visible = r.get("max_visible_s")
    assert isinstance(visible, (int, float)) and math.isfinite(visible) and visible >= 0, \
        f"live events not all visible in the lake: p95 {r.get('p95_visible_s')!r} s, max {visible!r} s"
    assert r.get("events") == 500, f"events = {r.get('events')!r}"


def check_episodes(r: dict[str, Any]) -> None:
    _positive(r, "sessions_per_s", "sessions_1x", "sessions_10x", "incremental_1x_s", "incremental_10x_s",
              "full_rebuild_10x_plus_new_s", "listing_pass_1x_s", "listing_pass_100x_s")
    assert r.get("new_sessions") == 50, f"new_sessions = {r.get('new_sessions')!r}"
    assert r["listing_files_100x"] > r.get("listing_files_1x", 0), \
        f"listing lakes: {r.get('listing_files_1x')} and {r['listing_files_100x']} files"


def check_learner(r: dict[str, Any]) -> None:
    _positive(r, "tokens_per_s", "bare_tokens_per_s", "ratio", "publish_s", "learner_step_s")
    assert r.get("steps") == 1 and r.get("mode") == "lora", f"steps {r.get('steps')!r}, mode {r.get('mode')!r}"


def check_weights(r: dict[str, Any]) -> None:
    _positive(r, "lora_push_s", "full_push_s", "full_reload_only_s", "full_validate_only_s", "full_bytes",
              "full_push_mb_per_s", "copy_mb_per_s")
    assert r.get("reps") == 1, f"reps = {r.get('reps')!r}"


def check_chaos(r: dict[str, Any]) -> None:
    """The run got through set-up, traffic with its faults, drain and audit, and its own checks passed (exit 0, the
    pass bar lowered to the small run's kills and outage): nothing lost, nothing landed or trained twice."""
    assert "error" not in r, f"the chaos run did not complete: {r.get('error')}"
    assert r.get("failed") == [], f"the chaos audit failed: {r.get('failed')} (audit file: {r.get('audit_path')})"
    for key in ("events_lost", "events_lost_uncompleted", "events_duplicated_in_lake",
                "events_duplicated_in_episodes", "episodes_trained_twice", "lake_behind_kafka", "spool_records_left"):
        assert isinstance(r.get(key), int) and r[key] >= 0, f"{key} = {r.get(key)!r}, want a count"
    _positive(r, "sessions_completed", "kills", "broker_outage_s", "elapsed_s")
    assert isinstance(r.get("failed"), list), f"failed = {r.get('failed')!r}"


def check_gate(r: dict[str, Any]) -> None:
    _rate(r, "false_promotion_rate", "power_5pt", "power_10pt", "msprt_false_promotion_rate", "msprt_power_10pt",
          "malformed_breach_promote_rate", "srm_detected_before_last_look", "srm_false_alarm_rate")
    assert r.get("false_promotions_per_day_demo_per_challenger", -1) >= 0, r
    assert r.get("challengers") == 20, f"challengers = {r.get('challengers')!r}"
    assert Path(str(r.get("plot"))).is_file(), f"no plot at {r.get('plot')!r}"


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "sidecar": check_sidecar, "ingest": check_ingest, "episodes": check_episodes, "learner": check_learner,
    "weights": check_weights, "chaos": check_chaos, "gate": check_gate,
}
TIMEOUT_S = {"chaos": 900.0}  # the others: DEFAULT_TIMEOUT_S, several times their small run on a busy machine
DEFAULT_TIMEOUT_S = 300.0


def run_bench(name: str, flags: list[str], timeout_s: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr). On a timeout the bench gets SIGTERM first: chaos cleans up on it (its
    processes, private broker and vLLM weights), where the SIGKILL of subprocess.run's timeout would leave them."""
    proc = subprocess.Popen([sys.executable, "-m", "flywheel.cli", "bench", name, *flags], cwd=REPO,
                            env={**os.environ}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"flywheel bench {name} {' '.join(flags)} ran over {timeout_s:.0f} s\n"
                    f"--- stdout (tail)\n{out[-3000:]}\n--- stderr (tail)\n{err[-3000:]}")
    return proc.returncode, out, err


def last_json(out: str) -> dict[str, Any]:
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines, "nothing on stdout"
    result = json.loads(lines[-1])  # a bench's last line is its JSON object, whatever it printed before
    assert isinstance(result, dict), f"the last line is {type(result).__name__}, not a JSON object: {lines[-1][:300]}"
    return result


def _param(name: str) -> Any:
    marks = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S[name] + 300)] if name in SLOW else []
    return pytest.param(name, marks=marks, id=name)


# No vllm_weights_lock here, though weights and chaos reload vLLM's full weights: each bench flocks
# var/run/vllm-weights.lock itself, and a lock held by this process would make the child wait for it forever.
@pytest.mark.parametrize("name", [_param(name) for name in SMALL])
def test_bench_runs_small_and_prints_its_json(name: str, stack: StackConfig, tmp_path: Path) -> None:
    flags = small_flags(name, tmp_path, stack.kafka_bootstrap)
    rc, out, err = run_bench(name, flags, TIMEOUT_S.get(name, DEFAULT_TIMEOUT_S))
    tail = f"--- stdout (tail)\n{out[-3000:]}\n--- stderr (tail)\n{err[-3000:]}"
    assert rc == 0, f"flywheel bench {name} {' '.join(flags)} exited {rc}\n{tail}"
    try:
        result = last_json(out)
    except (AssertionError, ValueError) as exc:
        pytest.fail(f"flywheel bench {name}: no JSON object as the last stdout line ({exc})\n{tail}")
    try:
        CHECKS[name](result)
    except AssertionError as exc:
        pytest.fail(f"flywheel bench {name}: {exc}\nJSON: {json.dumps(result)[:3000]}\n{tail}")


def check_ingest_vs_quixstreams(r: dict[str, Any]) -> None:
    for side in ("writer", "writer_rdkafka", "quix"):
        _positive(r, f"{side}_local_events_per_s", f"{side}_local_cpu_s_per_10k", f"{side}_local_json_cpu_s_per_10k",
                  f"{side}_local_bytes_per_event")
        assert r.get(f"{side}_local_kills") == 1, f"{side}: kills = {r.get(f'{side}_local_kills')!r}"
        visible = r.get(f"{side}_local_p95_visible_s")
        assert isinstance(visible, (int, float)) and math.isfinite(visible), f"{side}: p95 visible {visible!r}"
    for side in ("writer", "writer_rdkafka"):  # the lake writer's guarantee, on either client; the peer's is measured
        lost, dup = r.get(f"{side}_local_lost_after_kills"), r.get(f"{side}_local_duplicated_after_kills")
        assert (lost, dup) == (0, 0), f"{side} after a SIGKILL: {lost} lost, {dup} duplicated"
    assert isinstance(r.get("quix_local_lost_after_kills"), int), r.get("quix_local_lost_after_kills")
    _positive(r, "writer_vs_quix_local", "writer_rdkafka_vs_quix_local", "writer_vs_quix_local_json")
    assert r.get("events") == 500 and r.get("quixstreams_version"), r


def test_ingest_vs_quixstreams_runs_small_and_prints_its_json(stack: StackConfig, tmp_path: Path,
                                                              background_build: Callable[[str], Path]) -> None:
    background_build("test_bench_small.py")  # the peer's environment, built from the session's start
    flags = [flag.format(tmp=tmp_path, kafka=stack.kafka_bootstrap) for flag in INGEST_VS_QUIX]
    rc, out, err = run_bench("ingest", flags, 600.0)
    tail = f"--- stdout (tail)\n{out[-3000:]}\n--- stderr (tail)\n{err[-3000:]}"
    assert rc == 0, f"flywheel bench ingest {' '.join(flags)} exited {rc}\n{tail}"
    result = last_json(out)
    try:
        check_ingest_vs_quixstreams(result)
    except AssertionError as exc:
        pytest.fail(f"flywheel bench ingest --vs quixstreams: {exc}\nJSON: {json.dumps(result)[:3000]}\n{tail}")
