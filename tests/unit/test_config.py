"""The typed config loader every process uses: precedence, conversion, unknown keys, cross-field rules."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from flywheel.base.config import ConfigError, resolve, setting, to_toml


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

    def check(self) -> None:
        if self.count < 0 and self.on:
            raise ConfigError("count must be >= 0 when on is set")


def test_precedence_defaults_toml_env_flags():
    cfg = resolve(Demo, {"name": "toml", "count": 5}, {"FLYWHEEL_COUNT": "7", "FLYWHEEL_RATIO": "0.25"}, {"count": "9"})
    assert (cfg.name, cfg.count, cfg.ratio) == ("toml", 9, 0.25)


def test_conversion_of_each_type():
    cfg = resolve(Demo, {}, {"FLYWHEEL_ON": "yes", "FLYWHEEL_ITEMS": "a,b", "FLYWHEEL_LIMIT": "4", "FLYWHEEL_PATH": "/x"}, {})
    assert cfg.on is True and cfg.items == ["a", "b"] and cfg.limit == 4 and cfg.path == Path("/x")
    assert resolve(Demo, {}, {"FLYWHEEL_LIMIT": "none"}, {}).limit is None


def test_unknown_keys_and_bad_values_are_named():
    with pytest.raises(ConfigError, match="unknown setting"):
        resolve(Demo, {"nmae": "typo"}, {}, {})
    with pytest.raises(ConfigError, match="count"):
        resolve(Demo, {}, {"FLYWHEEL_COUNT": "many"}, {})


def test_cross_field_rule():
    with pytest.raises(ConfigError, match="count must be >= 0"):
        resolve(Demo, {"count": -1, "on": True}, {}, {})


def test_resolved_config_round_trips_through_toml():
    cfg = resolve(Demo, {"name": 'q"uote', "items": ["p", "q"]}, {}, {})
    back = resolve(Demo, tomllib.loads(to_toml(cfg)), {}, {})
    assert back == cfg
