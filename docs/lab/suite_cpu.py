"""Lab: where `make test`'s wall time and CPU go, by test and by kind of process (issue 35).

The suite is measured on 2 cores, where a test's wall time and its CPU are different questions: a test waiting on a
broker outage holds the run but leaves the cores to the background builds, a 3-minute demo run keeps both busy. This
script samples every process's cumulative CPU every 5 s (from /proc) and, with each test's start time from the
pytest plugin beside it (suite_tlog.py), attributes each interval's CPU to the test running and to a kind of
process: vllm, kafka, mlflow, s3proxy, the pytest process itself, its other children, and each background build
(tests/integration/conftest.py's BackgroundBuild) with its children.

    python3 docs/lab/suite_cpu.py sample /tmp/samples.jsonl &      # before the run; kill it after
    CI=true TLOG=/tmp/tests.tlog PYTHONPATH=docs/lab make test PYTEST=".venv/bin/python -m pytest -p suite_tlog"
    python3 docs/lab/suite_cpu.py report /tmp/samples.jsonl /tmp/tests.tlog

The report: the span, the CPU used of what two cores give, CPU by kind, then per test (setup, call and teardown
together) its wall seconds, CPU seconds, idle core-seconds (cores x wall - CPU) and build CPU. Only a process's own
time is read (utime + stime, not its reaped children's), so a process that lives between two samples, and the last
seconds of every process before it exits, are not counted: the figures are lower bounds, rough for short tests;
the minutes-long items are what it is for. Not part of the package and not tested; session 40's
figures in docs/CONTRIBUTING.md ("Where the suite's time goes") came from it.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import sys
import time
from typing import Any

HZ = os.sysconf("SC_CLK_TCK")
BUILDS = {"warm_start_model": "build-swarm", "model init --warm-start": "build-demo-warm", "quix_python": "build-quix",
          "ModelFetchConfig": "build-smollm"}


def sample(out_path: str, every_s: float = 5.0) -> None:
    """Append {"t", "cores", "p": {"pid:start": [cpu ticks, (first sight) "comm | cmdline", ppid]}} lines until
    killed. A process is keyed by its pid and start time: pids are reused over a 40-minute run."""
    seen: set[str] = set()
    with open(out_path, "a") as out:
        while True:
            procs: dict[str, list[Any]] = {}
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        stat = f.read()
                    fields = stat[stat.rindex(")") + 2:].split()
                    ticks = int(fields[11]) + int(fields[12])  # utime + stime
                    key = f"{pid}:{fields[19]}"  # starttime
                    if ticks == 0:
                        continue
                    if key in seen:
                        procs[key] = [ticks]
                        continue
                    with open(f"/proc/{pid}/cmdline", "rb") as f:  # whole: a build's needle is deep in its -c code
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                    with open(f"/proc/{pid}/comm") as f:
                        comm = f.read().strip()
                    procs[key] = [ticks, f"{comm} | {cmd}", int(fields[1])]
                    seen.add(key)
                except (OSError, ValueError, IndexError):
                    continue  # gone between listdir and open
            out.write(json.dumps({"t": time.time(), "cores": os.cpu_count(), "p": procs}) + "\n")
            out.flush()
            time.sleep(every_s)


def _own_kind(cmd: str) -> str | None:
    for needle, kind in BUILDS.items():
        if needle in cmd:
            return kind
    low = cmd.lower()
    if ("vllm" in low and "api_server" in low) or low.startswith("vllm::"):
        return "vllm"
    if "java" in low:
        return "s3proxy" if "s3proxy" in low else "kafka" if "kafka" in low else None
    if "mlflow" in low or "huey" in low or "uvicorn" in low:
        return "mlflow"
    if "pytest" in low and "python" in low:
        return "pytest"
    return None


class Kinds:
    """A pid's kind: its own command's, else its parent's (a build's or a server's children are the build's or the
    server's; the pytest process's other children are "test-child")."""

    def __init__(self, info: dict[str, tuple[str, int]]) -> None:
        self.info = info  # "pid:start" -> (command, ppid)
        self.by_pid = {key.split(":")[0]: key for key in info}  # a parent by its pid: the latest process of that pid
        self.cache: dict[str, str] = {}

    def __call__(self, key: str, depth: int = 0) -> str:
        if key not in self.cache:
            cmd, ppid = self.info.get(key, ("", 0))
            own = _own_kind(cmd)
            parent_key = self.by_pid.get(str(ppid))
            parent = self(parent_key, depth + 1) if parent_key and depth < 30 else "other"
            if own == "pytest":
                kind = "pytest" if parent == "other" else parent  # a pytest under a build is the build's
            elif own is not None:
                kind = own
            elif parent in ("pytest", "test-child"):
                kind = "test-child"
            else:
                kind = parent
            self.cache[key] = kind
        return self.cache[key]


def report(samples_path: str, tlog_path: str) -> None:
    samples = []
    for line in open(samples_path):
        try:
            samples.append(json.loads(line))
        except json.JSONDecodeError:  # the sampler killed mid-line
            break
    if len(samples) < 2:
        raise SystemExit(f"{samples_path}: fewer than two samples")
    info = {key: (v[1], v[2]) for s in samples for key, v in s["p"].items() if len(v) > 1}
    kind = Kinds(info)
    marks = [(float(t), what, node.strip()) for t, what, node in (line.split(" ", 2) for line in open(tlog_path))]
    # a test's interval runs to the next test's start; after the last test's end, the session's own teardown
    starts = [(t, node) for t, what, node in marks if what == "start"] + [(marks[-1][0], "(after the last test)")]
    times = [t for t, _ in starts]
    cores = samples[-1].get("cores") or os.cpu_count() or 1
    wall: collections.Counter[str] = collections.Counter()
    cpu: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total: collections.Counter[str] = collections.Counter()
    last: dict[str, int] = {}
    for i, s in enumerate(samples):
        j = bisect.bisect_right(times, s["t"]) - 1
        node = starts[j][1] if j >= 0 else "(before the first test)"
        if i:
            wall[node] += s["t"] - samples[i - 1]["t"]
        for key, v in s["p"].items():
            delta = v[0] - last.get(key, 0 if i else v[0])  # a process first seen after the start: all its ticks
            last[key] = v[0]
            if delta > 0:
                cpu[node][kind(key)] += delta / HZ
                total[kind(key)] += delta / HZ
    span = samples[-1]["t"] - samples[0]["t"]
    print(f"span {span:.0f} s; of {cores * span:.0f} core-s ({cores} cores), {sum(total.values()):.0f} used")
    for k, v in total.most_common():
        print(f"  {k:16s} {v:7.0f}")
    print(f"\n{'test':90s} {'wall':>5s} {'cpu':>5s} {'idle':>5s} {'build':>5s}  top kinds")
    for node, w in wall.most_common(40):
        c = cpu[node]
        build = sum(v for k, v in c.items() if k.startswith("build"))
        top = " ".join(f"{k}={v:.0f}" for k, v in c.most_common(4) if not k.startswith("build"))
        used = sum(c.values())
        print(f"{node[-90:]:90s} {w:5.0f} {used:5.0f} {cores * w - used:5.0f} {build:5.0f}  {top}")


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "sample":
        sample(argv[1])
    elif len(argv) == 3 and argv[0] == "report":
        report(argv[1], argv[2])
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
