"""The reward configuration of one deployment, read from one TOML file (default: rewards/rewards.toml).

It says, per outcome kind, what a value is worth and how long to wait for it; per task type,
which outcomes an episode waits for, whether the LLM judge scores it and with which rubric;
the PARL shaping weights and their annealing schedule; penalties; and the join's timing rules.
Everything the builder decides about a missing or late signal is written here, never guessed.

Unknown keys are rejected by name, so a typo cannot silently switch a reward off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_TOML = Path(__file__).with_name("rewards.toml")
ANNEAL_CLOCKS = ("policy_version", "learner_step")  # what [parl] anneal_start/anneal_end count
MISSING_POLICIES = ("drop", "ignore")  # besides a number: the value a missing outcome counts as
JUDGE_OUTPUTS = ("json_schema", "choice")  # how the judge's answer is constrained (rewards/judge.py)


class RewardConfigError(ValueError):
    """The reward TOML is invalid; the message names the table and key."""


@dataclass(frozen=True)
class OutcomeKind:
    """How one outcome kind becomes reward."""

    name: str
    weight: float = 1.0  # multiplies the kind's score in r_outcome
    window_s: float = 3600.0  # maturity window, from session end: how long an episode waits for this kind
    # What a required kind that never arrived within its window means: a number (its score),
    # "drop" (the session is not emitted at all) or "ignore" (it contributes nothing).
    missing: float | str = "ignore"
    # Binary kinds (Cursor Tab: accepted +0.75, rejected -0.25): value >= threshold scores if_true,
    # otherwise if_false. Without if_true/if_false the raw value is the score, clipped to [lo, hi].
    if_true: float | None = None
    if_false: float | None = None
    threshold: float = 0.5
    lo: float = -1.0
    hi: float = 1.0

    def score(self, value: float) -> float:
        if self.if_true is not None and self.if_false is not None:
            return self.if_true if value >= self.threshold else self.if_false
        return min(self.hi, max(self.lo, value))


@dataclass(frozen=True)
class TaskType:
    """Rules for one task family."""

    name: str
    wait_for: tuple[str, ...] = ()  # outcome kinds label 1 waits for (up to each kind's window)
    judge: bool = False  # score the session with the LLM judge
    rubric: str = "default"  # key into [rubrics]
    # r_judge = judge_weight * (score - 3) / 2 (None: [judge].weight). 0 is shadow mode: the score is computed
    # and stored (episodes.judge_score) but never enters the reward, so the judge can be calibrated first
    judge_weight: float | None = None
    judge_sample: float = 1.0  # share of sessions judged, chosen by a hash of session_id (a re-run picks the same)
    # per-turn credit: outcome kinds that verify ONE tool call (reported with its call_id). The llm_call
    # that produced a verified call is rewarded by that check (r_turn) instead of the session's outcome,
    # and with turn kinds set a malformed call is a verified failure of its turn (r_turn 0).
    turn_kinds: tuple[str, ...] = ()


@dataclass(frozen=True)
class Rubric:
    name: str
    version: str  # part of the judge cache key: edit the text, bump the version
    text: str


@dataclass(frozen=True)
class JudgeSettings:
    """The LLM judge's client and budgets (rewards/judge.py; the endpoint, model and API key are process settings)."""

    model: str = "policy-v0"  # served model name at the judge endpoint (the builder's --judge-model overrides it)
    timeout_s: float = 10.0  # per request
    weight: float = 0.5  # r_judge = weight * (score - 3) / 2 for a task type without its own judge_weight
    # transcript budget in tokens, estimated as UTF-8 bytes / chars_per_token (rewards/transcript.py)
    max_tokens: int = 1000
    chars_per_token: float = 4.0  # the estimate's ratio: about 4 for hosted models' tokenizers, under 2 for a tiny BPE
    # "json_schema": response_format (OpenAI, vLLM, SGLang); "choice": vLLM's structured_outputs
    output: str = "json_schema"
    reason_chars: int = 0  # 0: the judge answers a score only; > 0: also a reason of about this many characters
    # JSON grammars allow any whitespace between tokens, and a weak judge at temperature 0 can emit newlines until
    # max_tokens (the tiny model cut every answer at '{"score"\n\n...'); an OpenAI-standard frequency penalty of 1
    # ended every such run in tests/integration/test_judge.py. 0 leaves the judge's distribution untouched
    frequency_penalty: float = 1.0
    concurrency: int = 2  # judge requests in flight at once
    # retries within a request of a timeout, connection error, 429 or 5xx (never other 4xx), with backoff
    retries: int = 2
    backoff_s: float = 0.5  # wait before the first retry, doubled for each next one
    # judge time per builder pass; sessions past it are recorded "budget" and retried on a later pass
    budget_s: float = 60.0
    max_calls: int = 0  # judge requests per pass (0: no limit); sessions past it as for budget_s
    max_attempts: int = 3  # passes a session whose judge failed retryably (timeout, 429/5xx, budget) is tried on
    retry_after_s: float = 60.0  # a failed session is tried again on a pass this long later, doubled per failed attempt
    retry_queue: int = 1000  # sessions waiting for a judge retry at most; past it the oldest are given up


