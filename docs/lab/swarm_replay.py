"""Lab: replay a swarm run's first version under other learner settings, and run each result offline.

Run sw2's v1 split most multi-part openings and broke its calls in long sessions; was it the KL coefficient? This
script answers such a question without a 40-minute run:

1. the learner, as the swarm recipe runs it (sw2's flags), trains STEPS steps on a finished run's lake, once per
   variant (extra learner flags), writing its first version (--no-publish: the directory only);
2. each version, and policy-v0, runs the same seeded sessions offline through the swarm's own harness
   (`swarm.SwarmSession`, as `flywheel swarm-preflight` does: transformers, temperature 1, the frozen sub-agents for
   the spawned pieces), half multi-part and half long sessions: per kind, success, spawn share and the share of the
   orchestrator's tool calls that were malformed.

    .venv/bin/python docs/lab/swarm_replay.py RUN_DIR WARM_DIR SUBAGENT_DIR N 'name:--kl-coef 0.1' 'name:--kl-coef 1'

RUN_DIR is var/demo/<run id> of a finished swarm run, WARM_DIR its policy-v0 (var/models/tiny-swarm-warm). The replay
is not the online run: the lake holds every version's rows and the learner reads them newest first, so read a variant
against the others, not against the run. Not part of the package and not tested; session 38's table in docs/swarm.md
came from it (N 80, 20 steps, sw2's lake).
"""
import json
import random
import shutil
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

from flywheel.demo import swarm, tasks
from flywheel.demo import swarm_preflight as sp

STEPS = 20
LEARNER = ("--batch-size 64 --min-batch 64 --micro-batch 32 --newest-first --max-staleness-steps 60 --opening-share 0.5 "
           "--loss tis --tis-cap 2.0 --loss-agg sequence --baseline batch --group-relative --normalize-advantages "
           "--positive-only --kl-coef 0.1 --kl-estimator exact --kl-rows all --shaping-anneal-start-step 0 "
           "--shaping-anneal-end-step 40 --mode full --lr 0.0004 --warmup-steps 10 --grad-clip 1.0 --seed 0 "
           "--cpu-threads 2 --no-publish --no-follow-gate --no-publish-wait-for-gate --parity-samples 0 "
           "--idle-exit-s 60").split() + ["--mlflow-tracking-uri", ""]


def probe(model: Path, subagents: Path, n: int) -> dict:
    """n multi-part and n long sessions (seed 1) through the harness: success, spawn share, malformed share per kind."""
    cfg = sp.SwarmPreflightConfig(model=model, subagent_model=subagents, requests=n, seed=1)
    sample, subs = sp._load(model, cfg), sp._load(subagents, cfg)
    rng = random.Random(1)
    reqs = [swarm.make_swarm_task(rng, long_share=0.5) for _ in range(2 * n)]
    calls, bad, done, ok, spawned = Counter(), Counter(), Counter(), Counter(), Counter()
    step = sp.Lockstep(sample, len(reqs), subs)

    def one(i: int, task: swarm.SwarmTask) -> None:
        class Counting(sp.QuietAgent):
            def tool_call(self, name, arguments, malformed=None, malformed_token=None):  # type: ignore[no-untyped-def]
                if self.agent_id == "main":  # the orchestrator's own calls (sub-agents are frozen)
                    calls[task.kind] += 1
                    bad[task.kind] += bool(malformed)
                return super().tool_call(name, arguments, malformed, malformed_token)

        main = Counting()
        try:
            result = swarm.SwarmSession(task, main, lambda agent, messages: swarm.Reply(
                step.ask(i, messages, "policy" if agent is main else "subagent")), swarm.SwarmLimits()).run()
            done[task.kind] += 1
            ok[task.kind] += all(tasks.check_part(p, a) for p, a in zip(task.spec.parts, result.answers))
            spawned[task.kind] += result.spawned > 0
        finally:
            step.done()

    threads = [threading.Thread(target=one, args=(i, t), daemon=True) for i, t in enumerate(reqs)]
    for t in threads:
        t.start()
    step.drive()
    for t in threads:
        t.join()
    return {k: {"sessions": done[k], "success": round(ok[k] / max(1, done[k]), 3),
                "spawn": round(spawned[k] / max(1, done[k]), 3), "malformed": round(bad[k] / max(1, calls[k]), 3),
                "calls": calls[k]} for k in ("multi", "long")}


def replay(run_dir: Path, warm: Path, name: str, flags: list[str], out: Path) -> Path:
    """STEPS learner steps on run_dir's lake with flags (later flags win); its version 1 with warm's tokenizer."""
    policies = out / f"policies-{name}"
    shutil.rmtree(policies, ignore_errors=True)
    cmd = [str(Path(sys.executable).with_name("flywheel")), "learner", "--lake-root", str(run_dir / "lake"),
           "--base-model", str(warm), "--run-dir", str(out / f"learner-{name}"), "--policies-dir", str(policies),
           "--var-dir", str(out / f"var-{name}"), "--max-steps", str(STEPS), "--publish-every-steps", str(STEPS),
           *LEARNER, *flags]
    with open(out / f"learner-{name}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    model = out / f"model-{name}"  # the published directory holds weights and config; the chat template is warm's
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(warm, model)
    for f in ("model.safetensors", "config.json"):
        shutil.copy(policies / "policy-v1" / f, model / f)
    return model


def main() -> None:
    run_dir, warm, subagents, n = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    out = Path("var/lab/swarm_replay")
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"variant": "policy-v0", **probe(warm, subagents, n)}), flush=True)
    for spec in sys.argv[5:]:
        name, _, flags = spec.partition(":")
        model = replay(run_dir, warm, name, flags.split(), out)
        print(json.dumps({"variant": name, "flags": flags, **probe(model, subagents, n)}), flush=True)


if __name__ == "__main__":
    main()
