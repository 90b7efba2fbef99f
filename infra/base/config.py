"""Typed process configuration: one dataclass per process, resolved in one way everywhere.

A process declares its config as a dataclass whose fields carry a default and a one-line help
(`setting(default, "help")`). `load_config(Cls, argv, prog)` resolves it, lowest precedence first:

    field defaults  <  TOML file (--config PATH)  <  environment  <  --flags

Unknown TOML keys are rejected by name; values are converted to the field's type; a
dataclass may define `check(self)` for cross-field rules and raise ConfigError naming the
fields. `write_resolved(cfg, path)` stores the result as TOML so a run can be reproduced
with `--config that-file`.

A field whose type is itself a config dataclass is a *section* (the demo's `learner: LearnerConfig`,
`gate: GateRule`): a TOML table `[learner]`, flags `--learner.lr`, and no environment variables
(a section is set by the process that owns it, which renders it into its child's flags with
`to_flags`). Choices are `Literal[...]` fields: a value outside them is an error naming the choices.

A *recipe* is a TOML file of tuned values (infra/recipes/<name>.toml, or any path): `--recipe NAME`
layers it between the field defaults and `--config`. A process whose config declares
`RECIPE_SECTION = "learner"` reads that table of the recipe; the demo (section "") reads all of it.
A recipe may name the one it builds on with `inherit = "<name>"`.

The environment rule, chosen so that one variable can never mean two things:

* `FLYWHEEL_<PROCESS>_<FIELD>` sets one process's field; PROCESS is the sub-command after
  `flywheel`, upper-cased, `-` and spaces as `_` (`flywheel proxy --port` is FLYWHEEL_PROXY_PORT,
  `flywheel lake-writer` FLYWHEEL_LAKE_WRITER_*, `flywheel bench learner` FLYWHEEL_BENCH_LEARNER_*;
  the router inside the proxy reads FLYWHEEL_ROUTER_*). An unknown FLYWHEEL_<PROCESS>_* variable
  of the running process is an error naming it: a typo must not be silently ignored.
* `FLYWHEEL_<FIELD>` (flat) only for the SHARED_FIELDS below, which mean the same thing in
  every process that has them (the broker, the topics, the registry, the state and lake roots,
  the serving tier that the router, publisher, promoter and learner must agree on). A
  prefixed variable wins over the flat one, so one process can still differ.
* A flat variable naming a field of the running process that is not shared is an error, not a
  warning: under the old rule it applied, so ignoring it would start e.g. the proxy on the wrong
  port with only a log line to show for it.
* FLYWHEEL_KAFKA_* is the Kafka client settings' own namespace (security, SASL, SSL: one
  for every process, flywheel.base.kafka), and FLYWHEEL_ENABLED / SAMPLE_RATE / SPOOL_DIR are
  the SDK's; load_config never reads or rejects those (FLYWHEEL_KAFKA_BOOTSTRAP is shared).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from flywheel.base.atomic import Durability, write_text

T = TypeVar("T")
ENV_PREFIX = "FLYWHEEL_"

# Fields read from the flat FLYWHEEL_<FIELD>: the same meaning in every process that has them.
# Every TierConfig field is here because the proxy's router, the publisher, the promoter and the
# learner's publisher each read the tier from the environment and must see one tier
# (tests/unit/test_config.py checks that the list covers TierConfig).
SHARED_FIELDS: frozenset[str] = frozenset({
    "kafka_bootstrap", "events_topic", "outcomes_topic", "dlq_topic",
    "mlflow_tracking_uri", "registered_model", "var_dir", "lake_root", "base_model", "policies_dir",
    # the serving tier (flywheel.serving.tier.TierConfig)
    "servers", "base_served_name", "keep_loras", "max_loras", "max_lora_rank", "replace_live", "transport",
    "challenger_share", "control_share", "control_version", "control_kind", "spare_to_control", "alias_refresh_s",
    "http_timeout_s", "pause_timeout_s",
})
# FLYWHEEL_<name...> owned by other readers than load_config (the Kafka client settings, the SDK,
# the test fixtures); a process field never claims these names flat.
FOREIGN_PREFIXES: tuple[str, ...] = ("KAFKA_", "ENABLED", "SAMPLE_RATE", "SPOOL_DIR", "KEEP_STACK")
# The tuned recipes the repository keeps (package data of flywheel: infra/recipes/<name>.toml).
RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


class ConfigError(ValueError):
    """A configuration value or combination is invalid; the message names the fields."""


def setting(default: Any, help: str) -> Any:
    """A config field with its default and one line of help (mutable defaults are copied)."""
    if isinstance(default, (list, dict, set)):
        def copy() -> Any:
            return type(default)(default)

        return dataclasses.field(default_factory=copy, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) for `X | None` / Optional[X]."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _convert(name: str, tp: Any, value: Any) -> Any:
    base, optional = _base_type(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("", "none", "null")):
        if optional:
            return None
        raise ConfigError(f"{name}: a value is required")
    origin = typing.get_origin(base)
    if origin is Literal:
        choices = typing.get_args(base)
        for choice in choices:  # "1" from a flag is the choice 1, "tis" the choice "tis"
            if value == choice or str(value) == str(choice):
                return choice
        raise ConfigError(f"{name}: {value!r} is not one of {choices}")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if base in (int, float, str):
            if base is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(f"not an integer: {value!r}")
            return base(value)
        if base is Path:
            return Path(value)
        if origin in (list, tuple):
            (item,) = typing.get_args(base)[:1] or (str,)
            items = value if isinstance(value, (list, tuple)) else [v for v in str(value).split(",") if v.strip()]
            return [_convert(f"{name}[]", item, v.strip() if isinstance(v, str) else v) for v in items]
        if origin is dict:
            if isinstance(value, str):  # a flag or an env var: key=value,key=value
                pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
                if any(len(p) != 2 for p in pairs):
                    raise ValueError("expected key=value,key=value")
                value = {k.strip(): v.strip() for k, v in pairs}
            if not isinstance(value, dict):
                raise ValueError("expected a table")
            item = (typing.get_args(base) or (str, str))[1]
            return {str(k): _convert(f"{name}.{k}", item, v) for k, v in value.items()}
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: cannot read {value!r} as {getattr(base, '__name__', base)}: {exc}") from exc
    return value


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def section_type(tp: Any) -> type | None:
    """The config dataclass of a section field (`learner: LearnerConfig`), else None."""
    base, _ = _base_type(tp)
    return base if isinstance(base, type) and dataclasses.is_dataclass(base) else None


def check_choices(cfg: Any) -> None:
    """Every Literal field of `cfg` holds one of its choices (resolve checks what it reads; this covers an
    instance built in code, so a config's check() calls it first)."""
    for name, tp in _hints(type(cfg)).items():
        base, optional = _base_type(tp)
        value = getattr(cfg, name, None)
        if (typing.get_origin(base) is Literal and not (optional and value is None)
                and value not in typing.get_args(base)):
            raise ConfigError(f"{name}: {value!r} is not one of {typing.get_args(base)}")


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    assert f.default_factory is not dataclasses.MISSING, f"{f.name}: a config field needs a default"
    return f.default_factory()


def process_env_name(prog: str) -> str:
    """The PROCESS of FLYWHEEL_<PROCESS>_<FIELD> for a prog: "flywheel lake-writer" -> "LAKE_WRITER"."""
    words = prog.split()
    if words and words[0] == "flywheel":
        words = words[1:]
    name = "_".join(words).upper().replace("-", "_")
    assert name and not name.startswith(FOREIGN_PREFIXES), f"prog {prog!r} gives no usable environment prefix"
    return name


def env_keys(name: str, process: str | None) -> list[str]:
    """The variables that may set field `name`, lowest precedence first."""
    flat = [ENV_PREFIX + name.upper()] if name in SHARED_FIELDS else []
    return flat + ([f"{ENV_PREFIX}{process}_{name.upper()}"] if process else [])


def _add_flags(parser: argparse.ArgumentParser, cls: type, shown: Any, process: str | None, prefix: str = "") -> None:
    """One flag per field (`--learner.lr` inside a section), its help ending in the default it resolves to."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        default = getattr(shown, f.name) if shown is not None else _default(f)
        sub = section_type(hints[f.name])
        if sub is not None:
            _add_flags(parser, sub, default, None, f"{prefix}{f.name}.")
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        base, _ = _base_type(hints[f.name])
        env = f"env {' or '.join(reversed(env_keys(f.name, process)))}" if not prefix else "no env: a section"
        choices = f"; one of {', '.join(map(str, typing.get_args(base)))}" if typing.get_origin(base) is Literal else ""
        help_text = f"{f.metadata.get('help', '')} (default: {default!r}{choices}; {env})"
        # argparse %-formats help: "60% of traffic" broke `flywheel demo --help`
        help_text = help_text.replace("%", "%%")
        dest = prefix + f.name
        if base is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=dest, default=None, help=help_text)


def build_parser(cls: type, prog: str, description: str, shown: Any = None) -> argparse.ArgumentParser:
    """The process's argparse parser; `shown` (an instance) gives the defaults the help prints (a recipe's)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", type=Path, default=None, help="TOML file with settings (flags and FLYWHEEL_* "
                                                                  "win over it)")
    if hasattr(cls, "RECIPE_SECTION"):
        where = f"its [{cls.RECIPE_SECTION}] table" if cls.RECIPE_SECTION else "all of it"
        parser.add_argument("--recipe", default=None,
                            help=f"tuned values, below --config: a name in infra/recipes ({', '.join(recipe_names())}) "
                                 f"or a TOML path; this process reads {where}. With --help: the defaults shown are "
                                 "the recipe's")
    _add_flags(parser, cls, shown, process_env_name(prog))
    return parser


