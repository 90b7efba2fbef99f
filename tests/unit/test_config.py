"""The typed config loader every process uses: precedence, conversion, unknown keys, cross-field rules,
and the environment rule (FLYWHEEL_<PROCESS>_<FIELD>, flat FLYWHEEL_<FIELD> only for shared fields)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from flywheel.base.config import (
    SHARED_FIELDS,
    ConfigError,
    build_parser,
    load_config,
    process_env_name,
    resolve,
    setting,
    to_toml,
)
from flywheel.cli import COMMANDS
from flywheel.serving.tier import TierConfig


@dataclass
class Demo:
    """A demo config."""

    name: str = setting("a", "a name")
    count: int = setting(3, "how many")
    ratio: float = setting(0.5, "a share")
    on: bool = setting(False, "a switch")
    items: list[str] = setting(["x"], "some items")
    path: Path = setting(Path("var"), "a path")
    limit: int | None = setting(None, "optional limit")
    var_dir: str = setting("var", "a shared field")

    def check(self) -> None:
        if self.count < 0 and self.on:
            raise ConfigError("count must be >= 0 when on is set")


def test_precedence_defaults_toml_env_flags():
    cfg = resolve(Demo, {"name": "toml", "count": 5}, {"FLYWHEEL_DEMO_COUNT": "7", "FLYWHEEL_DEMO_RATIO": "0.25"}, {"count": "9"},
                  "DEMO")
    assert (cfg.name, cfg.count, cfg.ratio) == ("toml", 9, 0.25)


def test_conversion_of_each_type():
    env = {"FLYWHEEL_DEMO_ON": "yes", "FLYWHEEL_DEMO_ITEMS": "a,b", "FLYWHEEL_DEMO_LIMIT": "4", "FLYWHEEL_DEMO_PATH": "/x"}
    cfg = resolve(Demo, {}, env, {}, "DEMO")
    assert cfg.on is True and cfg.items == ["a", "b"] and cfg.limit == 4 and cfg.path == Path("/x")
    assert resolve(Demo, {}, {"FLYWHEEL_DEMO_LIMIT": "none"}, {}, "DEMO").limit is None


def test_unknown_keys_and_bad_values_are_named():
    with pytest.raises(ConfigError, match="unknown setting"):
        resolve(Demo, {"nmae": "typo"}, {}, {})
    with pytest.raises(ConfigError, match="count"):
        resolve(Demo, {}, {"FLYWHEEL_DEMO_COUNT": "many"}, {}, "DEMO")


def test_cross_field_rule():
    with pytest.raises(ConfigError, match="count must be >= 0"):
        resolve(Demo, {"count": -1, "on": True}, {}, {})


def test_resolved_config_round_trips_through_toml():
    cfg = resolve(Demo, {"name": 'q"uote', "items": ["p", "q"]}, {}, {})
    back = resolve(Demo, tomllib.loads(to_toml(cfg)), {}, {})
    assert back == cfg


def test_the_process_prefix_is_the_sub_command() -> None:
    got = {prog: process_env_name(prog) for prog in ("flywheel proxy", "flywheel lake-writer", "flywheel bench learner", "router")}
    assert got == {"flywheel proxy": "PROXY", "flywheel lake-writer": "LAKE_WRITER",
                   "flywheel bench learner": "BENCH_LEARNER", "router": "ROUTER"}, got


def test_a_prefixed_variable_sets_only_its_process_and_wins_over_the_flat_shared_one() -> None:
    env = {"FLYWHEEL_VAR_DIR": "/shared", "FLYWHEEL_DEMO_VAR_DIR": "/mine", "FLYWHEEL_OTHER_COUNT": "8",
           "FLYWHEEL_OTHER_VAR_DIR": "/theirs"}
    mine, other, neither = (resolve(Demo, {}, env, {}, p) for p in ("DEMO", "OTHER", None))
    assert (mine.var_dir, mine.count) == ("/mine", 3), mine
    assert (other.var_dir, other.count) == ("/theirs", 8), other
    assert (neither.var_dir, neither.count) == ("/shared", 3), neither


def test_an_unknown_variable_of_the_running_process_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="FLYWHEEL_DEMO_CUONT"):
        resolve(Demo, {}, {"FLYWHEEL_DEMO_CUONT": "7"}, {}, "DEMO")
    assert resolve(Demo, {}, {"FLYWHEEL_LEARNER_LR": "1"}, {}, "DEMO").count == 3, "another process's variable"


def test_a_flat_variable_of_a_field_that_is_not_shared_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"FLYWHEEL_COUNT.*FLYWHEEL_DEMO_COUNT"):
        resolve(Demo, {}, {"FLYWHEEL_COUNT": "7"}, {}, "DEMO")


def test_the_kafka_client_and_sdk_variables_are_left_to_their_readers() -> None:
    env = {"FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "FLYWHEEL_KAFKA_SASL_PASSWORD": "x",
           "FLYWHEEL_ENABLED": "0", "FLYWHEEL_SAMPLE_RATE": "0.5", "FLYWHEEL_SPOOL_DIR": "/tmp/s",
           "FLYWHEEL_KEEP_STACK": "1"}
    assert resolve(Demo, {}, env, {}, "DEMO") == Demo()


def test_load_config_reads_the_prefixed_environment_and_exits_on_a_typo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_TOY_THING_COUNT", "11")
    assert load_config(Demo, [], prog="flywheel toy-thing").count == 11
    monkeypatch.setenv("FLYWHEEL_TOY_THING_CONT", "12")
    with pytest.raises(SystemExit) as exited:
        load_config(Demo, [], prog="flywheel toy-thing")
    assert exited.value.code == 2


def test_every_tier_field_is_shared_so_router_publisher_gate_and_learner_see_one_tier() -> None:
    import dataclasses

    missing = {f.name for f in dataclasses.fields(TierConfig)} - SHARED_FIELDS
    assert not missing, f"TierConfig fields not in SHARED_FIELDS: {sorted(missing)}"


def test_no_sub_command_prefix_makes_a_shared_variable_look_like_its_own() -> None:
    clashes = [(cmd, f) for cmd in [*COMMANDS, "router"] for f in SHARED_FIELDS
               if f.upper().startswith(process_env_name(f"flywheel {cmd}") + "_")]
    assert not clashes, f"FLYWHEEL_<FIELD> of a shared field reads as FLYWHEEL_<PROCESS>_<FIELD>: {clashes}"


def test_help_with_a_percent_sign_renders() -> None:
    @dataclass
    class Shares:
        share: float = setting(0.6, "60% of traffic")

    text = build_parser(Shares, "flywheel shares", "d").format_help()
    assert "60% of traffic" in text and "FLYWHEEL_SHARES_SHARE" in text, text
