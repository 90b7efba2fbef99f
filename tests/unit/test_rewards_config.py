"""The reward TOML: the shipped default loads, and every kind of mistake is rejected by name."""

from __future__ import annotations

import pytest

from flywheel.rewards import config

BASE = """
[outcomes.task_success]
window_s = 60
missing = 0.0
[task_types.tool_use]
wait_for = ["task_success"]
"""


def test_default_toml_loads_with_cursor_tab_values() -> None:
    cfg = config.load()
    accepted = cfg.outcomes["accepted"]
    assert (accepted.score(1.0), accepted.score(0.0)) == (0.75, -0.25)
    assert cfg.task("no-such-type").name == "default"
    assert cfg.parl.anneal_end > cfg.parl.anneal_start
    assert not any(t.judge for t in cfg.task_types.values()), "the shipped default keeps the judge off"


def test_a_dotted_task_type_without_its_own_table_uses_its_parents() -> None:
    cfg = config.parse(BASE + '[task_types."tool_use.search"]\nwait_for = []\n')  # quoted: a dotted name
    assert cfg.task("tool_use.add").name == "tool_use" and list(cfg.task("tool_use.add").wait_for) == ["task_success"]
    assert cfg.task("tool_use.add.two_digit").name == "tool_use", "every missing level falls back one step"
    assert cfg.task("tool_use.search").name == "tool_use.search", "a type's own table wins over its parent's"
    assert cfg.task("research.deep").name == "default"


def test_raw_values_are_clipped() -> None:
    cfg = config.parse(BASE + "[outcomes.rating]\nlo = -1.0\nhi = 1.0\n")
    assert cfg.outcomes["rating"].score(3.0) == 1.0
    assert cfg.outcomes["rating"].score(-0.3) == -0.3


@pytest.mark.parametrize(
    "extra, message",
    [
        ("[outcomes.accepted]\nwieght = 1.0\n", "outcomes.accepted]: unknown key(s) ['wieght']"),
        ("[task_types.x]\nwait_for = ['nope']\n", "task_types.x.wait_for: outcome kind 'nope'"),
        ("[outcomes.y]\nmissing = 'zero'\n", "outcomes.y.missing"),
        ("[outcomes.y]\nif_true = 1.0\n", "if_true and if_false go together"),
        ("[parl]\nanneal_start = 5\nanneal_end = 5\n", "parl.anneal_end (5) must be > parl.anneal_start (5)"),
        ("[penalties]\nmalformed_tool_call = 0.5\n", "penalties.malformed_tool_call: must be <= 0"),
        ("[join]\nrelabel_horizon_s = 10\n", "join.relabel_horizon_s (10) must be >="),
        ("[task_types.z]\nrubric = 'none'\n", "task_types.z.rubric"),
        ("[rewardz]\n", "unknown table(s) ['rewardz']"),
    ],
)
def test_mistakes_are_named(extra: str, message: str) -> None:
    with pytest.raises(config.RewardConfigError) as err:
        config.parse(BASE + extra)
    assert message in str(err.value)


def test_missing_file_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(config.RewardConfigError, match="nothere.toml"):
        config.load(tmp_path / "nothere.toml")


def test_builder_refuses_a_bad_rewards_file(tmp_path, caplog) -> None:
    from flywheel.rewards import builder as episodes

    bad = tmp_path / "r.toml"
    bad.write_text("[outcomes.accepted]\nwieght = 1\n")
    code = episodes.main(["--rewards-toml", str(bad), "--state-dir", str(tmp_path / "state"), "--lake-root", str(tmp_path / "lake")])
    assert code == 2
    assert "wieght" in caplog.text
    assert not (tmp_path / "state").exists(), "nothing may be written before the config is valid"
