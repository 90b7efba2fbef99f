"""Typed process configuration: one dataclass per process, resolved in one way everywhere.

A process declares its config as a dataclass whose fields carry a default and a one-line help
(`setting(default, "help")`). `load_config(Cls, argv)` resolves it, lowest precedence first:

    field defaults  <  TOML file (--config PATH)  <  FLYWHEEL_<FIELD> environment  <  --flags

Unknown TOML keys are rejected by name; values are converted to the field's type; a
dataclass may define `check(self)` for cross-field rules and raise ConfigError naming the
fields. `write_resolved(cfg, path)` stores the result as TOML so a run can be reproduced
with `--config that-file`.

Environment variables are shared across processes on purpose: FLYWHEEL_KAFKA_BOOTSTRAP
points every process at the same broker.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from flywheel.base.atomic import Durability, write_text

T = TypeVar("T")
ENV_PREFIX = "FLYWHEEL_"


class ConfigError(ValueError):
    """A configuration value or combination is invalid; the message names the fields."""


def setting(default: Any, help: str) -> Any:
    """A config field with its default and one line of help (mutable defaults are copied)."""
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata={"help": help})
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


def build_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", type=Path, default=None, help="TOML file with settings (flags and FLYWHEEL_* win over it)")
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        base, _ = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = f"{f.metadata.get('help', '')} (default: {default!r}; env {ENV_PREFIX}{f.name.upper()})"
        if base is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=help_text)
    return parser


def resolve(cls: type[T], toml_values: dict[str, Any], env: typing.Mapping[str, str], flags: dict[str, Any]) -> T:
    """Merge defaults < TOML < environment < flags into a checked instance of `cls`."""
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(toml_values) - names)
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown} for {cls.__name__}; known: {sorted(names)}")
    values: dict[str, Any] = {}
    for name in names:
        raw: Any = dataclasses.MISSING
        if name in toml_values:
            raw = toml_values[name]
        env_key = ENV_PREFIX + name.upper()
        if env_key in env:
            raw = env[env_key]
        if flags.get(name) is not None:
            raw = flags[name]
        if raw is not dataclasses.MISSING:
            values[name] = _convert(name, hints[name], raw)
    cfg = cls(**values)
    check = getattr(cfg, "check", None)
    if callable(check):
        check()
    return cfg


def load_config(cls: type[T], argv: list[str] | None, prog: str, description: str = "") -> T:
    """Parse flags, read --config and the environment, and return the resolved config.

    A ConfigError ends the process with one clear line (exit status 2), as argparse does.
    """
    parser = build_parser(cls, prog, description or (cls.__doc__ or "").strip().splitlines()[0])
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    flags = {k: v for k, v in vars(args).items() if k != "config"}
    toml_values: dict[str, Any] = {}
    if args.config is not None:
        try:
            toml_values = tomllib.loads(Path(args.config).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            parser.error(f"--config {args.config}: {exc}")
    try:
        return resolve(cls, toml_values, os.environ, flags)
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


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


def to_toml(cfg: Any) -> str:
    """The config as TOML that `--config` reads back (None values are written as comments)."""
    lines = [f"# resolved {type(cfg).__name__}"]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        help_text = f.metadata.get("help", "")
        if value is None:
            lines.append(f"# {f.name} = (unset)  # {help_text}")
        else:
            lines.append(f"{f.name} = {_toml_value(value)}  # {help_text}")
    return "\n".join(lines) + "\n"


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
