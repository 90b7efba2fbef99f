"""The small mode of every benchmark, without the stack: tests/integration/test_bench_small.py runs each
`flywheel bench NAME` with the flags in its SMALL table; here, that the table has every bench bench/cli.py
lists (a new bench without a small mode fails) and that each bench's own parser accepts its flags."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bench import cli

SMALL_RUNS = Path(__file__).resolve().parents[1] / "integration" / "test_bench_small.py"


def _small_runs() -> ModuleType:
    """The integration test module, loaded by path: tests/ is not a package, and the table lives beside the runs."""
    spec = importlib.util.spec_from_file_location("bench_small_runs", SMALL_RUNS)
    assert spec is not None and spec.loader is not None, f"cannot load {SMALL_RUNS}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runs = _small_runs()


def test_every_benchmark_has_a_small_mode_and_checks() -> None:
    listed = set(cli.BENCHMARKS)
    assert set(runs.SMALL) == listed, (f"small modes {sorted(runs.SMALL)} != benchmarks {sorted(listed)} (bench/cli.py): "
                                       f"give each a small mode in SMALL of {SMALL_RUNS.name}")
    assert set(runs.CHECKS) == listed, f"JSON checks {sorted(runs.CHECKS)} != benchmarks {sorted(listed)}"


class Parsed(Exception):
    """Raised with what a bench's parser returned: the bench stops there, before it starts anything."""

    def __init__(self, parsed: Any) -> None:
        super().__init__("parsed")
        self.parsed = parsed


@pytest.mark.parametrize("name", sorted(cli.BENCHMARKS))
def test_small_flags_parse(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `flywheel bench NAME` (bench/cli.py) up to the bench's parser and no further: a renamed or removed
    flag fails here, not after the stack is up. A typed config is also resolved and checked (types, cross-field
    rules); argparse exits 2 on a flag it does not know."""
    module = importlib.import_module(f"bench.{name}")
    if hasattr(module, "load_config"):
        load = module.load_config

        def load_then_stop(*args: Any, **kwargs: Any) -> Any:
            raise Parsed(load(*args, **kwargs))

        monkeypatch.setattr(module, "load_config", load_then_stop)
    else:
        parse = argparse.ArgumentParser.parse_args

        def parse_then_stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> argparse.Namespace:
            raise Parsed(parse(self, *args, **kwargs))

        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(Parsed) as stopped:
        cli.main([name, *runs.small_flags(name, tmp_path, "127.0.0.1:9092")])
    if name == "chaos":  # its schedule refuses traffic too short for the outage and the kills around it
        args = stopped.value.parsed
        faults = module.schedule(args.seed, args.minutes * 60.0, args.kills, args.outage_s)
        assert sum(f.kind == "kill" for f in faults) == args.kills and any(f.kind == "outage" for f in faults), faults


def test_the_peer_comparison_flags_parse(tmp_path: Path) -> None:
    """`ingest --vs quixstreams` in its small mode (tests/integration/test_bench_small.py) parses as the peer's."""
    from bench import ingest_peer

    flags = [flag.format(tmp=tmp_path, kafka="127.0.0.1:9092") for flag in runs.INGEST_VS_QUIX]
    args = ingest_peer.parse_args(flags)
    assert args.events == 500 and args.lakes == ["local"] and args.kills == 1