def check_env(names: set[str], env: typing.Mapping[str, str], process: str | None) -> None:
    """Refuse the variables that look meant for this process but set nothing (see the module docstring)."""
    own = f"{ENV_PREFIX}{process}_" if process else None
    flat_shared = {ENV_PREFIX + n.upper() for n in SHARED_FIELDS}
    unknown = sorted(k for k in env if own and k.startswith(own) and k[len(own):].lower() not in names
                     and k not in flat_shared and not k[len(ENV_PREFIX):].startswith(FOREIGN_PREFIXES))
    if unknown and own:
        raise ConfigError(f"unknown environment variable(s) {unknown} for {process}; known: "
                          f"{sorted(own + n.upper() for n in names)}")
    flat = sorted(k for k in env if k.startswith(ENV_PREFIX) and k[len(ENV_PREFIX):].lower() in names - SHARED_FIELDS
                  and not k[len(ENV_PREFIX):].startswith(FOREIGN_PREFIXES))
    if flat:
        hint = f"set {[own + k[len(ENV_PREFIX):] for k in flat]} instead" if own else "pass it as a flag"
        raise ConfigError(f"{flat}: not a shared setting, so a flat FLYWHEEL_<FIELD> would reach every process; {hint}")


def resolve(cls: type[T], toml_values: Mapping[str, Any], env: typing.Mapping[str, str], flags: Mapping[str, Any],
            process: str | None = None, base: T | None = None) -> T:
    """Merge defaults < TOML < environment < flags into a checked instance of `cls`.

    `process` is the PROCESS of FLYWHEEL_<PROCESS>_<FIELD> (process_env_name); None reads only the
    shared flat variables, as a part built inside another process does. `base` (an instance)
    replaces the field defaults. A section field is resolved from its TOML table and its dotted
    flags ("learner.lr") onto its own default.
    """
    hints = _hints(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = {f.name for f in fields}
    sections = {f.name: sub for f in fields if (sub := section_type(hints[f.name])) is not None}
    unknown = sorted(set(toml_values) - names)
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown} for {cls.__name__}; known: {sorted(names)}")
    check_env(names - set(sections), env, process)
    values: dict[str, Any] = {}
    for name in names:
        start = getattr(base, name) if base is not None else _default(next(f for f in fields if f.name == name))
        if name in sections:
            table = toml_values.get(name, {})
            if not isinstance(table, Mapping):
                raise ConfigError(f"{name}: expected a table [{name}], got {table!r}")
            own = {k[len(name) + 1:]: v for k, v in flags.items() if k.startswith(name + ".")}
            values[name] = resolve(sections[name], table, {}, own, None, base=start)
            continue
        raw: Any = dataclasses.MISSING
        if name in toml_values:
            raw = toml_values[name]
        for env_key in env_keys(name, process):
            if env_key in env:
                raw = env[env_key]
        if flags.get(name) is not None:
            raw = flags[name]
        values[name] = _convert(name, hints[name], raw) if raw is not dataclasses.MISSING else start
    return _checked(cls(**values))


