"""Atomic learner checkpoints and the per-step log of trained episode ids.

Layout under run_dir:

    checkpoints/step-00000012/  state.json (step, policy_version, cursor, trained ids, baseline, lineage ...)
                                trainer.pt (trainable weights + optimizer state)
    checkpoints/LATEST          name of the newest complete checkpoint
    trained.jsonl               one line per finished step: {"step", "policy_version", "episode_ids"}

A checkpoint is written into a hidden temp directory, fsynced and renamed; only then does
LATEST (itself replaced atomically) point at it. A SIGKILL at any moment leaves either the old
or the new checkpoint complete, never half of one: weights, optimizer, cursor and trained ids
always come from one checkpoint. The learner writes one every checkpoint_every_steps steps, at
every version and at a graceful stop (learner/daemon.py), not after every step.

The trained log is appended (and fsynced) after every step, before any checkpoint of that step.
After a SIGKILL the learner resumes from the last checkpoint and trains the steps after it again,
from that checkpoint's weights and cursor, under the same step numbers: those steps (up to
checkpoint_every_steps of them) appear twice in the log, once per line of weights. No episode is
trained twice into the weights that go on; the earlier lines are of weights the kill discarded.
`trained_lineage` reads the log as the weights saw it: a line supersedes every earlier line of a step
number at or above its own.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.base.atomic import Durability, publish, temp_path, write_text

if TYPE_CHECKING:  # torch is loaded by the functions that write and read tensors: the log readers run without it
    import torch

log = logging.getLogger(__name__)

LATEST = "LATEST"


@dataclass
class TrainerState:
    """Everything besides tensors that a resumed learner needs."""

    step: int = 0
    policy_version: int = 0
    last_published_step: int = 0
    cursor: dict[str, int] = field(default_factory=dict)
    trained: dict[str, int] = field(default_factory=dict)  # episode_id -> label_version
    baseline: dict[str, float] = field(default_factory=dict)
    published: list[int] = field(default_factory=list)
    # published versions the gate refused; their rows are not trained
    abandoned: list[int] = field(default_factory=list)
    # the episodes trained since the current version (versions.episode_range): the next version's lineage, kept
    # here so a restart between two publishes does not forget the steps before it
    since_parent: dict[str, Any] = field(default_factory=dict)
    # the learner's line (staleness by lineage): each version the current weights descend from -> the step at
    # which the weights were at it, so a row served by it lags `step - lineage[v]` steps. A publish enters the
    # new version at its step; a rebase keeps only the target and its ancestors (rebase_line). A version not
    # here (abandoned, or never this learner's) serves only stale rows.
    lineage: dict[int, int] = field(default_factory=dict)
    # the step the current line began at: 0, or the step of the last rebase; the lr warm-up counts from it
    line_start_step: int = 0
    kl_coef: float = 0.0  # the adaptive KL coefficient now (kl_target); 0: not adapted yet, the config's kl_coef

    def __post_init__(self) -> None:
        # JSON keys are text. A checkpoint from before the lineage map starts one with the current version at
        # last_published_step (exact: a publish and a rebase both set it); the older versions of its published
        # list are left off (their steps were not kept), so their rows count as stale after the upgrade.
        self.lineage = ({int(v): int(s) for v, s in self.lineage.items()}
                        or {self.policy_version: self.last_published_step})

    def lags(self) -> dict[int, int]:
        """Version on the line -> learner steps from the weights that served it to the current weights."""
        return {v: self.step - at for v, at in self.lineage.items()}

    def rebase_line(self, version: int) -> None:
        """The line after a rebase onto `version` at the current step: it at lag 0, its ancestors as many steps
        behind it as before, and nothing of the line above it (those weights were left)."""
        at = self.lineage.get(version)
        if at is None:  # a champion this learner never published on its line: only it is known
            self.lineage = {version: self.step}
            return
        shift = self.step - at
        # version numbers grow along a line (each publish takes max + 1), so the ancestors are the lower ones
        self.lineage = {v: s + shift for v, s in self.lineage.items() if v <= version}


def save(run_dir: Path, state: TrainerState, weights: dict[str, torch.Tensor], optimizer: dict[str, Any],
         keep: int = 2) -> Path:
    """Write a complete checkpoint atomically and point LATEST at it; returns its directory."""
    import torch

    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step:08d}"
    tmp = temp_path(final)
    tmp.mkdir()
    torch.save({"weights": weights, "optimizer": optimizer}, tmp / "trainer.pt")
    (tmp / "state.json").write_text(json.dumps(asdict(state), sort_keys=True))
    if final.exists():  # the same step written again after a restart: replace it
        shutil.rmtree(final)
    publish(tmp, final, Durability.DURABLE_DIR)
    write_text(root / LATEST, final.name, Durability.DURABLE_DIR)  # the commit point
    _prune(root, keep, final.name)
    return final


def _prune(root: Path, keep: int, newest: str) -> None:
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
    for old in done[:-keep]:
        if old.name != newest:
            shutil.rmtree(old, ignore_errors=True)
    for tmp in root.glob(".*.tmp"):  # temp_path()s left by a killed writer; never pointed at by LATEST
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


def load_latest(run_dir: Path, map_location: str | torch.device = "cpu") -> tuple[TrainerState, dict[str, Any]] | None:
    """(state, {"weights", "optimizer"}) of the newest complete checkpoint, or None if there is none."""
    import torch

    found = latest_state(run_dir)
    if found is None:
        return None
    directory, state = found
    tensors = torch.load(directory / "trainer.pt", map_location=map_location, weights_only=True)
    log.info("checkpoint: resuming from %s (step %d, policy_version %d, %d episodes trained)", directory,
             state.step, state.policy_version, len(state.trained))
    return state, tensors


def latest_state(run_dir: Path) -> tuple[Path, TrainerState] | None:
    """(directory, state) of the newest complete checkpoint without its tensors, or None if there is none."""
    root = Path(run_dir) / "checkpoints"
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    directory = root / name
    return directory, TrainerState(**json.loads((directory / "state.json").read_text()))


def append_trained(run_dir: Path, step: int, policy_version: int, episode_ids: list[str],
                   extra: dict[str, Any] | None = None) -> None:
    """Append one step's trained episode ids (and `extra` fields) to trained.jsonl (fsynced)."""
    path = Path(run_dir) / "trained.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"step": step, "policy_version": policy_version, "episode_ids": episode_ids,
                       **(extra or {})}) + "\n"
    with open(path, "a+b") as fh:  # appends go to the end wherever the read position is
        size = fh.seek(0, os.SEEK_END)
        if size:
            fh.seek(size - 1)
            if fh.read(1) != b"\n":  # a line a kill cut short: end it, or this line would be unreadable with it
                line = "\n" + line
        fh.write(line.encode())
        fh.flush()
        os.fsync(fh.fileno())


def read_trained(run_dir: Path) -> list[dict[str, Any]]:
    """Every line of trained.jsonl (a torn last line from a kill mid-write is ignored)."""
    path = Path(run_dir) / "trained.jsonl"
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def trained_lineage(lines: list[dict[str, Any]], upto: int | None = None) -> list[dict[str, Any]]:
    """The lines of trained.jsonl (read_trained) whose steps made the weights, in step order.

    A restart resumes at its checkpoint's step s and logs the steps after it again, so a line at step s+1
    supersedes every line logged before it at a step >= s+1: the weights those steps trained were lost
    with the kill. upto: the step of the checkpoint the weights are at (latest_state), when the learner has
    stopped: lines above it trained weights no checkpoint kept (a kill, and no restart got as far again).
    """
    kept: list[dict[str, Any]] = []
    for line in lines:
        step = int(line["step"])
        while kept and int(kept[-1]["step"]) >= step:
            kept.pop()
        kept.append(line)
    return [line for line in kept if upto is None or int(line["step"]) <= upto]
