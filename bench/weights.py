"""`flywheel bench weights`: seconds to push a LoRA version and a full-weight version of the tiny model
into a running vLLM, and the full push's effective MB/s next to a plain local copy of the same bytes.

Each variant is repeated `--reps` times and the median reported:
  lora push   publish(): validate the adapter + POST /v1/load_lora_adapter (unloaded between reps)
  full push   publish(): validate the weights + pause / reload_weights / reset_prefix_cache / update_weight_version / resume
  validate    load_version() alone on the full version, with the server idle
  file copy   shutil.copyfile of model.safetensors to a new file, fsync'd (the floor a reload from
              a shared path competes with)
Versions are not registered in MLflow (nothing to clean up there). The full pushes hold the shared
server's weights lock and reload the base weights at the end. vLLM is started if it is not running,
and stopped at the end only if this run started it. Last line: one JSON object.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from flywheel.base.config import load_config, setting, setup_logging


@dataclass
class WeightsBenchConfig:
    """Push a LoRA and a full-weight version into vLLM and compare with a plain file copy."""

    reps: int = setting(5, "repetitions of each variant (median reported)")
    lora_rank: int = setting(16, "rank of the synthetic LoRA adapter")


def _median(values: list[float]) -> float:
    return statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(WeightsBenchConfig, argv, "flywheel bench weights")
    setup_logging("WARNING")
    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    from bench.fixtures import models as synthetic
    from flywheel import stack
    from flywheel.serving import publisher, vllm_client
    from flywheel.serving.tier import TierConfig

    console = Console(stderr=True)
    stack_cfg = stack.load_stack_config([])
    started = stack.ensure_up(stack_cfg, parts=["vllm"])
    url = stack_cfg.vllm_url
    base = Path(stack_cfg.base_model).resolve()
    # One server, which already serves the base (the live version 0): a full push must replace it, as a one-server
    # tier's does (replace_live). The bench holds the weights lock and puts the base back at the end.
    tier = TierConfig(servers=[url], base_model=str(base), replace_live=True)
    work = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    lock_path = Path(stack_cfg.var_dir) / "run" / "vllm-weights.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        v = random.randint(8_000_000, 8_999_999)  # far from real versions: never collides with the learner's
        lora_dir = synthetic.make_lora_version(base, work / f"policy-v{v}", v, seed=1, rank=cfg.lora_rank)
        full_dir = synthetic.make_full_version(base, work / f"policy-v{v + 1}", v + 1, seed=2)
        full_bytes = (full_dir / "model.safetensors").stat().st_size
        lora_bytes = (lora_dir / "adapter_model.safetensors").stat().st_size

        lora_s: list[float] = []
        for _ in track(range(cfg.reps), description="lora push", console=console):
            t0 = time.perf_counter()
            publisher.publish(lora_dir, tier, register=False)
            lora_s.append(time.perf_counter() - t0)
            vllm_client.unload_lora_adapter(url, f"policy-v{v}")

        full_s: list[float] = []
        reload_s: list[float] = []
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # other engineers' tests share this server's full weights
            try:
                pv = publisher.load_version(full_dir, tier)
                for _ in track(range(cfg.reps), description="full push", console=console):
                    publisher.reload_full(url, base, 0, tier.http_timeout_s)  # start each rep from the base weights
                    t0 = time.perf_counter()
                    publisher.publish(full_dir, tier, register=False)
                    full_s.append(time.perf_counter() - t0)
                    publisher.reload_full(url, base, 0, tier.http_timeout_s)
                    t0 = time.perf_counter()
                    publisher.push_full_http(url, pv, tier)  # the server-side part alone, no validation
                    reload_s.append(time.perf_counter() - t0)
            finally:
                publisher.reload_full(url, base, 0, tier.http_timeout_s)
                fcntl.flock(lock, fcntl.LOCK_UN)

        validate_s: list[float] = []
        for _ in track(range(cfg.reps), description="validate", console=console):
            t0 = time.perf_counter()
            publisher.load_version(full_dir, tier)  # every tensor read and checked finite, base shapes compared
            validate_s.append(time.perf_counter() - t0)

        copy_s: list[float] = []
        for i in track(range(cfg.reps), description="file copy", console=console):
            target = work / f"copy-{i}.safetensors"
            t0 = time.perf_counter()
            shutil.copyfile(full_dir / "model.safetensors", target)
            fd = os.open(target, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            copy_s.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if started:
            stack.down(stack_cfg, parts=started)

    mb = full_bytes / 1e6
    result = {
        "lora_push_s": round(_median(lora_s), 4),
        "lora_bytes": lora_bytes,
        "full_push_s": round(_median(full_s), 4),
        "full_reload_only_s": round(_median(reload_s), 4),
        "full_bytes": full_bytes,
        "full_push_mb_per_s": round(mb / _median(full_s), 2),
        "full_reload_only_mb_per_s": round(mb / _median(reload_s), 2),
        "full_validate_only_s": round(_median(validate_s), 4),
        "copy_s": round(_median(copy_s), 4),
        "copy_mb_per_s": round(mb / _median(copy_s), 2),
        "reps": cfg.reps,
    }
    table = Table(title=f"weight push into vLLM ({url}), median of {cfg.reps}")
    for column in ("variant", "bytes", "seconds", "MB/s"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    table.add_row("LoRA push (validate + load_lora_adapter)", f"{lora_bytes:,}", f"{result['lora_push_s']:.4f}",
                  f"{lora_bytes / 1e6 / _median(lora_s):.1f}")
    table.add_row("full push (validate + pause/reload/resume)", f"{full_bytes:,}", f"{result['full_push_s']:.4f}",
                  f"{result['full_push_mb_per_s']:.1f}")
    table.add_row("  of which pause/reload/resume", f"{full_bytes:,}", f"{result['full_reload_only_s']:.4f}",
                  f"{result['full_reload_only_mb_per_s']:.1f}")
    table.add_row("  validation alone (server idle)", f"{full_bytes:,}", f"{result['full_validate_only_s']:.4f}",
                  f"{mb / _median(validate_s):.1f}")
    table.add_row("plain file copy + fsync", f"{full_bytes:,}", f"{result['copy_s']:.4f}", f"{result['copy_mb_per_s']:.1f}")
    Console().print(table)
    print(json.dumps(result))
    return 0
