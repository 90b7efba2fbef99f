"""The `flywheel` command's own surface: --version, `flywheel report` from a run folder, `flywheel status` without rich."""

from __future__ import annotations

import dataclasses
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from flywheel import __version__, cli, status
from flywheel.base.config import write_resolved
from flywheel.demo import report
from flywheel.demo.plan import DemoConfig

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())


def test_version_prints_the_packages_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"flywheel {__version__}"
    assert __version__ == PYPROJECT["project"]["version"], "flywheel.__version__ is not pyproject's version"


def test_report_rewrites_a_run_from_its_folder_with_the_inputs_the_demo_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "var" / "demo" / "demo-x"
    run_dir.mkdir(parents=True)
    cfg = DemoConfig(var_dir=tmp_path / "var", control_share=0.15, challenger_share=0.35,
                     gate=dataclasses.replace(DemoConfig().gate, alpha=0.01),
                     gate_interval_s=7.0, minutes=3.0, measure_s=60.0, warm_start=False)
    write_resolved(cfg, run_dir / "demo.toml")
    (run_dir / "final_window.json").write_text(json.dumps({"since": 1234.5}))
    seen: dict[str, Any] = {}

    def fake_write_report(out_dir: Path, lake_root: str, since: float, learner_run_dir: str, policies_dir: str,
                          tracking_uri: str, registered_model: str, **kw: Any) -> dict[str, Any]:
        seen.update(out=Path(out_dir), lake=lake_root, since=since, learner=learner_run_dir, policies=policies_dir,
                    uri=tracking_uri, model=registered_model, **kw)
        return {"ok": True}

    monkeypatch.setattr(report, "write_report", fake_write_report)
    assert cli.main(["report", "--run-dir", str(run_dir), "--mlflow-tracking-uri", "sqlite:///x.db"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"ok": True}
    assert (seen["out"], seen["lake"], seen["learner"], seen["policies"]) == \
        (run_dir / "report", str(run_dir / "lake"), str(run_dir / "learner"), str(run_dir / "policies")), seen
    assert (seen["uri"], seen["model"], seen["final_since"]) == ("sqlite:///x.db", "flywheel-demo-x", 1234.5), seen
    assert seen["shares"] == {"control": 0.15, "challenger": 0.35} and seen["gate_interval_s"] == 7.0, seen
    assert seen["gate_rule"].alpha == 0.01 and seen["context"]["minutes"] == 3.0, seen


def test_report_of_a_folder_that_is_no_run_exits_with_a_clear_error(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["report", "--run-dir", str(tmp_path)])
    assert exited.value.code == 2
    assert "demo.toml" in capsys.readouterr().err


def test_status_prints_plain_tables_without_rich(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from flywheel import stack

    monkeypatch.setitem(sys.modules, "rich", None)  # an import of rich (or rich.x) now raises ImportError
    monkeypatch.setitem(sys.modules, "rich.console", None)
    monkeypatch.setattr(stack, "health", lambda cfg: {"kafka": (True, "pid 7"), "mlflow": (False, "-"), "vllm": (False, "-")})
    monkeypatch.setattr(status, "read_statuses", lambda: {"proxy": {"name": "proxy", "updated": 0, "stale": True, "pid": 3,
                                                                    "requests": 12}})
    assert status.main([]) == 0
    out = capsys.readouterr().out
    assert "kafka" in out and "healthy" in out and "pid 7" in out, out
    assert "proxy" in out and "stale" in out and "requests=12" in out, out
