"""The typed config loader every process uses: precedence, conversion, unknown keys, cross-field rules,
and the environment rule (FLYWHEEL_<PROCESS>_<FIELD>, flat FLYWHEEL_<FIELD> only for shared fields)."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import pytest

from flywheel.base.config import (
    SHARED_FIELDS,
    ConfigError,
    build_parser,
    check_choices,
    from_recipe,
    load_config,
    process_env_name,
    recipe_names,
    recipe_values,
    resolve,
    setting,
    to_flags,
    to_toml,
)
from flywheel.cli import COMMANDS
from flywheel.demo.plan import DemoConfig
from flywheel.learner.config import LearnerConfig
from flywheel.serving.promote import PromoteConfig
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


# ---------------------------------------------------------------------------------------------
# sections, choices, recipes, and rendering a config back into its process's flags
# ---------------------------------------------------------------------------------------------
@dataclass
class Part:
    """A part's config."""

    RECIPE_SECTION: ClassVar[str] = "part"
    mode: Literal["fast", "slow"] = setting("fast", "a choice")
    size: int = setting(2, "a size")
    tags: dict[str, float] = setting({}, "weights")

    def check(self) -> None:
        check_choices(self)
        if self.size < 1:
            raise ConfigError(f"size: must be >= 1, got {self.size}")


@dataclass
class Whole:
    """A config with a section."""

    RECIPE_SECTION: ClassVar[str] = ""
    minutes: float = setting(1.0, "minutes")
    part: Part = dataclasses.field(default_factory=lambda: Part(size=5), metadata={"help": "the part"})


def test_a_choice_outside_its_literal_is_refused_naming_the_choices() -> None:
    assert resolve(Part, {"mode": "slow"}, {}, {}).mode == "slow"
    with pytest.raises(ConfigError, match=r"mode: 'medium' is not one of \('fast', 'slow'\)"):
        resolve(Part, {}, {}, {"mode": "medium"})
    with pytest.raises(ConfigError, match="mode"):
        Part(mode="medium").check()  # type: ignore[arg-type]  # built in code: check() still refuses it


def test_a_section_reads_its_table_and_dotted_flags_onto_its_own_default() -> None:
    cfg = resolve(Whole, {"minutes": 2.0, "part": {"mode": "slow"}}, {}, {"part.size": "7"})
    assert (cfg.minutes, cfg.part.mode, cfg.part.size) == (2.0, "slow", 7)
    assert resolve(Whole, {}, {}, {}).part.size == 5, "an unset section keeps the parent's default for it"
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['sise'\] for Part"):
        resolve(Whole, {"part": {"sise": 1}}, {}, {})
    with pytest.raises(ConfigError, match="size: must be >= 1"):
        resolve(Whole, {}, {}, {"part.size": "0"})
    with pytest.raises(ConfigError, match="FLYWHEEL_WHOLE_PART_SIZE"):
        resolve(Whole, {}, {"FLYWHEEL_WHOLE_PART_SIZE": "3"}, {}, "WHOLE")  # a section has no environment variables
    args = build_parser(Whole, "flywheel whole", "d").parse_args(["--part.mode", "slow", "--minutes", "3"])
    assert (vars(args)["part.mode"], args.minutes) == ("slow", "3")
    assert tomllib.loads(to_toml(cfg)) == {"minutes": 2.0, "part": {"mode": "slow", "size": 7, "tags": {}}}


def test_a_recipe_layers_below_config_and_flags_and_may_inherit(tmp_path: Path) -> None:
    (tmp_path / "base.toml").write_text('minutes = 4.0\n[part]\nsize = 9\nmode = "slow"\n')
    (tmp_path / "child.toml").write_text(f'inherit = "{tmp_path / "base.toml"}"\n[part]\nsize = 3\n')
    assert recipe_values(tmp_path / "child.toml") == {"minutes": 4.0, "part": {"size": 3, "mode": "slow"}}
    whole = load_config(Whole, ["--recipe", str(tmp_path / "child.toml"), "--part.mode", "fast"], prog="flywheel whole")
    assert (whole.minutes, whole.part.size, whole.part.mode) == (4.0, 3, "fast")
    part = load_config(Part, ["--recipe", str(tmp_path / "child.toml")], prog="flywheel part")
    assert (part.size, part.mode) == (3, "slow"), "a process reads its own section of the recipe"
    (tmp_path / "loop.toml").write_text(f'inherit = "{tmp_path / "loop.toml"}"\n')
    with pytest.raises(ConfigError, match="cycle"):
        recipe_values(tmp_path / "loop.toml")
    with pytest.raises(ConfigError, match="the repository's recipes"):
        recipe_values("no-such-recipe")
    for name in recipe_names():  # every recipe the repository keeps is one its configs accept
        from_recipe(DemoConfig, name)
        from_recipe(LearnerConfig, name)
        from_recipe(PromoteConfig, name)


def _process_configs() -> list[type]:
    """The config dataclass of every flywheel sub-command that has one (load_config's first argument in its main)."""
    import ast
    import importlib
    import inspect

    found = []
    for target, _ in COMMANDS.values():
        module_name, func = target.split(":")
        module = importlib.import_module(module_name)
        tree = ast.parse(inspect.getsource(getattr(module, func)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "load_config" and node.args:
                cls = getattr(module, getattr(node.args[0], "id", ""), None)
                if isinstance(cls, type):
                    found.append(cls)
    return found


def test_every_process_config_renders_into_flags_its_parser_reads_back_to_the_same_config() -> None:
    classes = _process_configs()
    assert {c.__name__ for c in classes} >= {"LearnerConfig", "PromoteConfig", "DemoConfig", "LakeWriterConfig",
                                            "EpisodesConfig", "ProxyConfig"}, classes
    checked = []
    for cls in classes:
        cfg = cls()
        if cls is DemoConfig:
            cfg = from_recipe(DemoConfig, "swarm")  # sections, and values off the field defaults
        try:
            getattr(cfg, "check", lambda: None)()
        except ConfigError:
            continue  # a config with a required field (publish's version_dir) has no valid default to render
        checked.append(cls.__name__)
        args = build_parser(cls, "flywheel x", "d").parse_args(to_flags(cfg))
        again = resolve(cls, {}, {}, {k: v for k, v in vars(args).items() if k not in ("config", "recipe")})
        assert again == cfg, f"{cls.__name__}: to_flags does not round-trip"
    assert len(checked) >= len(classes) - 2, f"only {checked} of {[c.__name__ for c in classes]} could be rendered"
