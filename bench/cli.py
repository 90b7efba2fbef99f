"""`flywheel bench NAME`: each benchmark is bench/NAME.py with a main(argv).

Benchmarks and their synthetic fixtures are not installed with the package: they run from a
source checkout (the repository root is put on sys.path by `flywheel.cli`)."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "sidecar": "hot-path cost of the SDK vs an OpenTelemetry span, and during a broker outage",
    "ingest": "lake writer rate vs raw kafka-python consume rate, produce-to-visible latency; with --vs quixstreams "
              "against a Quix Streams Parquet sink",
    "episodes": "episode builder: full build and incremental passes at lake sizes 1x and 10x",
    "learner": "learner step tokens/s vs a bare torch loop, step-to-served publish time",
    "weights": "LoRA and full-weight push into a running vLLM vs a plain file copy",
    "chaos": "the closed loop under SIGKILLs of every process and a broker outage: nothing lost, nothing twice",
    "gate": "the promotion gate's false-promotion rate under the null and its power under a true lift, on simulated "
            "session streams",
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in BENCHMARKS:
        print("usage: flywheel bench NAME [ARGS]\n\nbenchmarks:")
        for name, text in BENCHMARKS.items():
            print(f"  {name:<9} {text}")
        return 0 if not args or args[0] in ("-h", "--help") else 2
    from flywheel.demo.model_init import ensure_base_model

    ensure_base_model()  # the stack a benchmark starts serves the tiny base, which the stack does not build
    module = importlib.import_module(f"bench.{args[0]}")
    return int(module.main(args[1:]) or 0)