def _checked(cfg: T) -> T:
    """`cfg` after its cross-field rules (a config's optional check()) passed."""
    check = getattr(cfg, "check", None)
    if callable(check):
        check()
    return cfg


# ---------------------------------------------------------------------------------------------
# recipes
# ---------------------------------------------------------------------------------------------
def recipe_names() -> list[str]:
    """The recipes the repository keeps (infra/recipes/*.toml)."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def _merge(low: Mapping[str, Any], high: Mapping[str, Any]) -> dict[str, Any]:
    """`high` over `low`, table by table."""
    out = dict(low)
    for key, value in high.items():
        out[key] = (_merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
                    else value)
    return out


def recipe_values(recipe: str | Path, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """A recipe's tables, with the recipe it inherits from (`inherit = "<name>"`) beneath it."""
    path = Path(recipe)
    if path.suffix != ".toml":
        path = RECIPES_DIR / f"{recipe}.toml"
    if not path.is_file():
        raise ConfigError(f"recipe {str(recipe)!r}: no file {path}; the repository's recipes: {recipe_names()}")
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"recipe {path}: {exc}") from exc
    parent = values.pop("inherit", None)
    if parent is None:
        return values
    if str(parent) in _seen:
        raise ConfigError(f"recipe {path}: inherit forms a cycle through {list(_seen)}")
    return _merge(recipe_values(str(parent), (*_seen, str(parent))), values)