@dataclass(frozen=True)
class ParlSettings:
    """PARL shaping: r = lambda1 * r_parallel + lambda2 * r_finish + r_outcome, lambdas annealed to 0."""

    # off while the harness, not the policy, decides to spawn: shaping a decision the policy does not take
    # only adds a constant to some rows (the swarm scenario makes spawning a model action)
    enabled: bool = True
    lambda1: float = 0.1  # weight of r_parallel at the start of the schedule
    lambda2: float = 0.1  # weight of r_finish at the start of the schedule
    parallel_cap: int = 4  # r_parallel = min(sub-agents, cap) / cap, so spawning more than cap earns nothing
    anneal_start: int = 0  # policy version where annealing starts (full lambdas up to here)
    anneal_end: int = 20  # policy version where both lambdas reach exactly 0
    # the schedule's clock: "policy_version" (anneal_start/anneal_end above, applied by the builder) or
    # "learner_step" (the builder writes the full lambdas; the learner anneals the terms by its own step,
    # learner flags --shaping-anneal-start-step/--shaping-anneal-end-step)
    anneal_clock: str = "policy_version"
    # r_finish counts the sub-agents whose own part was verified: an outcome of this kind reported with the
    # child's agent_id, at or above finish_threshold. A child that merely returned text earns nothing.
    finish_kind: str = "task_success"
    finish_threshold: float = 1.0


@dataclass(frozen=True)
class PenaltySettings:
    malformed_tool_call: float = -0.5  # added to the llm_call that produced a malformed tool call (<= 0)
    # added to the llm_call that decided a prune when the checker reports (outcome kind harmful_edit_kind, with
    # the prune call's call_id, value >= 0.5) that the session failed and the prune removed what the answer needed
    harmful_prune: float = -0.5
    harmful_edit_kind: str = "prune_harmful"


@dataclass(frozen=True)
class JoinSettings:
    # after session_end, wait this long past the session's newest event before labelling: the proxy's
    # llm_call events and the SDK's session_end travel as different producers and may arrive out of order
    end_grace_s: float = 0.0
    session_idle_timeout_s: float = 3600.0  # a session with no session_end ends this long after its last event
    unknown_session_hold_s: float = 3600.0  # an outcome for a session never seen is held this long, then dropped
    relabel_horizon_s: float = 7 * 86400.0  # after session end, outcomes still append a label for this long


@dataclass(frozen=True)
class RewardConfig:
    outcomes: dict[str, OutcomeKind]
    task_types: dict[str, TaskType]
    rubrics: dict[str, Rubric]
    judge: JudgeSettings = field(default_factory=JudgeSettings)
    parl: ParlSettings = field(default_factory=ParlSettings)
    penalties: PenaltySettings = field(default_factory=PenaltySettings)
    join: JoinSettings = field(default_factory=JoinSettings)
    source: str = ""  # the file it came from
    digest: str = ""  # sha256 of the file's text, recorded in reward_detail so a label can be traced to its rules

    def task(self, task_type: str | None) -> TaskType:
        """The rules of a task type; a dotted type without its own table uses its parent's
        (tool_use.add -> tool_use), and unknown task types use [task_types.default].

        Dotted types let an agent name a finer family than its reward rules need: the learner's
        baseline is kept per task_type, so tool_use.add rows are compared with tool_use.add rows.
        """
        name = task_type or "default"
        while name not in self.task_types and "." in name:
            name = name.rsplit(".", 1)[0]
        return self.task_types.get(name) or self.task_types["default"]

    def kind(self, name: str) -> OutcomeKind | None:
        return self.outcomes.get(name)

    def judge_weight(self, task: TaskType) -> float:
        """The weight of a task type's judge score in its reward (0: shadow mode)."""
        return self.judge.weight if task.judge_weight is None else task.judge_weight


