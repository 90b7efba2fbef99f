"""The stack's config with several vLLM servers: their ports, URLs, CPU binding and pid files (no process started)."""

from __future__ import annotations

import json
import re
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
    three = _cfg(tmp_path, vllm_servers=3)
    assert [stack._vllm_env(three, i)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(3)] == ["0", "1", "0"]
    assert "VLLM_CPU_OMP_THREADS_BIND" not in stack._vllm_env(_cfg(tmp_path), 0), "one server keeps vLLM's own binding"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "all")
    assert {stack._vllm_env(three, i)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(3)} == {"all"}


def test_the_vllm_part_names_every_server_and_any_an_earlier_up_left(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, vllm_servers=2)
    run_dir = tmp_path / "var" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "vllm-3.pid.json").write_text(json.dumps({"pid": 1, "marker": "x"}))
    (run_dir / "vllm-weights.lock").write_text("")
    assert stack._processes(cfg, "vllm") == ["vllm", "vllm-1", "vllm-3"]
    assert stack._processes(cfg, "kafka") == ["kafka"]
