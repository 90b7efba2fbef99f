"""The swarm's pre-flight in the suite (issue 39): from a swarm warm start, splitting pays and the base sometimes
splits, so RL on the swarm's outcomes has a choice to sharpen. No stack: `swarm_preflight.run` samples a local
transformers copy of each model as vLLM serves it, through the swarm's own harness, seeded.

The models are the suite's swarm builds (conftest.BackgroundBuild, shared with test_swarm_loop): the demo's warm
start rule and action share (a fifth of the draws) in 150 steps of 32 demonstrations where the demo takes 600, and
the sub-agents' one-lookup rule in 300 steps of 16; about 6 minutes of two threads where the demo's two builds take
about 17. Which smaller builds keep the bar and which do not, and the demo's own builds checked by hand
(`flywheel swarm-preflight`), are measured in docs/swarm.md, "In the suite".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

from flywheel import stack as stack_mod
from flywheel.demo import swarm, swarm_preflight, warm_start

# the build it waits for: ~6 minutes on two threads, at idle priority from the session's start; the pre-flight ~35-50 s
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_forced_spawn_beats_forced_serial_by_25_points_and_the_base_spawns_on_30_to_70_percent(
        tmp_path: Path, background_build: Callable[[str], Path]) -> None:
    built = background_build("test_swarm_preflight_builds.py")
    base = Path(stack_mod.load_stack_config([]).base_model)  # the base conftest built the models from
    warm, subagents = built / "warm", built / "subagent"
    assert warm_start.is_current(warm, base, rule=swarm.warm_rule()), "the policy was built from another base or rule"
    assert warm_start.is_current(subagents, base, rule=swarm.subagent_rule()), "sub-agents: another base or rule"
    record = json.loads((warm / "warm_start.json").read_text())
    assert (record["settings"]["max_steps"], record["settings"]["batch_size"]) == (150, 32), record["settings"]

    # the bar, as SwarmPreflightConfig's defaults hold it: 80 requests of 2 and of 3 parts, a gap of 25
    # points at each, the unforced openings within 30-70%
    cfg = swarm_preflight.SwarmPreflightConfig(model=warm, subagent_model=subagents, base_model=base, seed=0,
                                               out=tmp_path / "preflight.json")
    assert (cfg.requests, cfg.min_gap, cfg.spawn_lo, cfg.spawn_hi) == (80, 0.25, 0.3, 0.7)
    result = swarm_preflight.run(cfg)
    table = swarm_preflight.table(result)
    assert result["passed"], f"{result['failed']}\n{table}"
    for n in ("2", "3"):
        figures = result["by_parts"][n]
        assert figures["spawn"]["sessions"] == figures["serial"]["sessions"] == 80, table
        # forced spawn always opened with the spawn; forced serial's spawning replies were resampled away (an opening
        # counts as given after 10 spawning draws: at this build's ~40% about one session in ten thousand)
        assert figures["spawn"]["opening_spawn"] == 1.0 and figures["serial"]["opening_spawn"] <= 0.05, table
