"""Judge calibration on hand-built data: AUC and correlation, and `calibrate` over a small lake."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa
import pytest

from flywheel.cli import main as cli_main
from flywheel.ingest import lake
from flywheel.rewards import calibrate

T0 = dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone.utc)


def test_auc_on_hand_built_data() -> None:
    assert calibrate.auc([1, 2, 4, 5], [False, False, True, True]) == 1.0
    assert calibrate.auc([5, 4, 2, 1], [False, False, True, True]) == 0.0
    assert calibrate.auc([3, 3, 3, 3], [False, True, False, True]) == 0.5, "ties count half"
    # positives 4, 2; negatives 3, 1: pairs (4>3, 4>1, 2<3, 2>1) = 3 of 4
    assert calibrate.auc([4, 2, 3, 1], [True, True, False, False]) == 0.75
    # a tie across classes: positives 3, 5; negatives 3, 1: (3=3: 0.5, 3>1, 5>3, 5>1) = 3.5 of 4
    assert calibrate.auc([3, 5, 3, 1], [True, True, False, False]) == pytest.approx(0.875)
    assert calibrate.auc([1, 2], [True, True]) is None, "no AUC without both classes"


def test_pearson_on_hand_built_data() -> None:
    assert calibrate.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert calibrate.pearson([1, 2, 3], [1, 0, -1]) == pytest.approx(-1.0)
    assert calibrate.pearson([1, 2, 3, 4], [1, 0, 0, 1]) == pytest.approx(0.0)
    assert calibrate.pearson([1, 1], [0, 1]) is None and calibrate.pearson([1], [1]) is None


def _lake(root: str) -> None:
    """Sessions a..f of two task types and two judge versions, each with two llm_call rows; g judged, not verified;
    h verified, not judged; a's label 2 changed its score (the newest label counts)."""
    judged = {"a": ("tool_use.add", 5, "m/tool_use@1"), "b": ("tool_use.add", 4, "m/tool_use@1"),
              "c": ("tool_use.add", 2, "m/tool_use@1"), "d": ("tool_use.mul", 1, "m/tool_use@2"),
              "e": ("tool_use.mul", 4, "m/tool_use@2"), "f": ("tool_use.mul", 3, "m/tool_use@2"),
              "g": ("tool_use.add", 5, "m/tool_use@1")}
    rows = []
    for sid, (task_type, score, version) in judged.items():
        for label, s in ((1, 1 if sid == "a" else score), *(((2, score),) if sid == "a" else ())):
            detail = json.dumps({"judge": {"status": "ok", "score": s, "version": version, "shadow": True}})
            rows += [{"session_id": sid, "label_version": label, "task_type": task_type, "judge_score": s,
                      "reward_detail": detail}] * 2
    rows.append({"session_id": "h", "label_version": 1, "task_type": "tool_use.add", "judge_score": None,
                 "reward_detail": json.dumps({"judge": None})})
    lake.write_file(root, "episodes", "2026-01-01", "episodes", 0, 0, len(rows) - 1, pa.Table.from_pylist(rows))
    truth = {"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.0, "e": 1.0, "f": 0.0, "h": 1.0}
    outcomes = [{"session_id": sid, "agent_id": None, "call_id": None, "kind": "task_success", "value": v,
                 "ts": T0 + dt.timedelta(seconds=i)} for i, (sid, v) in enumerate(truth.items())]
    # noise the calibration must ignore: another kind, a per-agent and a per-call outcome, and an older value of c
    outcomes += [{"session_id": "c", "agent_id": None, "call_id": None, "kind": "accepted", "value": 1.0, "ts": T0},
                 {"session_id": "c", "agent_id": "kid", "call_id": None, "kind": "task_success", "value": 1.0, "ts": T0},
                 {"session_id": "c", "agent_id": None, "call_id": "k1", "kind": "task_success", "value": 1.0, "ts": T0},
                 {"session_id": "c", "agent_id": None, "call_id": None, "kind": "task_success", "value": 1.0,
                  "ts": T0 - dt.timedelta(hours=1)}]
    lake.write_file(root, "outcomes", "2026-01-01", "outcomes", 0, 0, len(outcomes) - 1, pa.Table.from_pylist(outcomes))


def test_calibrate_over_a_lake_per_task_type_and_judge_version(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = str(tmp_path / "lake")
    _lake(root)
    result = calibrate.calibrate(root)
    assert (result["judge_scored"], result["judge_n"]) == (7, 6), result
    add, mul = result["judge_by_task_type"]["tool_use.add"], result["judge_by_task_type"]["tool_use.mul"]
    assert (add["n"], add["n_success"], add["auc"]) == (3, 2, 1.0), add  # a 5 (label 2) and b 4 succeeded, c 2 failed
    assert (mul["n"], mul["n_success"], mul["auc"]) == (3, 1, 1.0), mul  # e 4 succeeded; d 1, f 3 failed
    assert set(result["judge_by_version"]) == {"m/tool_use@1", "m/tool_use@2"}
    assert result["judge_by_version"]["m/tool_use@1"]["n"] == 3
    # all six: successes 5, 4, 4 against failures 2, 1, 3: every pair ordered
    assert result["judge_auc"] == 1.0 and 0.7 < result["judge_corr"] <= 1.0, result
    out = tmp_path / "calib.json"
    assert cli_main(["judge", "calibrate", "--lake-root", root, "--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().split("\n")
    assert json.loads(printed[-1]) == result == json.loads(out.read_text())
    assert any(line.startswith("task type tool_use.add") for line in printed), printed


def test_calibrate_of_a_lake_without_judge_scores_says_so(tmp_path: Path) -> None:
    result = calibrate.calibrate(str(tmp_path / "empty"))
    assert (result["judge_scored"], result["judge_n"], result["judge_auc"]) == (0, 0, None), result


def test_the_reports_judge_section_says_a_tiny_model_is_a_poor_judge(tmp_path: Path) -> None:
    from flywheel.demo import report

    root = str(tmp_path / "lake")
    _lake(root)
    lines = "\n".join(report.judge_section(calibrate.calibrate(root)))
    assert "poor judge" in lines and "shadow" in lines and "n = 6" in lines, lines
    assert "| task type tool_use.add | 3 | 2 | 1.000 |" in lines, lines
    one_class = calibrate.calibrate(root, threshold=2.0)  # no outcome reaches 2.0: no success, no AUC
    assert "n/a: every verified session had the same outcome" in "\n".join(report.judge_section(one_class))
    assert "No session carries a judge score" in "\n".join(report.judge_section(calibrate.calibrate(str(tmp_path / "x"))))
