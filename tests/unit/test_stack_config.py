"""The stack's config with several vLLM servers: their ports, URLs, CPU binding and pid files (no process started)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flywheel import stack
from flywheel.base.config import ConfigError


def _cfg(tmp_path: Path, **changes: object) -> stack.StackConfig:
    return stack.replace_config(stack.load_stack_config([]), var_dir=tmp_path / "var", **changes)


def test_servers_listen_on_consecutive_ports_and_the_first_is_vllm_url(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, vllm_port=8100, vllm_servers=3)
    assert cfg.vllm_urls == ["http://127.0.0.1:8100", "http://127.0.0.1:8101", "http://127.0.0.1:8102"], cfg.vllm_urls
    assert cfg.vllm_url == cfg.vllm_urls[0]
    assert [stack.vllm_name(i) for i in range(3)] == ["vllm", "vllm-1", "vllm-2"]


def test_a_server_port_that_collides_with_kafka_or_mlflow_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("collide with {'mlflow_port': 8002}")):
        _cfg(tmp_path, vllm_port=8000, vllm_servers=3, mlflow_port=8002)
    with pytest.raises(ConfigError, match="vllm_servers"):
        _cfg(tmp_path, vllm_servers=0)
    assert stack.load_stack_config(["--vllm-servers", "2"]).vllm_servers == 2


def test_each_of_several_servers_is_bound_to_its_own_core_unless_the_user_chose(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(stack.os, "cpu_count", lambda: 2)
    two, three = _cfg(tmp_path, vllm_servers=2), _cfg(tmp_path, vllm_servers=3)
    assert [stack._vllm_env(two, i)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(2)] == ["0", "1"]
    # more servers than cores: none bound (a bound third server shared a core, and its arm looked slow to the gate)
    assert [(stack._vllm_env(three, i)["VLLM_CPU_OMP_THREADS_BIND"], stack._vllm_env(three, i)["OMP_NUM_THREADS"])
            for i in range(3)] == [("nobind", "1")] * 3
    assert "VLLM_CPU_OMP_THREADS_BIND" not in stack._vllm_env(_cfg(tmp_path), 0), "one server keeps vLLM's own binding"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "all")
    assert {stack._vllm_env(three, i)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(3)} == {"all"}


def test_servers_get_lora_only_when_the_tier_loads_adapters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lora, full = _cfg(tmp_path), _cfg(tmp_path, vllm_lora=False)
    command = stack._vllm_command(lora, tmp_path, 8000)
    flags = command[command.index("--enable-lora"):][:5]
    assert flags == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "32"], command
    assert stack._vllm_env(lora, 0)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert not {"--enable-lora", "--max-loras", "--max-lora-rank"} & set(stack._vllm_command(full, tmp_path, 8000))
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in stack._vllm_env(full, 0)
    assert stack._vllm_env(full, 0)["VLLM_SERVER_DEV_MODE"] == "1", "full-weight reloads need the dev routes"
    assert stack.load_stack_config(["--no-vllm-lora"]).vllm_lora is False

    # a healthy server of ours: a LoRA tier restarts it when it was started without LoRA; a full tier keeps either
    stopped: list[str] = []
    monkeypatch.setattr(stack, "_serves_name", lambda cfg, url: True)
    monkeypatch.setattr(stack, "_serves_base_at", lambda cfg, url: True)
    monkeypatch.setattr(stack, "_stop_one", lambda cfg, name: stopped.append(name))
    monkeypatch.setattr(stack, "_port_busy", lambda host, port: False)
    for started_with, cfg, ready in ((full, lora, False), (lora, lora, True), (full, full, True), (lora, full, True)):
        record = {"cmd": stack._vllm_command(started_with, tmp_path, 8000)}
        monkeypatch.setattr(stack, "_read_pid", lambda c, name, r=record: r)
        stopped.clear()
        assert stack._vllm_ready(cfg, 0) is ready and stopped == ([] if ready else ["vllm"]), \
            f"started with LoRA {started_with.vllm_lora}, wanted {cfg.vllm_lora}"


def test_the_vllm_part_names_every_server_and_any_an_earlier_up_left(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, vllm_servers=2)
    run_dir = tmp_path / "var" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "vllm-3.pid.json").write_text(json.dumps({"pid": 1, "marker": "x"}))
    (run_dir / "vllm-weights.lock").write_text("")
    assert stack._processes(cfg, "vllm") == ["vllm", "vllm-1", "vllm-3"]
    assert stack._processes(cfg, "kafka") == ["kafka"]


def _props(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def test_one_broker_keeps_its_ports_dir_and_replication_of_one(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    assert cfg.kafka_bootstrap == "127.0.0.1:9092" and cfg.kafka_replication == 1
    props = _props(stack._write_kafka_config(cfg))
    assert props["node.id"] == "1" and props["controller.quorum.voters"] == "1@127.0.0.1:9093", props
    assert props["log.dirs"] == str((tmp_path / "var" / "kafka" / "data").resolve()), props["log.dirs"]
    assert props["offsets.topic.replication.factor"] == "1" and "min.insync.replicas" not in props, props
    assert stack.kafka_node_name(cfg, 1) == "kafka"


def test_a_cluster_gives_each_node_its_id_ports_and_storage_and_one_quorum(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, kafka_brokers=3, kafka_port=19092, kafka_controller_port=19093)
    assert cfg.kafka_nodes == [(1, 19092, 19093), (2, 19094, 19095), (3, 19096, 19097)], cfg.kafka_nodes
    assert cfg.kafka_bootstrap == "127.0.0.1:19092,127.0.0.1:19094,127.0.0.1:19096", cfg.kafka_bootstrap
    nodes = [_props(stack._write_kafka_config(cfg, node_id)) for node_id in (1, 2, 3)]
    assert [p["node.id"] for p in nodes] == ["1", "2", "3"]
    assert {p["controller.quorum.voters"] for p in nodes} == {"1@127.0.0.1:19093,2@127.0.0.1:19095,3@127.0.0.1:19097"}
    assert [p["listeners"] for p in nodes] == [f"PLAINTEXT://127.0.0.1:{c},CONTROLLER://127.0.0.1:{k}"
                                               for c, k in ((19092, 19093), (19094, 19095), (19096, 19097))]
    assert len({p["log.dirs"] for p in nodes}) == 3, [p["log.dirs"] for p in nodes]
    for p in nodes:
        got = {k: p[k] for k in ("default.replication.factor", "min.insync.replicas", "offsets.topic.replication.factor",
                                 "transaction.state.log.replication.factor", "unclean.leader.election.enable")}
        assert got == {"default.replication.factor": "3", "min.insync.replicas": "2", "offsets.topic.replication.factor": "3",
                       "transaction.state.log.replication.factor": "3", "unclean.leader.election.enable": "false"}, got
    assert [stack.kafka_node_name(cfg, n) for n in (1, 2, 3)] == ["kafka-1", "kafka-2", "kafka-3"]
    assert stack.load_stack_config(["--kafka-brokers", "3"]).kafka_brokers == 3


def test_a_cluster_of_two_or_with_colliding_ports_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kafka_brokers: 1 or at least 3, got 2"):
        _cfg(tmp_path, kafka_brokers=2)
    with pytest.raises(ConfigError, match="must differ"):  # 9092 + 2 is node 2's client port and node 1's controller
        _cfg(tmp_path, kafka_brokers=3, kafka_port=9092, kafka_controller_port=9094)
    with pytest.raises(ConfigError, match=re.escape("{'mlflow_port': 9096}")):
        _cfg(tmp_path, kafka_brokers=3, mlflow_port=9096)


def test_the_kafka_part_names_every_node_and_any_an_earlier_up_left(tmp_path: Path) -> None:
    run_dir = tmp_path / "var" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "kafka-2.pid.json").write_text(json.dumps({"pid": 1, "marker": "x"}))
    assert stack._processes(_cfg(tmp_path), "kafka") == ["kafka", "kafka-2"], "down after `up --kafka-brokers 3` stops the nodes"
    assert stack._processes(_cfg(tmp_path, kafka_brokers=3), "kafka") == ["kafka-1", "kafka-2", "kafka-3"]


def test_a_cluster_is_up_only_when_every_listener_accepts_even_if_the_metadata_lists_every_broker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # KRaft lists a broker as live (unfenced) before its listener accepts; topics created then were refused (CI)
    cfg = _cfg(tmp_path, kafka_brokers=3, kafka_port=29100, kafka_controller_port=29101)
    closed = {cfg.kafka_nodes[2][1]}
    monkeypatch.setattr(stack, "_alive_and_ours", lambda record: True)
    monkeypatch.setattr(stack, "kafka_live_brokers", lambda c, timeout_s=5.0: 3)
    monkeypatch.setattr(stack, "_port_open", lambda host, port: port not in closed)
    assert not stack._cluster_up(cfg, [{}, {}, {}])
    closed.clear()
    assert stack._cluster_up(cfg, [{}, {}, {}])


def test_creating_topics_retries_a_refused_connection_then_names_the_bootstrap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kafka.errors import KafkaConnectionError

    calls: list[int] = []

    def refused_twice(cfg: stack.StackConfig) -> None:
        calls.append(1)
        if len(calls) <= 2:
            raise KafkaConnectionError("111 ECONNREFUSED")

    monkeypatch.setattr(stack, "_create_topics", refused_twice)
    monkeypatch.setattr(stack.time, "sleep", lambda s: None)
    stack.ensure_topics(_cfg(tmp_path))
    assert len(calls) == 3
    monkeypatch.setattr(stack, "_create_topics", lambda cfg: (_ for _ in ()).throw(KafkaConnectionError("refused")))
    with pytest.raises(stack.StackError, match="creating topics at 127.0.0.1:9092 failed"):
        stack.ensure_topics(_cfg(tmp_path), retry_s=0.0)


def test_nice_reaches_every_thread_of_a_server_and_is_only_ever_raised(tmp_path: Path) -> None:
    """A real process group (a server's shape: its own session, a second thread), reniced through its pid record."""
    marker = f"flywheel-nice-test-{os.getpid()}"
    code = "import sys, threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, marker], start_new_session=True)
    try:
        cfg = _cfg(tmp_path, vllm_nice=10)
        path = stack._pid_path(cfg, stack.vllm_name(0))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"pid": proc.pid, "marker": marker}))
        tasks = Path(f"/proc/{proc.pid}/task")
        for _ in range(100):  # the second thread starts after the interpreter does
            if len(list(tasks.iterdir())) >= 2:
                break
            time.sleep(0.05)

        def nices() -> set[int]:  # field 19 of /proc/<pid>/task/<tid>/stat, after the ")" that ends the name
            return {int((t / "stat").read_text().rsplit(")", 1)[1].split()[16]) for t in tasks.iterdir()}

        # the session's scheduler group weighs it against other sessions (absent on a kernel without autogroups)
        group = (lambda: stack.autogroup_nice(proc.pid)) if Path(f"/proc/{proc.pid}/autogroup").exists() else None
        assert len(list(tasks.iterdir())) >= 2 and nices() == {0} and (group is None or group() == 0)
        assert stack.nice_vllm(cfg) == [proc.pid] and nices() == {10}, "every thread, the one made first included"
        assert group is None or group() == 10, "and the session's autogroup"
        assert stack.nice_vllm(cfg) == [], "already there: nothing to do"
        assert stack.nice_vllm(stack.replace_config(cfg, vllm_nice=5)) == [] and nices() == {10}, "never lowered"
        assert stack.nice_vllm(stack.replace_config(cfg, vllm_nice=12)) == [proc.pid] and nices() == {12}
        assert group is None or group() == 12
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(ConfigError, match="vllm_nice"):
        _cfg(tmp_path, vllm_nice=20)
