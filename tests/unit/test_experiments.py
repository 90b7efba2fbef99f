"""The evidence of the demo runs: run files, and docs/experiments.md's table generated from every one of them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flywheel.demo import experiments
from flywheel.demo.plan import DemoConfig

T0 = 1_800_000_000.0  # 2027-01-15 UTC


def _summary(**fields: object) -> dict:
    base = {"control_final_success": 0.1, "n_control_final": 300, "champion_final_success": 0.25,
            "n_champion_final": 900, "lift_points": 15.0, "lift_ci95": [10.0, 19.5], "p_value_final": 1e-6,
            "minutes": 20.0, "total_s": 1500.0, "champion_version": 4, "malformed_share_champion_final": 0.031,
            "n_calls_champion_final": 1200, "malformed_share_control_final": 0.05, "n_calls_control_final": 400,
            "report_written": "2027-01-15T08:30:00Z"}
    return base | fields


def test_the_committed_table_lists_every_run_file() -> None:
    runs = experiments.read_runs(experiments.RUNS_DIR)
    assert runs, "docs/runs holds no run file"
    assert experiments.is_current(), ("docs/experiments.md's run table is out of date with docs/runs "
                                      f"({len(runs)} files): run `flywheel experiments`")


def test_a_run_file_holds_the_summary_the_settings_and_the_warm_starts_loss_curve(tmp_path: Path) -> None:
    warm = {"steps": 50, "final_success": 0.3, "seconds": 60.0,
            "history": [{"step": 25, "heldout_loss": 0.512345678, "success": 0.1}, {"step": 50, "heldout_loss": 0.4}]}
    path = experiments.record_run(_summary(), DemoConfig(minutes=7.0), warm, T0, runs_dir=tmp_path / "runs",
                                  repo_root=tmp_path)  # not a git checkout: the commit is unknown
    assert path.name == "2027-01-15-unknown.json"
    data = json.loads(path.read_text())
    assert data["summary"]["lift_points"] == 15.0 and data["demo_config"]["minutes"] == 7.0, data
    assert data["warm_start"] == {"steps": 50, "final_success": 0.3, "seconds": 60.0,
                                  "heldout_loss_curve": [[25, 0.51235], [50, 0.4]]}, data["warm_start"]
    assert (data["commit"], data["dirty"], data["date"]) == ("unknown", None, "2027-01-15")
    again = experiments.record_run(_summary(), DemoConfig(), warm, T0, runs_dir=tmp_path / "runs", repo_root=tmp_path)
    third = experiments.record_run(_summary(), DemoConfig(), warm, T0, runs_dir=tmp_path / "runs", repo_root=tmp_path)
    assert (again.name, third.name) == ("2027-01-15-unknown-2.json", "2027-01-15-unknown-3.json")


def test_the_generator_adds_a_new_run_and_check_fails_until_it_ran(tmp_path: Path) -> None:
    doc, runs = tmp_path / "experiments.md", tmp_path / "runs"
    shutil.copy(experiments.DOC, doc)
    shutil.copytree(experiments.RUNS_DIR, runs)
    before = doc.read_text()
    assert experiments.main(["--check", "--doc", str(doc), "--runs", str(runs)]) == 0
    bad = _summary(champion_final_success=0.08, lift_points=-2.0, lift_ci95=[-6.0, 2.1], p_value_final=0.81,
                   champion_version=0)
    (runs / "2027-01-15-abc1234.json").write_text(json.dumps(
        experiments.run_record(bad, DemoConfig(), {}, "abc1234", True, "2027-01-15")))
    assert experiments.main(["--check", "--doc", str(doc), "--runs", str(runs)]) == 1, "a new run file went unnoticed"
    assert doc.read_text() == before, "--check must not write"
    assert experiments.main(["--doc", str(doc), "--runs", str(runs)]) == 0
    assert experiments.is_current(doc, runs)
    after = doc.read_text()
    new_row = ("| 2027-01-15 | abc1234 (dirty) | - | 10.0% (n 300) | 8.0% (n 900) | -2.0 [-6.0, +2.1] | 0.81 | "
               "20 (25.0 in all) | v0 | 3.1% (n 1200) / 5.0% (n 400) |")
    assert new_row in after, after[after.index(experiments.BEGIN):]
    table = after[after.index(experiments.BEGIN):after.index(experiments.END)]
    assert len([line for line in table.splitlines() if line.startswith("| 20")]) == len(list(runs.glob("*.json")))
    # the older, bare-summary files keep their rows, and everything outside the markers is untouched
    assert "| 2026-12-01 | 954b776 | t | 11.1% (n 261) | 20.2% (n 1007) | +9.1 [+4.1, +13.2] |" in table
    outside = before.split(experiments.BEGIN)[0], before.split(experiments.END)[1]
    assert after.split(experiments.BEGIN)[0] == outside[0] and after.split(experiments.END)[1] == outside[1]


def test_a_document_without_the_markers_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="markers"):
        experiments.with_table("# notes\n", "| table |")
