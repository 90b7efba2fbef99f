"""`flywheel bench ingest --vs quixstreams` without the stack: its flags, the kill schedule both sides share, the
JSON line it builds from the rounds, and the decoder folder the Quix process imports (standard library only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import ingest_peer


def test_flags_and_destinations() -> None:
    args = ingest_peer.parse_args(["--vs", "quixstreams", "--lakes", "s3, local", "--events", "500"])
    assert args.lakes == ["s3", "local"] and args.events == 500 and args.rounds == 3
    assert args.sides == ["writer", "writer_rdkafka", "quix"], "both writer clients by default, then the peer"
    with pytest.raises(SystemExit):
        ingest_peer.parse_args(["--vs", "quixstreams", "--writer-clients", "aiokafka"])
    with pytest.raises(SystemExit):
        ingest_peer.parse_args(["--vs", "quixstreams", "--lakes", "gcs"])
    with pytest.raises(SystemExit):  # --vs names the peer: a bare run is bench/ingest.py's, not this module's
        ingest_peer.parse_args([])


def test_the_ingest_bench_hands_vs_to_the_peer_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import ingest

    seen: list[list[str]] = []
    monkeypatch.setattr(ingest_peer, "main", lambda argv: seen.append(argv) or 0)
    assert ingest.main(["--vs", "quixstreams", "--rounds", "1"]) == 0
    assert seen == [["--vs", "quixstreams", "--rounds", "1"]]


@pytest.mark.parametrize("seconds,kills", [(30.0, 3), (10.0, 1), (60.0, 5), (12.0, 2)])
def test_the_kill_schedule_is_seeded_spread_and_inside_the_run(seconds: float, kills: int) -> None:
    schedule = ingest_peer.kill_schedule(seconds, kills)
    assert schedule == ingest_peer.kill_schedule(seconds, kills), "both sides must get the same moments"
    assert len(schedule) == kills and schedule == sorted(schedule)
    assert all(0 < t < seconds for t in schedule), schedule
    gaps = [b - a for a, b in zip([0.0, *schedule], schedule)]
    assert min(gaps) >= min(4.0, seconds / kills / 2) - 1e-9, f"an incarnation got no time to work: {schedule}"
    assert ingest_peer.kill_schedule(seconds, 0) == []


def _round(cpu: float, wall: float = 2.0) -> dict[str, float]:
    return {"cpu_s": cpu, "wall_s": wall, "files": 4, "bytes": 30_000_000}


def test_summary_pools_rounds_and_reports_the_ratio_per_destination_and_format() -> None:
    args = ingest_peer.parse_args(["--vs", "quixstreams", "--events", "1000", "--rounds", "2", "--lakes", "local",
                                   "--writer-clients", "kafka-python"])
    assert args.sides == ["writer", "quix"]
    rounds = {"writer": {"v3": [_round(2.0), _round(2.0)], "v1": [_round(4.0), _round(4.0)]},
              "quix": {"v3": [_round(3.0, 6.0), _round(1.0, 6.0)], "v1": [_round(2.0), _round(2.0)]}}
    kills = {side: {"lost": 0, "duplicated": d, "unreadable_files": 0, "kills": 3, "events": 900, "caught_up_s": 5.0}
             for side, d in (("writer", 0), ("quix", 7))}
    res = {"local": {"rounds": rounds, "live": {"writer": [0.5, 1.0, 1.5], "quix": [4.0, 5.0, float("inf")]},
                     "kills": kills, "schedule": [1.0, 2.0, 3.0]}}
    r = ingest_peer.summarize(args, res)
    assert r["writer_local_cpu_s_per_10k"] == 20.0 and r["quix_local_cpu_s_per_10k"] == 20.0
    assert r["writer_vs_quix_local"] == 1.0, "pooled: (3 + 1) / (2 + 2) CPU s"
    assert r["writer_vs_quix_local_rounds"] == [1.5, 0.5]
    assert r["writer_vs_quix_local_json"] == 0.5 and r["quix_local_events_per_s"] == round(2000 / 12, 1)
    assert r["writer_local_bytes_per_event"] == 30_000.0
    assert r["quix_local_p95_visible_s"] == float("inf"), "an event never seen must show, not vanish"
    assert (r["quix_local_duplicated_after_kills"], r["writer_local_lost_after_kills"]) == (7, 0)
    assert r["quixstreams_version"] == "3.28.1" and r["quix_packed_as"] == "numpy"


def test_the_quix_process_imports_the_records_decoder_with_the_standard_library_alone(tmp_path: Path) -> None:
    shim = ingest_peer.wire_shim(tmp_path)
    code = ("import sys; from flywheel.ingest import wire, schema; "
            "r = wire.decode(wire.encode({'schema_version': 3, 'prompt_token_ids': [1, 2]}, 'packed')); "
            "print(type(r['prompt_token_ids']).__name__, list(r['prompt_token_ids']), "
            "sorted(m for m in sys.modules if m.split('.')[0] not in sys.stdlib_module_names and m != '__main__'))")
    # -S: no site-packages at all, so a third-party import in wire or schema fails here
    out = subprocess.run([sys.executable, "-S", "-c", code], env={"PYTHONPATH": str(shim)}, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(" ", 1)[0] == "memoryview" and "[1, 2]" in out.stdout
    assert "['flywheel', 'flywheel.ingest', 'flywheel.ingest.schema', 'flywheel.ingest.wire']" in out.stdout, out.stdout
