"""The learner's input path over a real (tmp) lake: validation, staleness, relabels, cursor."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from bench.fixtures.episodes import episode_row, random_rows, write_episodes
from flywheel.ingest import lake
from flywheel.learner.checkpoint import TrainerState
from flywheel.learner.data import EpisodeStream, parse_row


def _stream(root: Path, **kw: object) -> EpisodeStream:
    return EpisodeStream(str(root), vocab_size=512, max_seq_len=256, **kw)  # type: ignore[arg-type]


def test_corrupt_rows_are_skipped_with_a_reason(tmp_path: Path, caplog) -> None:
    good = random_rows(2, seed=1)
    bad_len = episode_row(prompt=[5, 6], completion=[7, 8, 9], logprobs=[-1.0, -2.0], reward=1.0, episode_id="bad-len")
    bad_nan = episode_row(prompt=[5, 6], completion=[7, 8], logprobs=[-1.0, math.nan], reward=1.0, episode_id="bad-nan")
    bad_vocab = episode_row(prompt=[5, 9999], completion=[7], logprobs=[-1.0], reward=1.0, episode_id="bad-vocab")
    masked = episode_row(prompt=[5], completion=[7], logprobs=[-1.0], reward=1.0, loss_mask=[0], episode_id="masked")
    write_episodes(tmp_path, [good[0], bad_len, bad_nan, bad_vocab, masked, good[1]], seq=0)
    s = _stream(tmp_path)
    with caplog.at_level(logging.WARNING, logger="flywheel.learner.data"):
        assert s.poll() == 2
    assert s.counters["corrupt"] == 4
    text = caplog.text
    assert "bad-len: lengths differ" in text and "bad-nan" in text and "bad-vocab" in text and "masked" in text
    batch, _ = s.take(10, {0: 0}, max_staleness_steps=2)
    assert [e.episode_id for e in batch] == [good[0]["episode_id"], good[1]["episode_id"]]


def test_parse_row_rejects_positive_logprobs_and_nan_reward() -> None:
    row = episode_row(prompt=[5], completion=[7], logprobs=[0.5], reward=1.0)
    assert "positive" in parse_row(row, 512, 64)
    row = episode_row(prompt=[5], completion=[7], logprobs=[-0.5], reward=float("nan"))
    assert "reward" in parse_row(row, 512, 64)


def test_shaping_annealed_to_zero_leaves_exactly_the_unshaped_reward() -> None:
    # reward - r_shaping rounds (0.7 + 0.1 + 0.2 - 0.3 != 0.7 - 0.3 in floats): at scale 0 the shaped row must tie
    # its unshaped twin bit for bit, or positive-only advantages train it on a rounding error
    lambdas = [(0.1, 0.2), (0.15, 0.05), (0.3, 0.3)]
    for r_outcome, r_penalty in [(0.7, -0.3), (1.0, -0.5), (0.1, 0.0), (0.35, -0.25)]:
        plain = episode_row(prompt=[5], completion=[7], logprobs=[-0.5], reward=r_outcome + r_penalty)
        plain.update(r_outcome=r_outcome, r_penalty=r_penalty)
        twin = parse_row(plain, 512, 64)
        for r_parallel, r_finish in lambdas:
            row = dict(plain, r_parallel=r_parallel, r_finish=r_finish,
                       reward=r_outcome + 0.0 + r_parallel + r_finish + r_penalty)
            shaped = parse_row(row, 512, 64)
            assert shaped.trained_reward(0.0) == twin.trained_reward(0.0) == twin.reward, (
                f"outcome {r_outcome} penalty {r_penalty} shaping {r_parallel}+{r_finish}: "
                f"{shaped.trained_reward(0.0)!r} != {twin.reward!r}")
            assert shaped.trained_reward(1.0) == row["reward"]
            assert math.isclose(shaped.trained_reward(0.5), twin.reward + 0.5 * (r_parallel + r_finish))


def test_stale_rows_are_dropped_and_counted_by_learner_steps(tmp_path: Path) -> None:
    rows = random_rows(3, seed=1, policy_version=1) + random_rows(4, seed=2, policy_version=5)
    write_episodes(tmp_path, rows, seq=0)
    s = _stream(tmp_path)
    s.poll()
    lags = TrainerState(step=13, policy_version=5, lineage={1: 0, 5: 12}).lags()  # v1 13 steps back, v5 1 step
    assert s.trainable(lags, max_staleness_steps=8) == 4
    assert s.drop_stale(lags, 8) == 3
    batch, stats = s.take(10, lags, 8)
    assert len(batch) == 4 and stats.lags == {1: 4} and s.counters["stale"] == 3, (stats, s.counters)


def test_a_version_off_the_learners_line_is_stale_and_the_champion_is_fresh(tmp_path: Path) -> None:
    # v2 is the champion the learner rebased onto 4 steps ago and v6 the version it published 3 steps later;
    # v4 is not on its line (abandoned before the rebase, or never this learner's)
    rows = random_rows(2, seed=1, policy_version=2) + random_rows(3, seed=2, policy_version=4)
    rows += random_rows(1, seed=3, policy_version=6)
    write_episodes(tmp_path, rows, seq=0)
    s = _stream(tmp_path)
    s.poll()
    batch, stats = s.take(10, {2: 4, 6: 1}, 4)
    assert sorted(e.policy_version for e in batch) == [2, 2, 6] and stats.stale == 3, stats
    assert stats.lags == {4: 2, 1: 1}, "lags in steps: the version numbers (2 and 6) say nothing of it"


def test_newest_first_trains_the_latest_rows_and_the_backlog_ages_out(tmp_path: Path) -> None:
    old = write_episodes(tmp_path, random_rows(4, seed=1, policy_version=0), seq=0)
    new = write_episodes(tmp_path, random_rows(3, seed=2, policy_version=2), seq=1)
    s = _stream(tmp_path)
    s.poll()
    newest = {p.episode.episode_id for p in s.pending[-3:]}
    batch, stats = s.take(3, {0: 2, 2: 0}, max_staleness_steps=2, newest_first=True)
    assert {e.episode_id for e in batch} == newest and stats.lags == {0: 3}
    s.mark_trained(batch)
    assert s.cursor == {}, "file 0's rows are still pending: the cursor must not pass it"
    assert [p.episode.policy_version for p in s.pending] == [0, 0, 0, 0]
    # the learner moves on: the untrained backlog is now too old and is dropped, counted, and consumed
    assert s.drop_stale({0: 3, 2: 1}, max_staleness_steps=2) == 4 and s.counters["stale"] == 4
    assert old.key == new.key and s.cursor == {new.key: 1}  # both files consumed: the cursor is past the last
    s2 = _stream(tmp_path, cursor=s.cursor, trained=s.trained)
    assert s2.poll() == 0 and not s2.pending  # a restart re-reads nothing


def _opening(row: dict, opens: bool) -> dict:
    return row | {"opens_session": opens}


def test_openings_reserve_takes_session_openings_first_either_way_they_decided(tmp_path: Path) -> None:
    # 8 rows in lake order: openings at places 1, 5 and 7 (one of them stale), the rest later turns
    rows = random_rows(8, seed=4, policy_version=2)
    rows = [_opening(r, i in (1, 5, 7)) for i, r in enumerate(rows)]
    rows[7] = rows[7] | {"policy_version": 0, "model": "policy-v0"}
    write_episodes(tmp_path, rows, seq=0)
    s = _stream(tmp_path)
    s.poll()
    assert [p.episode.opens_session for p in s.pending] == [i in (1, 5, 7) for i in range(8)]
    ids = [r["episode_id"] for r in rows]
    batch, stats = s.take(4, {0: 9, 2: 0}, max_staleness_steps=4, openings=3)
    # the two fresh openings first claim their places; the stale one is not taken, so the in-order rows
    # fill the other two places (rows 0 and 2: row 1 is an opening already in)
    assert sorted(e.episode_id for e in batch) == sorted([ids[1], ids[5], ids[0], ids[2]]), batch
    assert stats.stale == 0 and stats.lags == {0: 4}
    assert [p.episode.episode_id for p in s.pending] == [ids[i] for i in (3, 4, 6, 7)]
    # without a reserve the same lake gives the rows in order: the default is unchanged
    plain = _stream(tmp_path)
    plain.poll()
    batch, _ = plain.take(4, {0: 9, 2: 0}, max_staleness_steps=4)
    assert [e.episode_id for e in batch] == ids[:4]


def test_openings_reserve_never_exceeds_the_batch_and_counts_stale_rows_once(tmp_path: Path) -> None:
    rows = [_opening(r, True) for r in random_rows(5, seed=5, policy_version=2)]
    rows[0] = rows[0] | {"policy_version": 0, "model": "policy-v0"}  # stale
    write_episodes(tmp_path, rows, seq=0)
    s = _stream(tmp_path)
    s.poll()
    batch, stats = s.take(2, {0: 9, 2: 0}, max_staleness_steps=4, openings=10)
    assert [e.episode_id for e in batch] == [rows[1]["episode_id"], rows[2]["episode_id"]]
    assert stats.stale == 0, "a full batch leaves the rest pending, stale or not, as without a reserve"
    batch, stats = s.take(10, {0: 9, 2: 0}, max_staleness_steps=4, openings=10)
    assert len(batch) == 2 and stats.stale == 1 and s.counters["stale"] == 1 and not s.pending


def test_parse_row_reads_opens_session_from_its_column_never_from_the_detail_text() -> None:
    row = random_rows(1, seed=6)[0]
    assert parse_row(_opening(row, True), 512, 256).opens_session is True
    assert parse_row(_opening(row, False), 512, 256).opens_session is False
    assert parse_row(row | {"opens_session": None}, 512, 256).opens_session is False, "a row from before the column"
    detail_only = row | {"opens_session": None, "reward_detail": json.dumps({"opens_session": True})}
    assert parse_row(detail_only, 512, 256).opens_session is False, "reward_detail is for people, not a contract"


def test_cursor_passes_a_file_only_when_all_its_rows_are_consumed(tmp_path: Path) -> None:
    f0 = write_episodes(tmp_path, random_rows(3, seed=1), seq=0)
    write_episodes(tmp_path, random_rows(3, seed=2), seq=1)
    s = _stream(tmp_path)
    s.poll()
    batch, _ = s.take(4, {0: 0}, 2)  # all of file 0, one row of file 1
    s.mark_trained(batch)
    assert s.cursor == {f0.key: 0}, s.cursor
    # a restart from this cursor and trained set re-reads file 1 but never returns a trained row
    again = _stream(tmp_path, cursor=s.cursor, trained=s.trained)
    assert again.poll() == 2
    assert again.counters["duplicate"] == 1
    rest, _ = again.take(10, {0: 0}, 2)
    assert {e.episode_id for e in rest}.isdisjoint(e.episode_id for e in batch)
    again.mark_trained(rest)
    assert again.cursor == {f0.key: 1}


def test_an_unreadable_file_stops_the_stream_before_it_and_a_restart_reads_it_once_restored(tmp_path: Path) -> None:
    rows = random_rows(3, seed=4)
    f0 = write_episodes(tmp_path, random_rows(2, seed=5), seq=0)
    f1 = write_episodes(tmp_path, rows, seq=1)
    good = Path(f1.path).read_bytes()
    Path(f1.path).write_bytes(b"PAR1 not really parquet")
    s = _stream(tmp_path)
    with pytest.raises(lake.LakeReadError, match=f1.path.rsplit("/", 1)[-1]):
        s.poll()
    batch, _ = s.take(10, {0: 0}, 2)
    s.mark_trained(batch)
    assert s.cursor.get(f0.key, -1) < 1, f"the cursor passed the unreadable file: {s.cursor}"
    Path(f1.path).write_bytes(good)  # the operator restores it; the restarted learner trains its rows once
    again = _stream(tmp_path, cursor=s.cursor, trained=s.trained)
    again.poll()
    rest, _ = again.take(10, {0: 0}, 2)
    assert sorted(e.episode_id for e in rest) == sorted(r["episode_id"] for r in rows)


def test_relabel_policy_newest_label_if_pending_never_twice(tmp_path: Path) -> None:
    row = random_rows(1, seed=3)[0]
    write_episodes(tmp_path, [row], seq=0)
    write_episodes(tmp_path, [{**row, "label_version": 2, "reward": 7.0}], seq=1)
    s = _stream(tmp_path)
    s.poll()
    batch, _ = s.take(10, {0: 0}, 2)
    assert len(batch) == 1 and batch[0].reward == 7.0 and batch[0].label_version == 2
    s.mark_trained(batch)
    assert s.cursor == {"synthetic/0": 1}, "the replaced row's file is consumed too"
    write_episodes(tmp_path, [{**row, "label_version": 3, "reward": -1.0}], seq=2)
    assert s.poll() == 0 and s.counters["relabel_after_train"] == 1


def test_empty_or_missing_lake_is_just_empty(tmp_path: Path) -> None:
    s = _stream(tmp_path / "nothing-here")
    assert s.poll() == 0 and s.take(5, {0: 0}, 1)[0] == []


def test_rows_of_abandoned_versions_are_stale_whatever_their_lag(tmp_path: Path) -> None:
    # the gate rejected v3 and v4; the learner went back to the champion v2 and later published v5
    rows = random_rows(2, seed=1, policy_version=2) + random_rows(3, seed=2, policy_version=4)
    rows += random_rows(2, seed=3, policy_version=5)
    write_episodes(tmp_path, rows, seq=0)
    s = _stream(tmp_path, abandoned={3, 4})
    s.poll()
    lags = {2: 3, 4: 1, 5: 0}  # even were v4 still listed on the line
    assert s.trainable(lags, max_staleness_steps=3) == 4, "v4 lags only 1, but the weights no longer descend from it"
    batch, stats = s.take(10, lags, 3)
    assert sorted(e.policy_version for e in batch) == [2, 2, 5, 5] and stats.stale == 3


def test_rows_left_for_the_learner_to_anneal_warn_a_learner_that_does_not(caplog) -> None:
    from types import SimpleNamespace

    from flywheel.learner.daemon import Learner

    row = episode_row(prompt=[5], completion=[7], logprobs=[-0.5], reward=1.3)
    row.update(r_outcome=1.0, r_parallel=0.3, shaping_clock="learner_step")
    shaped = parse_row(row, 512, 64)
    assert shaped.shaping_clock == "learner_step"
    plain = parse_row(episode_row(prompt=[5], completion=[7], logprobs=[-0.5], reward=1.0), 512, 64)
    for end_step, batch, warned in [(20, [shaped], False), (0, [plain], False), (0, [plain, shaped], True)]:
        fake = SimpleNamespace(cfg=SimpleNamespace(shaping_anneal_end_step=end_step), shaping_clock_warned=False)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="learner"):
            Learner.check_shaping_clock(fake, batch)
            Learner.check_shaping_clock(fake, batch)
        said = [r for r in caplog.records if "shaping_anneal_end_step is 0" in r.getMessage()]
        assert len(said) == (1 if warned else 0), f"end step {end_step}: {len(said)} warnings, want {int(warned)}"


def test_the_learner_reads_episodes_through_schema_columns_only() -> None:
    """The episode contract is the schema: the learner reads no key inside the reward_detail text, computes a
    row's reward with the schema's one function, and refuses a row missing a column the schema requires."""
    import inspect

    from flywheel.ingest import schema
    from flywheel.learner import daemon, data, loss, trainer

    for module in (data, daemon, loss, trainer):
        assert "reward_detail" not in inspect.getsource(module), f"{module.__name__} reads inside reward_detail"
    row = episode_row(prompt=[5], completion=[7], logprobs=[-0.5], reward=0.9)
    row.update(r_outcome=1.0, r_turn=0.5, r_judge=0.25, r_penalty=-0.1, r_parallel=0.2)
    assert parse_row(row, 512, 64).r_unshaped == schema.episode_reward(1.0, 0.5, 0.25, 0.0, 0.0, -0.1)
    required = [c.name for c in schema.EPISODE_COLUMNS if c.required]
    for name in required:
        reason = parse_row(row | {name: None}, 512, 64)
        assert isinstance(reason, str) and name in reason, f"a row without {name} was not refused: {reason!r}"


def test_a_frozen_models_rows_are_counted_and_never_pending_and_the_cursor_passes_them(tmp_path: Path) -> None:
    """The swarm's frozen sub-agents log their calls with FROZEN_VERSION: logged, never trained, not even held in
    pending (a stale row waits there until a take or a drop; these could never become trainable)."""
    from flywheel.base.versions import FROZEN_VERSION

    rows = random_rows(3, seed=1, policy_version=FROZEN_VERSION) + random_rows(2, seed=2, policy_version=0)
    write_episodes(tmp_path, rows, seq=0)
    s = _stream(tmp_path)
    assert s.poll() == 2 and s.counters["frozen"] == 3 and s.counters["stale"] == 0, s.counters
    batch, _ = s.take(10, {0: 0}, max_staleness_steps=2)
    assert len(batch) == 2 and all(e.policy_version == 0 for e in batch)
    s.mark_trained(batch)
    assert s.cursor, "every row of the file is trained or frozen: the cursor moves past it"
