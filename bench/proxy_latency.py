"""The capture proxy's added latency per route, against calling vLLM directly in the same run (`flywheel bench
sidecar`, its last table).

For each route the proxy serves (chat completions, completions, Anthropic Messages, OpenAI Responses) a request
goes through the proxy, and the same request goes straight to vLLM: chat completions for the chat, Messages and
Responses routes (what the proxy translates them into), completions for the completions route. Each iteration
sends all of them in a shuffled order, on one keep-alive connection per target, so both sides see the same
machine at the same moment; greedy decoding with a fixed max_tokens keeps the work equal (the table shows each
side's completion tokens). The proxy logs every proxied call to Kafka (a fresh topic), as in production.

Added latency is the median of the per-iteration differences (proxied minus its direct twin) and the difference of
the p99s. Starts Kafka and vLLM only if they are not running, and stops only what it started.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.sidecar import _free_port

ROUTES = ("chat", "completions", "messages", "responses")
PROMPT = "What is the weather in paris today? Answer in one short sentence."


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def _requests(model: str, max_tokens: int) -> dict[str, tuple[str, dict[str, Any], str]]:
    """route -> (path, body, how its completion tokens are read from the reply)."""
    chat = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0}
    return {
        "chat": ("/v1/chat/completions", chat, "completion_tokens"),
        "completions": ("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                            "temperature": 0}, "completion_tokens"),
        "messages": ("/v1/messages", {"model": model, "max_tokens": max_tokens, "temperature": 0,
                                      "messages": [{"role": "user", "content": PROMPT}]}, "output_tokens"),
        "responses": ("/v1/responses", {"model": model, "input": PROMPT, "max_output_tokens": max_tokens,
                                        "temperature": 0, "store": False}, "output_tokens"),
    }


def _direct_twin(route: str) -> str:
    return "completions" if route == "completions" else "chat"


def _start_proxy(port: int, upstream: str, bootstrap: str, topic: str, model: str, tmp: Path) -> subprocess.Popen:
    log = open(tmp / "proxy.log", "wb")  # noqa: SIM115 (kept open for the process's life)
    cmd = [sys.executable, "-m", "flywheel.cli", "proxy", "--port", str(port), "--upstream", upstream,
           "--kafka-bootstrap", bootstrap, "--events-topic", topic, "--static-model", model, "--heartbeat-s", "0"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "FLYWHEEL_SPOOL_DIR": str(tmp / "spool")})


def _wait(client: Any, url: str, proc: subprocess.Popen, tmp: Path) -> None:
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if client.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except Exception:  # noqa: BLE001 (not listening yet)
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    raise RuntimeError(f"the proxy did not come up: {(tmp / 'proxy.log').read_text()[-2000:]}")


def run(requests: int, max_tokens: int, tmp: Path, console: Any, seed: int = 0) -> dict[str, Any]:
    """Measure; returns per route the direct and proxied p50/p99 (ms), the added latency and the tokens."""
    import httpx
    from kafka.admin import KafkaAdminClient, NewTopic

    from flywheel import stack as stack_mod

    cfg = stack_mod.load_stack_config([])
    started = stack_mod.ensure_up(cfg, parts=["kafka", "vllm"])
    if started:
        console.print(f"started {', '.join(started)} for the proxy's latency (stopped at the end)")
    topic = f"bench.proxy.{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=cfg.kafka_bootstrap, client_id="bench")
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    port = _free_port()
    proxy_url, vllm = f"http://127.0.0.1:{port}", cfg.vllm_url
    proc = _start_proxy(port, vllm, cfg.kafka_bootstrap, topic, cfg.served_model_name, tmp)
    direct_client, proxy_client = httpx.Client(timeout=120), httpx.Client(timeout=120)
    bodies = _requests(cfg.served_model_name, max_tokens)
    times: dict[str, list[float]] = {f"{side}:{r}": [] for r in ROUTES for side in ("proxy", "direct")}
    tokens: dict[str, list[int]] = {k: [] for k in times}
    rng = random.Random(seed)
    try:
        _wait(proxy_client, proxy_url, proc, tmp)
        arms = [("proxy", r) for r in ROUTES] + [("direct", "chat"), ("direct", "completions")]
        for i in range(requests + 5):  # the first five warm both paths up, untimed
            order = arms[:]
            rng.shuffle(order)
            session = f"bench-{uuid.uuid4().hex[:12]}"
            got: dict[tuple[str, str], tuple[float, int]] = {}
            for side, route in order:
                path, body, usage_key = bodies[route]
                headers = {"X-Flywheel-Session-Id": session} if side == "proxy" else {}  # logged, as in production
                client, base = (proxy_client, proxy_url) if side == "proxy" else (direct_client, vllm)
                t0 = time.perf_counter()
                reply = client.post(f"{base}{path}", json=body, headers=headers)
                elapsed = time.perf_counter() - t0
                if reply.status_code != 200:
                    raise RuntimeError(f"{side} {route}: HTTP {reply.status_code}: {reply.text[:300]}")
                got[(side, route)] = (elapsed, int((reply.json().get("usage") or {}).get(usage_key) or 0))
            if i < 5:
                continue
            for (side, route), (elapsed, n) in got.items():
                times[f"{side}:{route}"].append(elapsed)
                tokens[f"{side}:{route}"].append(n)
            for route in ROUTES:  # each proxied route's direct twin of this iteration
                twin = got[("direct", _direct_twin(route))]
                times.setdefault(f"diff:{route}", []).append(got[("proxy", route)][0] - twin[0])
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        direct_client.close()
        proxy_client.close()
        admin.delete_topics([topic])
        admin.close()
        if started:
            stack_mod.down(cfg, parts=started)
    out: dict[str, Any] = {"requests": requests, "max_tokens": max_tokens}
    for route in ROUTES:
        twin = _direct_twin(route)
        proxied, direct, diff = times[f"proxy:{route}"], times[f"direct:{twin}"], times[f"diff:{route}"]
        out[route] = {
            "direct": f"{twin} (vLLM)", "direct_p50_ms": 1e3 * _pct(direct, 0.5), "direct_p99_ms": 1e3 * _pct(direct, 0.99),
            "proxy_p50_ms": 1e3 * _pct(proxied, 0.5), "proxy_p99_ms": 1e3 * _pct(proxied, 0.99),
            "added_p50_ms": 1e3 * statistics.median(diff),
            "added_p99_ms": 1e3 * (_pct(proxied, 0.99) - _pct(direct, 0.99)),
            "proxy_tokens": statistics.fmean(tokens[f"proxy:{route}"]),
            "direct_tokens": statistics.fmean(tokens[f"direct:{twin}"]),
        }
    return out


def print_table(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"the capture proxy's added latency per route: {result['requests']} requests each, "
                        f"max_tokens {result['max_tokens']}, greedy, against vLLM directly in the same run")
    table.add_column("route (through the proxy)")
    table.add_column("direct twin")
    for col in ("direct p50 ms", "proxy p50 ms", "added p50 ms", "direct p99 ms", "proxy p99 ms", "added p99 ms",
                "tokens proxy / direct"):
        table.add_column(col, justify="right")
    for route in ROUTES:
        r = result[route]
        table.add_row(route, r["direct"], f"{r['direct_p50_ms']:.1f}", f"{r['proxy_p50_ms']:.1f}",
                      f"{r['added_p50_ms']:+.1f}", f"{r['direct_p99_ms']:.1f}", f"{r['proxy_p99_ms']:.1f}",
                      f"{r['added_p99_ms']:+.1f}", f"{r['proxy_tokens']:.1f} / {r['direct_tokens']:.1f}")
    console.print(table)


def summary_fields(result: dict[str, Any]) -> dict[str, Any]:
    """The JSON line's fields: proxy_<route>_{added_p50_ms, added_p99_ms, p50_ratio}."""
    out: dict[str, Any] = {"proxy_requests": result["requests"]}
    for route in ROUTES:
        r = result[route]
        out[f"proxy_{route}_added_p50_ms"] = round(r["added_p50_ms"], 2)
        out[f"proxy_{route}_added_p99_ms"] = round(r["added_p99_ms"], 2)
        out[f"proxy_{route}_p50_ratio"] = round(r["proxy_p50_ms"] / r["direct_p50_ms"], 3)
    return out
