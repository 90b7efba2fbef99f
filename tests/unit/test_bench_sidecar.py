"""`flywheel bench sidecar --baseline REF` without the stack: the export of another SDK version, the import
that reaches it, the order of the rounds, and the ratio with its bootstrap interval."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from bench import sidecar


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(sidecar.REPO), *args], check=True, capture_output=True,
                          text=True).stdout


@pytest.mark.skipif(not (sidecar.REPO / ".git").exists(), reason="needs a git checkout (--baseline exports a git ref)")
def test_a_git_ref_is_exported_as_its_package_and_a_worker_imports_it_not_the_install(tmp_path: Path) -> None:
    root, commit = sidecar.export_sdk("HEAD", tmp_path / "ref")
    assert commit == _git("rev-parse", "HEAD").strip()
    exported = root / "flywheel" / "ingest" / "sdk.py"
    assert exported.read_text() == _git("show", "HEAD:ingest/sdk.py"), "the export is not the ref's ingest/sdk.py"
    assert (root / "flywheel" / "base" / "__init__.py").is_file(), "flywheel.base (infra/base) is missing"
    found = subprocess.run([sys.executable, "-c", "import flywheel.ingest.sdk as m; print(m.__file__)"],
                           env=sidecar.worker_env(root), cwd=tmp_path, capture_output=True, text=True)
    assert found.returncode == 0, found.stderr[-2000:]
    assert Path(found.stdout.strip()) == exported, f"the worker imported {found.stdout.strip()}, not {exported}"


def test_a_source_directory_is_exported_as_it_is_on_disk(tmp_path: Path) -> None:
    root, resolved = sidecar.export_sdk(str(sidecar.REPO), tmp_path / "tree")
    assert resolved == str(sidecar.REPO)
    on_disk = (sidecar.REPO / "ingest" / "sdk.py").read_text()  # uncommitted edits included
    assert (root / "flywheel" / "ingest" / "sdk.py").read_text() == on_disk
    assert not list(root.rglob("__pycache__")), "bytecode of the source tree was copied"


@pytest.mark.parametrize("arms", [["baseline", "current"], ["baseline", "current", "packed"]])
def test_rounds_alternate_so_each_arm_runs_in_each_position_equally_often(arms: list[str]) -> None:
    rounds = 6 * len(arms)
    orders = sidecar.round_orders(arms, rounds)
    assert len(orders) == rounds and all(sorted(o) == sorted(arms) for o in orders)
    for position in range(len(arms)):
        counts = {arm: sum(o[position] == arm for o in orders) for arm in arms}
        assert set(counts.values()) == {rounds // len(arms)}, f"position {position}: {counts}"
    assert orders[0] != orders[1], "consecutive rounds must not repeat the same order"


def _rounds(seed: int, scale: float, rounds: int = 12, calls: int = 2000) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for r in range(rounds):
        load = 1.0 + 0.5 * (r % 3)  # rounds differ by machine load, the same for both arms of a round
        out.append([int(scale * load * rng.lognormvariate(9.5, 0.6)) for _ in range(calls)])
    return out


def test_the_ratio_of_two_samples_of_one_distribution_has_an_interval_around_one() -> None:
    point, lo, hi = sidecar.ratio_interval(_rounds(1, 1.0), _rounds(2, 1.0), 0.99, reps=300)
    assert lo <= 1.0 <= hi, f"ratio {point:.3f} [{lo:.3f}, {hi:.3f}] should contain 1: nothing differs"
    assert hi - lo < 0.3, f"interval [{lo:.3f}, {hi:.3f}] too wide to tell anything"


def test_a_30_percent_slower_arm_is_found_slower_with_its_ratio_in_the_interval() -> None:
    point, lo, hi = sidecar.ratio_interval(_rounds(1, 1.0), _rounds(2, 1.3), 0.99, reps=300)
    assert lo > 1.0, f"ratio {point:.3f} [{lo:.3f}, {hi:.3f}] should exclude 1: the second arm is 1.3x slower"
    assert lo <= 1.3 <= hi, f"[{lo:.3f}, {hi:.3f}] should contain the true 1.3"


def test_the_summary_keeps_baseline_fields_and_says_when_the_packed_arm_did_not_run() -> None:
    samples = {arm: {"paced": _rounds(seed, 1.0, rounds=4, calls=500),
                     "burst": _rounds(seed + 10, 1.0, rounds=4, calls=200)}
               for seed, arm in enumerate(["baseline", "current"])}
    result = {"ref": "d35a1ee", "resolved": "d" * 40, "arms": ["baseline", "current"], "samples": samples,
              "notes": {"packed": "__init__() got an unexpected keyword argument 'wire_format'"}}
    fields, rows = sidecar.summarize_interleaved(result, 4)
    for key in ("baseline_ref", "baseline_p99_us", "p99_ratio_vs_baseline", "p99_ratio_ci95", "current_p99_us",
                "burst_p99_ratio_vs_baseline", "p99_no_worse_than_baseline"):
        assert key in fields, f"{key} missing from {sorted(fields)}"
    assert fields["baseline_ref"] == "d35a1ee"
    expected = fields["current_p99_us"] / fields["baseline_p99_us"]
    assert fields["p99_ratio_vs_baseline"] == pytest.approx(expected, abs=2e-3)
    assert fields["packed_vs_json_p99_ratio"] is None and "wire_format" in fields["packed_note"]
    assert len(rows) == 3, rows  # two SDKs and their ratio

    # a candidate with the wire_format switch: its default (packed here) is "current", json runs beside it
    samples["packed"] = samples["current"]
    samples["json"] = {"paced": [[2 * x for x in r] for r in samples["current"]["paced"]],
                       "burst": samples["current"]["burst"]}
    result["arms"] = ["baseline", "current", "json"]
    fields, rows = sidecar.summarize_interleaved(result, 4)
    assert fields["packed_vs_json_p99_ratio"] == 0.5 and "packed_note" not in fields, fields
    assert fields["json_p99_ratio_vs_baseline"] == pytest.approx(2 * fields["p99_ratio_vs_baseline"], abs=2e-3)
    assert len(rows) == 6, rows  # three arms, candidate / baseline, packed / json, json / baseline


def test_background_cpu_is_compared_per_call_with_an_interval() -> None:
    base = [{"host": 8.0, "sdk": 100.0 + r % 3, "kafka": 20.0} for r in range(10)]
    cur = [{"host": 8.0, "sdk": 130.0 + r % 3, "kafka": 26.0} for r in range(10)]
    samples = {arm: {"paced": _rounds(1, 1.0, rounds=10, calls=300), "burst": _rounds(2, 1.0, rounds=10, calls=100)}
               for arm in ("baseline", "current")}
    result = {"ref": "x", "resolved": "x", "arms": ["baseline", "current"], "samples": samples, "notes": {},
              "cpu": {"baseline": base, "current": cur}}
    fields, _ = sidecar.summarize_interleaved(result, 10)
    assert fields["baseline_background_cpu_us_per_call"] == 120.9 and fields["current_host_cpu_us_per_call"] == 8.0
    lo, hi = fields["background_cpu_ratio_ci95"]
    assert lo <= fields["background_cpu_ratio_vs_baseline"] <= hi and lo > 1.2, fields
