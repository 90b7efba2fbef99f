"""Judge calibration: does the LLM judge agree with the verified outcomes? Over any lake.

    flywheel judge calibrate --lake-root var/lake                 # a table, then one JSON line
    flywheel judge calibrate --lake-root s3://bucket/lake --outcome-kind tests_passed --out calib.json

Wherever a session has both a judge score (episodes.judge_score: shadow mode included) and a
verified session-level outcome of `outcome_kind` (one without agent_id or call_id; the newest by
ts), it counts one pair. Per task type and per judge version (`<model>/<rubric>@<version>`, from
reward_detail) it reports the pairs, the AUC of the score for outcome >= threshold (the chance a
random verified success scores above a random failure, ties half: 0.5 is no better than a coin)
and the Pearson correlation of score and outcome value. Read it before giving a judge weight: a
judge whose AUC's sample is small, or near 0.5, only adds noise to the advantage.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

from flywheel.base.config import load_config, setting, setup_logging
from flywheel.ingest import lake

log = logging.getLogger(__name__)


@dataclass
class CalibrateConfig:
    """flywheel judge calibrate: the judge's agreement with verified outcomes over a lake."""

    lake_root: str = setting("var/lake", "lake root (path or pyarrow filesystem URI)")
    outcome_kind: str = setting("task_success", "the verified outcome kind the judge is compared with")
    threshold: float = setting(0.5, "an outcome value at or above this is a success (for the AUC)")
    out: str = setting("", "also write the result as JSON to this file")
    log_level: str = setting("WARNING", "logging level")


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """Mann-Whitney AUC of `scores` for `labels` (ties count half); None when either class is empty."""
    pos = sum(1 for y in labels if y)
    neg = len(labels) - pos
    if not pos or not neg:
        return None
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1  # the tie group's average rank, 1-based
        i = j + 1
    rank_sum = sum(r for r, y in zip(ranks, labels) if y)
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)


def pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Pearson correlation; None with fewer than 2 pairs or a constant side."""
    n = len(x)
    if n < 2:
        return None
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return None if sxx == 0 or syy == 0 else sxy / math.sqrt(sxx * syy)


def agreement(pairs: list[tuple[int, float]], threshold: float) -> dict[str, Any]:
    """n, positives, AUC and correlation of (judge score, outcome value) pairs."""
    scores, values = [float(s) for s, _ in pairs], [v for _, v in pairs]
    labels = [v >= threshold for v in values]
    a, r = auc(scores, labels), pearson(scores, values)
    return {"n": len(pairs), "n_success": sum(labels), "auc": None if a is None else round(a, 4),
            "corr": None if r is None else round(r, 4),
            "mean_score": round(sum(scores) / len(scores), 3) if scores else None}


def _read(root: str, table: str, columns: list[str]) -> list[dict[str, Any]]:
    """The rows of every file of the table (lake.read_file: an unreadable file stops the calibration, named)."""
    rows: list[dict[str, Any]] = []
    for f in lake.list_files(root, table):
        part = lake.read_file(root, f, columns)
        if "judge_score" in columns and "judge_score" not in part.column_names:
            continue  # written before the judge_score column: nothing judged there
        rows += part.to_pylist()
    return rows


def judged_sessions(root: str) -> dict[str, dict[str, Any]]:
    """session -> {task_type, version, score} of its newest label that carries a judge score."""
    best: dict[str, tuple[int, dict[str, Any]]] = {}
    for r in _read(root, "episodes", ["session_id", "label_version", "task_type", "judge_score", "reward_detail"]):
        if r.get("judge_score") is None:
            continue
        if r["session_id"] in best and best[r["session_id"]][0] >= r["label_version"]:
            continue
        judge = (json.loads(r["reward_detail"] or "{}").get("judge") or {})
        best[r["session_id"]] = (r["label_version"], {"task_type": r["task_type"], "score": int(r["judge_score"]),
                                                      "version": judge.get("version") or "unknown"})
    return {sid: v for sid, (_, v) in best.items()}


def verified(root: str, kind: str) -> dict[str, float]:
    """session -> the value of its newest session-level outcome of `kind`."""
    newest: dict[str, tuple[Any, float]] = {}
    for o in _read(root, "outcomes", ["session_id", "agent_id", "call_id", "kind", "value", "ts"]):
        if o["kind"] != kind or o.get("agent_id") or o.get("call_id"):
            continue
        if o["session_id"] not in newest or o["ts"] > newest[o["session_id"]][0]:
            newest[o["session_id"]] = (o["ts"], float(o["value"]))
    return {sid: v for sid, (_, v) in newest.items()}


def calibrate(root: str, kind: str = "task_success", threshold: float = 0.5) -> dict[str, Any]:
    """The judge's agreement with `kind` over a lake: overall, per task type and per judge version."""
    judged, truth = judged_sessions(root), verified(root, kind)
    pairs = [(j, truth[sid]) for sid, j in judged.items() if sid in truth]
    by_type: dict[str, list[tuple[int, float]]] = defaultdict(list)
    by_version: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for j, value in pairs:
        by_type[j["task_type"]].append((j["score"], value))
        by_version[j["version"]].append((j["score"], value))
    overall = agreement([(j["score"], v) for j, v in pairs], threshold)
    return {"judge_scored": len(judged), "judge_n": overall["n"], "judge_auc": overall["auc"],
            "judge_corr": overall["corr"], "judge_outcome_kind": kind,
            "judge_by_task_type": {t: agreement(p, threshold) for t, p in sorted(by_type.items())},
            "judge_by_version": {v: agreement(p, threshold) for v, p in sorted(by_version.items())}}


def table(result: dict[str, Any]) -> str:
    """The result as a plain table: one line per task type and per judge version."""
    lines = [f"judge calibration against {result['judge_outcome_kind']}: {result['judge_scored']} sessions scored, "
             f"{result['judge_n']} with a verified outcome",
             f"{'group':<48} {'n':>6} {'success':>8} {'AUC':>7} {'corr':>7}"]
    for title, groups in (("task type", result["judge_by_task_type"]), ("judge", result["judge_by_version"])):
        for name, g in groups.items():
            lines.append(f"{(title + ' ' + name)[:48]:<48} {g['n']:>6} {g['n_success']:>8} {_fmt(g['auc']):>7} "
                         f"{_fmt(g['corr']):>7}")
    lines.append(f"{'all':<48} {result['judge_n']:>6} {'':>8} {_fmt(result['judge_auc']):>7} "
                 f"{_fmt(result['judge_corr']):>7}")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    args = list(argv or [])
    if not args or args[0] != "calibrate":
        print("usage: flywheel judge calibrate [--lake-root ROOT] [--outcome-kind KIND] [--threshold X] [--out FILE]")
        return 0 if args and args[0] in ("-h", "--help") else 2
    cfg = load_config(CalibrateConfig, args[1:], "flywheel judge calibrate")
    setup_logging(cfg.log_level)
    try:
        result = calibrate(cfg.lake_root, cfg.outcome_kind, cfg.threshold)
    except lake.LakeReadError as exc:
        log.error("%s", exc)
        return 1
    print(table(result))
    if cfg.out:
        from pathlib import Path

        Path(cfg.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, sort_keys=True))
    return 0
