"""The base layer's one-of-each mechanisms: atomic writes, the stop signal, version names."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from flywheel.base import atomic
from flywheel.base.atomic import Durability
from flywheel.base.stop import stop_on_signals
from flywheel.base.versions import parse_version, version_name


@pytest.mark.parametrize("durability", list(Durability))
def test_an_atomic_write_replaces_the_whole_file_and_leaves_no_temp(tmp_path: Path, durability: Durability) -> None:
    target = tmp_path / "sub" / "cursor.json"
    atomic.write_json(target, {"a": 1}, durability)
    atomic.write_json(target, {"a": 2, "b": [1, 2]}, durability, sort_keys=True)
    assert target.read_text() == '{"a": 2, "b": [1, 2]}'
    assert [p.name for p in target.parent.iterdir()] == ["cursor.json"], "a temp file was left behind"


def test_a_failed_write_keeps_the_old_content_and_removes_its_temp(tmp_path: Path) -> None:
    target = tmp_path / "state.txt"
    atomic.write_text(target, "old", Durability.DURABLE)

    def half_then_fail(tmp: Path) -> None:
        tmp.write_text("half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic.write_with(target, half_then_fail, Durability.DURABLE)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.txt"]


def test_a_directory_is_published_whole_under_its_final_name(tmp_path: Path) -> None:
    final = tmp_path / "policy-v3"
    tmp = atomic.temp_path(final)
    tmp.mkdir()
    (tmp / "policy.json").write_text("{}")
    (tmp / "model.safetensors").write_bytes(b"\0" * 16)
    assert tmp.name.startswith(".") and tmp.name.endswith(".tmp"), "readers skip hidden temp names"
    atomic.publish(tmp, final, Durability.DURABLE_DIR)
    assert sorted(p.name for p in final.iterdir()) == ["model.safetensors", "policy.json"]
    assert not tmp.exists()


def test_sigterm_sets_the_stop_event_instead_of_killing_the_process() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    try:
        stop = stop_on_signals("testing", signals=(signal.SIGTERM,))
        assert not stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(2.0), "SIGTERM did not set the event"
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_off_the_main_thread_only_the_event_is_returned() -> None:
    got: list[threading.Event] = []
    before = signal.getsignal(signal.SIGTERM)
    worker = threading.Thread(target=lambda: got.append(stop_on_signals("testing")))
    worker.start()
    worker.join()
    assert isinstance(got[0], threading.Event) and signal.getsignal(signal.SIGTERM) is before


def test_version_names_round_trip_and_other_names_are_not_versions() -> None:
    assert version_name(0) == "policy-v0" and version_name(12) == "policy-v12"
    assert all(parse_version(version_name(v)) == v for v in (0, 1, 7, 123))
    for other in ("policy-v", "policy-v3x", "xpolicy-v3", "tiny-base", "policy-v-1", ".policy-v3.ab12.tmp"):
        assert parse_version(other) is None, other