def recipe_section(cls: type, values: Mapping[str, Any], section: str | None = None) -> dict[str, Any]:
    """The part of a recipe that config `cls` reads: its RECIPE_SECTION table ("" for the whole recipe)."""
    section = getattr(cls, "RECIPE_SECTION", None) if section is None else section
    if section is None:
        raise ConfigError(f"{cls.__name__} reads no recipe")
    table = values.get(section, {}) if section else values
    if not isinstance(table, Mapping):
        raise ConfigError(f"recipe: [{section}] is not a table")
    return dict(table)


def from_recipe(cls: type[T], recipe: str | Path, section: str | None = None, **changes: Any) -> T:
    """An instance of `cls` with a recipe's values over the field defaults (no environment), then `changes`."""
    cfg = resolve(cls, recipe_section(cls, recipe_values(recipe), section), {}, {})
    if not changes:
        return cfg
    return _checked(dataclasses.replace(cfg, **changes))  # type: ignore[type-var]


def process_parser(cls: type, argv: list[str], prog: str,
                   description: str = "") -> tuple[argparse.ArgumentParser, dict[str, Any]]:
    """The parser a process parses `argv` with, and the recipe values `argv` names (--recipe: read first, so
    that `--recipe X --help` prints the recipe's values as the defaults)."""
    description = description or (cls.__doc__ or "").strip().splitlines()[0]
    if not hasattr(cls, "RECIPE_SECTION"):
        return build_parser(cls, prog, description), {}
    early = argparse.ArgumentParser(prog=prog, add_help=False)
    early.add_argument("--recipe", default=None)
    name = early.parse_known_args(argv)[0].recipe
    try:
        recipe = recipe_section(cls, recipe_values(name)) if name else {}
        shown = resolve(cls, recipe, {}, {}) if recipe else None
    except ConfigError as exc:
        early.error(f"--recipe {name}: {exc}")
    return build_parser(cls, prog, description, shown), recipe


def load_config(cls: type[T], argv: list[str] | None, prog: str, description: str = "") -> T:
    """Parse flags, read --recipe, --config and the environment, and return the resolved config.

    A ConfigError ends the process with one clear line (exit status 2), as argparse does.
    """
    argv = sys.argv[1:] if argv is None else argv
    parser, recipe = process_parser(cls, argv, prog, description)
    args = parser.parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "recipe")}
    toml_values: dict[str, Any] = {}
    if args.config is not None:
        try:
            toml_values = tomllib.loads(Path(args.config).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            parser.error(f"--config {args.config}: {exc}")
    try:
        return resolve(cls, _merge(recipe, toml_values), os.environ, flags, process_env_name(prog))
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def to_flags(cfg: Any, prefix: str = "") -> list[str]:
    """Every field of `cfg` as the flags its process's parser reads back to the same values (a section's
    as --section.field). How a parent renders a child's command from the child's own config."""
    out: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        name = prefix + f.name.replace("_", "-")
        flag = "--" + name
        if dataclasses.is_dataclass(value):
            out += to_flags(value, f"{prefix}{f.name}.")
        elif isinstance(value, bool):
            out.append(flag if value else "--no-" + name)
        elif value is None:
            out += [flag, "none"]
        elif isinstance(value, (list, tuple)):
            out += [flag, ",".join(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, ",".join(f"{k}={v}" for k, v in value.items())]
        else:
            out += [flag, repr(value) if isinstance(value, float) else str(value)]
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def _toml_lines(cfg: Any) -> tuple[list[str], list[tuple[str, Any]]]:
    lines, sections = [], []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        help_text = f.metadata.get("help", "")
        if dataclasses.is_dataclass(value):
            sections.append((f.name, value))
        elif value is None:
            lines.append(f"# {f.name} = (unset)  # {help_text}")
        else:
            lines.append(f"{f.name} = {_toml_value(value)}  # {help_text}")
    return lines, sections


def to_toml(cfg: Any, header: str = "") -> str:
    """The config as TOML that `--config` reads back (None values are written as comments; a section as its table)."""
    lines, sections = _toml_lines(cfg)
    text = "\n".join([f"# resolved {type(cfg).__name__}" if not header else f"\n[{header}]", *lines]) + "\n"
    return text + "".join(to_toml(value, f"{header}.{name}" if header else name) for name, value in sections)


def write_resolved(cfg: Any, path: Path) -> Path:
    """Write the resolved config atomically next to a run's output and return its path."""
    return write_text(path, to_toml(cfg), Durability.ADVISORY)  # a record of the run, not state


def setup_logging(level: str = "INFO") -> None:
    """Configure logging once, in a process's main()."""
    import logging

    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)-5s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # kafka-python logs every connection at INFO; keep its warnings and errors only
    logging.getLogger("kafka").setLevel(max(logging.WARNING, logging.getLogger().level))
