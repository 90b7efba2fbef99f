"""`flywheel bench learner`: what the learner's machinery costs on top of a bare torch training loop,
and how long a finished step takes to be served.

Two variants run side by side in one process, interleaved step by step (so a noisy shared CPU
hits both alike), on the same model (the base model with the same LoRA) and the same batches:
  learner step   the daemon's whole step: take the batch from the episode stream, advantages,
                 importance-corrected loss with its stats, optimizer step, trained-episode log,
                 atomic checkpoint and MLflow metrics (learner.daemon.Learner)
  bare loop      model forward -> logprobs of the completion tokens (the learner's own gather) ->
                 plain REINFORCE loss -> backward -> clip -> AdamW step, on the same micro-batches
tokens/s counts prompt + completion tokens forwarded; the median step time of each is reported.
publish_s: seconds from "step finished" to "vLLM answers a request for the new policy-v<N>":
write the version directory, serving.publisher.publish (load into vLLM + MLflow registration),
then the first 1-token completion from the new name. vLLM is started if it is not running and
stopped at the end only if this run started it. Last line: one JSON object.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from flywheel.base import defaults
from flywheel.base.config import load_config, setting, setup_logging
from flywheel.base.versions import version_name


@dataclass
class LearnerBenchConfig:
    """Learner step vs bare torch loop (tokens/s) and step-to-served publish time."""

    steps: int = setting(6, "timed steps of each variant (after one warm-up step each)")
    batch_size: int = setting(64, "episodes per step")
    micro_batch: int = setting(32, "episodes per forward/backward (both variants)")
    prompt_len: int = setting(96, "prompt tokens per episode")
    completion_len: int = setting(32, "completion tokens per episode")
    publishes: int = setting(3, "publish repetitions (median reported)")
    mode: str = setting("lora", "lora or full")
    base_model: str = setting(defaults.BASE_MODEL_DIR, "model to train")
    mlflow_tracking_uri: str = setting(defaults.MLFLOW_TRACKING_URI, "tracking store of the learner's metrics")


def _bare_step(policy, optimizer, micro, grad_clip: float) -> None:  # type: ignore[no-untyped-def]
    import torch

    from flywheel.learner.model import token_logprobs

    optimizer.zero_grad(set_to_none=True)
    total = sum(float(p.mask.sum()) for p, _ in micro)
    for packed, adv in micro:
        # the same forward and completion-token gather the learner uses (learner.model.token_logprobs),
        # so the ratio measures the learner's machinery, not a cheaper log-softmax
        logp = token_logprobs(policy.module, packed)  # [B, T]
        loss = -(logp * packed.mask * adv[:, None]).sum() / total
        loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in policy.module.parameters() if p.requires_grad], grad_clip)
    optimizer.step()


def _served_after(url: str, name: str, timeout_s: float = 30.0) -> None:
    body = json.dumps({"model": name, "prompt": [1, 5, 6], "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=timeout_s).read()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _unload(url: str, name: str) -> None:
    req = urllib.request.Request(f"{url}/v1/unload_lora_adapter", data=json.dumps({"lora_name": name}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=30).read()
    except Exception:
        pass


def main(argv: list[str] | None = None) -> int:
    cfg = load_config(LearnerBenchConfig, argv, "flywheel bench learner")
    setup_logging("WARNING")
    import torch
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from bench.fixtures.episodes import random_rows, write_episodes
    from flywheel import stack
    from flywheel.learner.config import LearnerConfig
    from flywheel.learner.daemon import Learner
    from flywheel.learner.metrics import Tracker
    from flywheel.learner.model import load_policy, pack

    console = Console(stderr=True)
    stack_cfg = stack.load_stack_config([])
    started = stack.ensure_up(stack_cfg, parts=["vllm"])
    url = stack_cfg.vllm_url
    work = Path(tempfile.mkdtemp(prefix="bench-learner-"))
    start_version = 10**8 + uuid.uuid4().int % (9 * 10**8)  # adapter names of their own on the shared server
    names: list[str] = []
    try:
        n_batches = cfg.steps + 1 + cfg.publishes
        for i in range(n_batches):
            write_episodes(work / "lake", random_rows(cfg.batch_size, seed=i, prompt_len=cfg.prompt_len,
                                                      completion_len=cfg.completion_len,
                                                      policy_version=start_version), seq=i)
        lcfg = LearnerConfig(lake_root=str(work / "lake"), base_model=cfg.base_model, run_dir=str(work / "run"),
                             policies_dir=str(work / "policies"), var_dir=str(work / "var"), device="cpu",
                             mlflow_tracking_uri=cfg.mlflow_tracking_uri, experiment="flywheel-bench-learner",
                             registered_model="flywheel-bench-learner", vllm_url=url, mode=cfg.mode,
                             batch_size=cfg.batch_size, min_batch=cfg.batch_size, micro_batch=cfg.micro_batch,
                             start_version=start_version, publish_every_steps=0, parity_samples=0, lr=1e-4,
                             status_name="bench-learner",
                             max_staleness_steps=n_batches)  # every row is the start version's: none may go stale
        lcfg.check()
        learner = Learner(lcfg)
        tracker = Tracker(lcfg)
        bare = load_policy(lcfg)  # same base, same seed: the same LoRA initialisation
        bare_opt = torch.optim.AdamW(bare.trainable_parameters(), lr=lcfg.lr)
        never = threading.Event()  # the bench never stops the stream early
        learner_s: list[float] = []
        train_s: list[float] = []  # the learner's forward/backward/step alone (no stream, log, checkpoint)
        bare_s: list[float] = []
        tokens = cfg.batch_size * (cfg.prompt_len + cfg.completion_len)
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("steps (learner | bare, interleaved)", total=cfg.steps + 1)
            # the bare loop reads the same lake files through its own stream: the same batches, in order
            from flywheel.learner.data import EpisodeStream

            bare_stream = EpisodeStream(lcfg.lake_root, bare.vocab_size, lcfg.max_seq_len)
            bare_stream.poll()
            for i in range(cfg.steps + 1):

                def learner_step() -> float:
                    t0 = time.perf_counter()
                    got = learner.next_batch(never)
                    assert got is not None
                    result = learner.train_step(learner.plan(got[0]))
                    learner.finish_step(got[0], got[1], result, tracker)
                    train_s.append(result.seconds)
                    return time.perf_counter() - t0

                def bare_step() -> float:
                    batch, _ = bare_stream.take(cfg.batch_size, {start_version: 0}, lcfg.max_staleness_steps)
                    t0 = time.perf_counter()
                    adv = torch.tensor([e.reward - 0.5 for e in batch])
                    micro = [(pack(batch[j:j + cfg.micro_batch], bare.device), adv[j:j + cfg.micro_batch])
                             for j in range(0, len(batch), cfg.micro_batch)]
                    _bare_step(bare, bare_opt, micro, lcfg.grad_clip)
                    return time.perf_counter() - t0

                # alternate which goes first, so neither always meets the same state of a shared CPU
                if i % 2 == 0:
                    a, b = learner_step(), bare_step()
                else:
                    b, a = bare_step(), learner_step()
                if i > 0:  # the first step of each warms allocators and caches
                    learner_s.append(a)
                    bare_s.append(b)
                else:
                    train_s.clear()
                progress.advance(task)
        publish_s: list[float] = []
        for _ in range(cfg.publishes):
            got = learner.next_batch(never)
            assert got is not None
            result = learner.train_step(learner.plan(got[0]))
            learner.finish_step(got[0], got[1], result, tracker)
            t0 = time.perf_counter()  # step finished (checkpointed)
            learner.versions.write()
            learner.save_checkpoint()
            out = learner.versions.push(learner.last_batch)
            if "publish_s" not in out:
                raise RuntimeError("publish failed; see the log above")
            name = version_name(learner.state.policy_version)
            names.append(name)
            _served_after(url, name)
            publish_s.append(time.perf_counter() - t0)
        tracker.end("FINISHED")
    finally:
        for name in names:
            _unload(url, name)
        if started:
            stack.down(stack_cfg, parts=started)
    lt, bt, pt = statistics.median(learner_s), statistics.median(bare_s), statistics.median(publish_s)
    figures = {
        "tokens_per_s": round(tokens / lt, 1), "bare_tokens_per_s": round(tokens / bt, 1),
        "ratio": round(bt / lt, 3), "publish_s": round(pt, 3), "learner_step_s": round(lt, 3),
        "bare_step_s": round(bt, 3), "learner_train_s": round(statistics.median(train_s), 3), "publish_s_max": round(max(publish_s), 3), "steps": cfg.steps,
        "batch_episodes": cfg.batch_size, "tokens_per_batch": tokens, "mode": cfg.mode,
    }
    table = Table(title=f"learner step vs bare torch loop ({cfg.mode}, {cfg.batch_size} episodes x "
                        f"{cfg.prompt_len}+{cfg.completion_len} tokens, median of {cfg.steps})")
    table.add_column("variant")
    table.add_column("step s", justify="right")
    table.add_column("tokens/s", justify="right")
    table.add_row("learner step (stream, loss, log, checkpoint, MLflow)", f"{lt:.3f}", f"{tokens / lt:,.0f}")
    ts = statistics.median(train_s)
    table.add_row("  of which forward/backward/step", f"{ts:.3f}", f"{tokens / ts:,.0f}")
    table.add_row("bare forward/backward/step", f"{bt:.3f}", f"{tokens / bt:,.0f}")
    table.add_row("ratio learner / bare", "", f"{bt / lt:.3f}  (target >= 0.85)")
    table.add_row(f"step -> served (median of {len(publish_s)})", f"{pt:.3f}", "(target < 2 s)")
    Console().print(table)
    print(json.dumps(figures))
    return 0