def _build(cls: type, table: dict[str, Any], where: str, **extra: Any) -> Any:
    names = {f.name for f in dataclasses.fields(cls)} - set(extra)
    unknown = sorted(set(table) - names)
    if unknown:
        raise RewardConfigError(f"[{where}]: unknown key(s) {unknown}; known: {sorted(names)}")
    values = dict(extra)
    for f in dataclasses.fields(cls):
        if f.name not in table:
            continue
        value = table[f.name]
        if isinstance(value, list):
            value = tuple(value)
        values[f.name] = value
    try:
        return cls(**values)
    except TypeError as exc:
        raise RewardConfigError(f"[{where}]: {exc}") from exc


def _check_number(where: str, name: str, value: Any, lo: float | None = None, hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardConfigError(f"{where}.{name}: expected a number, got {value!r}")
    if lo is not None and value < lo:
        raise RewardConfigError(f"{where}.{name}: must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise RewardConfigError(f"{where}.{name}: must be <= {hi}, got {value}")


def _check_task_types(task_types: dict[str, TaskType], outcomes: dict[str, OutcomeKind],
                      rubrics: dict[str, Rubric]) -> None:
    for name, t in task_types.items():
        for kind in t.wait_for:
            if kind not in outcomes:
                raise RewardConfigError(f"task_types.{name}.wait_for: outcome kind {kind!r} has no "
                                        f"[outcomes.{kind}] table")
        for kind in t.turn_kinds:
            if kind not in outcomes:
                raise RewardConfigError(f"task_types.{name}.turn_kinds: outcome kind {kind!r} has no "
                                        f"[outcomes.{kind}] table")
            if kind in t.wait_for:
                raise RewardConfigError(f"task_types.{name}: {kind!r} is in both wait_for and turn_kinds (a turn check "
                                        "is about one call, label 1 waits for session outcomes)")
        if t.rubric not in rubrics:
            raise RewardConfigError(f"task_types.{name}.rubric: no [rubrics.{t.rubric}] table")


def _check_judge(judge: JudgeSettings, task_types: dict[str, TaskType]) -> None:
    _check_number("judge", "timeout_s", judge.timeout_s, lo=0.001)
    _check_number("judge", "budget_s", judge.budget_s, lo=0)
    _check_number("judge", "weight", judge.weight)
    _check_number("judge", "chars_per_token", judge.chars_per_token, lo=0.1)
    _check_number("judge", "frequency_penalty", judge.frequency_penalty, lo=-2, hi=2)
    for name in ("max_tokens", "concurrency", "max_attempts"):
        _check_number("judge", name, getattr(judge, name), lo=1)
    for name in ("reason_chars", "retries", "backoff_s", "max_calls", "retry_queue", "retry_after_s"):
        _check_number("judge", name, getattr(judge, name), lo=0)
    if judge.output not in JUDGE_OUTPUTS:
        raise RewardConfigError(f"judge.output: {judge.output!r} is not one of {JUDGE_OUTPUTS}")
    for name, t in task_types.items():
        if t.judge_weight is not None:
            _check_number(f"task_types.{name}", "judge_weight", t.judge_weight)
        _check_number(f"task_types.{name}", "judge_sample", t.judge_sample, lo=0, hi=1)


def _with_base(doc: dict[str, Any], source: str) -> tuple[dict[str, Any], str]:
    """The document merged over the one its `extends` names ("default": the packaged rewards.toml; else a path
    relative to this file), and the base's text (part of the digest). A table's keys override the base's one by one."""
    base_name = doc.pop("extends", None)
    if base_name is None:
        return doc, ""
    if not isinstance(base_name, str):
        raise RewardConfigError(f"{source}: extends must be a string, got {base_name!r}")
    path = DEFAULT_TOML if base_name == "default" else Path(source).parent / base_name
    try:
        base_text = path.read_text()
        base = tomllib.loads(base_text)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RewardConfigError(f"{source}: extends {base_name!r}: {exc}") from exc
    if "extends" in base:
        raise RewardConfigError(f"{source}: extends {base_name!r}, which extends another file (one level only)")

    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        return {**a, **{k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                        for k, v in b.items()}}

    return merge(base, doc), base_text


def parse(text: str, source: str = "<string>") -> RewardConfig:
    """Parse and check a reward TOML document."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RewardConfigError(f"{source}: {exc}") from exc
    doc, base_text = _with_base(doc, source)
    known = {"outcomes", "task_types", "rubrics", "judge", "parl", "penalties", "join"}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise RewardConfigError(f"{source}: unknown table(s) {unknown}; known: {sorted(known)}")

    outcomes = {name: _build(OutcomeKind, t, f"outcomes.{name}", name=name)
                for name, t in doc.get("outcomes", {}).items()}
    for name, k in outcomes.items():
        where = f"outcomes.{name}"
        _check_number(where, "weight", k.weight)
        _check_number(where, "window_s", k.window_s, lo=0)
        if isinstance(k.missing, str) and k.missing not in MISSING_POLICIES:
            raise RewardConfigError(f"{where}.missing: {k.missing!r} is neither a number nor one of {MISSING_POLICIES}")
        if not isinstance(k.missing, str):
            _check_number(where, "missing", k.missing)
        if (k.if_true is None) != (k.if_false is None):
            raise RewardConfigError(f"{where}: if_true and if_false go together (got if_true={k.if_true}, "
                                    f"if_false={k.if_false})")

    rubrics = {name: _build(Rubric, t, f"rubrics.{name}", name=name) for name, t in doc.get("rubrics", {}).items()}
    if "default" not in rubrics:
        rubrics["default"] = Rubric("default", "1", "Rate how well the assistant completed the user's task.")

    task_types = {name: _build(TaskType, t, f"task_types.{name}", name=name)
                  for name, t in doc.get("task_types", {}).items()}
    task_types.setdefault("default", TaskType("default"))
    _check_task_types(task_types, outcomes, rubrics)
    judge = _build(JudgeSettings, doc.get("judge", {}), "judge")
    _check_judge(judge, task_types)
    parl = _build(ParlSettings, doc.get("parl", {}), "parl")
    if parl.parallel_cap < 1:
        raise RewardConfigError(f"parl.parallel_cap: must be >= 1, got {parl.parallel_cap}")
    if parl.anneal_clock not in ANNEAL_CLOCKS:
        raise RewardConfigError(f"parl.anneal_clock: {parl.anneal_clock!r} is not one of {ANNEAL_CLOCKS}")
    if parl.anneal_end <= parl.anneal_start:
        raise RewardConfigError(f"parl.anneal_end ({parl.anneal_end}) must be > parl.anneal_start "
                                f"({parl.anneal_start})")
    penalties = _build(PenaltySettings, doc.get("penalties", {}), "penalties")
    _check_number("penalties", "malformed_tool_call", penalties.malformed_tool_call, hi=0)
    _check_number("penalties", "harmful_prune", penalties.harmful_prune, hi=0)
    join = _build(JoinSettings, doc.get("join", {}), "join")
    for name in ("end_grace_s", "session_idle_timeout_s", "unknown_session_hold_s", "relabel_horizon_s"):
        _check_number("join", name, getattr(join, name), lo=0)
    max_window = max((k.window_s for k in outcomes.values()), default=0.0)
    if join.relabel_horizon_s < max_window:
        raise RewardConfigError(
            f"join.relabel_horizon_s ({join.relabel_horizon_s}) must be >= the longest outcomes.*.window_s "
            f"({max_window})"
        )
    return RewardConfig(outcomes, task_types, rubrics, judge, parl, penalties, join, source,
                        hashlib.sha256((base_text + text).encode()).hexdigest()[:16])


def load(path: str | Path | None = None) -> RewardConfig:
    """Load the reward TOML of a deployment (the packaged default when path is None or empty)."""
    p = Path(path) if path else DEFAULT_TOML
    try:
        text = p.read_text()
    except OSError as exc:
        raise RewardConfigError(f"rewards config {p}: {exc}") from exc
    return parse(text, str(p))
