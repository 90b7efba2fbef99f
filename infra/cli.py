"""The `flywheel` command: one sub-command per process or tool, each a module with its own main().

Modules are imported only when their sub-command runs, so `flywheel proxy` never imports torch.
"""

from __future__ import annotations

import importlib
import sys

# sub-command -> ("module:function", one-line help). Each function takes argv (list[str]) and returns an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "infra": ("infra.stack:main", "up|down|status of the local stack (Kafka, MLflow, vLLM)"),
    "model": ("infra.model_init:main", "init: build the tiny base model (tokenizer + Qwen2-style LM)"),
    "proxy": ("ingest.proxy:main", "OpenAI-compatible capture proxy in front of vLLM"),
    "lake-writer": ("ingest.lake_writer:main", "Kafka -> exactly-once Parquet lake daemon"),
    "compact": ("ingest.lake_writer:compact_main", "merge small files of closed lake partitions"),
    "episodes": ("rewards.episodes:main", "build episodes (outcome join + rewards) from the lake"),
    "learner": ("learner.daemon:main", "continuous training daemon"),
    "publish": ("serving.publisher:main", "push a policy version directory to the vLLM tier"),
    "promote": ("serving.promote:main", "champion/challenger gate"),
    "rollback": ("serving.promote:rollback_main", "move the champion alias back"),
    "status": ("infra.status:main", "one view of the whole loop"),
    "bench": ("bench.cli:main", "benchmarks: sidecar | ingest | episodes | learner | weights"),
    "agent-sim": ("infra.agent_sim:main", "simulated production agent"),
    "outcome-sim": ("infra.outcome_sim:main", "simulated outcome sources (verifier, user)"),
    "demo": ("infra.demo:main", "the whole closed loop with a live view and a report"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: flywheel COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_text}" for name, (_, help_text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"flywheel: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    target, _ = COMMANDS[name]
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        print(f"flywheel {name}: cannot import {module_name} ({exc}); run `make setup` to install the extras", file=sys.stderr)
        return 2
    code = getattr(module, func_name)(rest)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
