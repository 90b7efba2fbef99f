"""The SDK as agent developers use it: the short import path, the context-local current session, async
sessions, the proxy headers and the openai wrapper, and the FLYWHEEL_ENABLED / SAMPLE_RATE / SPOOL_DIR switches.

No broker: a SessionLogger without a bootstrap is a no-op whose sessions still work as context managers, which
is all the current-session bookkeeping needs; where events must be seen, a dead bootstrap spills them to a spool
in tmp_path. The openai tests run a real openai client against a local HTTP stub that records headers.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from flywheel.ingest import sdk
from flywheel.ingest.sdk import (
    OutcomeReporter,
    Session,
    SessionLogger,
    current_session,
    wrap_openai,
)
from flywheel.ingest.spool import Spool
from tests.unit.test_sdk import dead_address


@pytest.fixture(autouse=True)
def _no_sdk_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (sdk.ENABLED_ENV, sdk.SAMPLE_RATE_ENV, sdk.SPOOL_DIR_ENV):
        monkeypatch.delenv(name, raising=False)
    sdk._ENV_WARNED.clear()  # each test sees its own first warning


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> SessionLogger:
    monkeypatch.delenv(sdk.BOOTSTRAP_ENV, raising=False)
    return SessionLogger(None, name="t")


def _names(session: Session | None) -> str | None:
    return None if session is None else f"{session.session_id}/{session.agent_id}"


def test_current_session_follows_nested_with_blocks(log: SessionLogger) -> None:
    assert current_session() is None
    with log.session(session_id="outer") as outer:
        assert current_session() is outer
        with outer.spawn_subagent(agent_id="child") as child:
            assert current_session() is child, _names(current_session())
            with log.attach("other", agent_id="helper") as attached:
                assert current_session() is attached, _names(current_session())
            assert current_session() is child, _names(current_session())
        assert current_session() is outer, _names(current_session())
    assert current_session() is None, _names(current_session())


def test_current_session_is_restored_when_the_block_raises(log: SessionLogger) -> None:
    with log.session(session_id="outer") as outer:
        with pytest.raises(RuntimeError):
            with outer.spawn_subagent(agent_id="child"):
                raise RuntimeError("tool crashed")
        assert current_session() is outer, _names(current_session())
    assert current_session() is None, _names(current_session())


def test_concurrent_asyncio_tasks_each_see_their_own_session(log: SessionLogger) -> None:
    async def agent(name: str, both_inside: asyncio.Barrier) -> list[str | None]:
        seen = []
        with log.session(session_id=name):
            await both_inside.wait()  # the other task is inside its own session now
            seen.append(_names(current_session()))
            await asyncio.sleep(0)
            seen.append(_names(current_session()))
        seen.append(_names(current_session()))
        return seen

    async def main() -> list[list[str | None]]:
        barrier = asyncio.Barrier(2)
        return list(await asyncio.gather(agent("a", barrier), agent("b", barrier)))

    seen = asyncio.run(main())
    assert seen == [["a/main", "a/main", None], ["b/main", "b/main", None]], seen


def test_a_task_inherits_the_session_and_its_own_blocks_stay_inside_it(log: SessionLogger) -> None:
    async def subtask(parent: Session) -> list[str | None]:
        seen = [_names(current_session())]
        with parent.spawn_subagent(agent_id="child"):
            seen.append(_names(current_session()))
            await asyncio.sleep(0)
        seen.append(_names(current_session()))
        return seen

    async def main() -> tuple[list[str | None], list[str | None]]:
        with log.session(session_id="s") as s:
            task = asyncio.create_task(subtask(s))
            await asyncio.sleep(0)  # the task is inside its child block now
            parent_saw = [_names(current_session())]
            child_saw = await task
            parent_saw.append(_names(current_session()))
        return parent_saw, child_saw

    parent_saw, child_saw = asyncio.run(main())
    assert child_saw == ["s/main", "s/child", "s/main"], child_saw
    assert parent_saw == ["s/main", "s/main"], parent_saw


def test_a_session_shared_by_two_tasks_is_unset_only_where_it_is_exited(log: SessionLogger) -> None:
    shared = log.attach("shared")

    async def leaves_first(entered: asyncio.Event, other_inside: asyncio.Event, left: asyncio.Event) -> None:
        with shared:
            entered.set()
            await other_inside.wait()  # both tasks are inside a block on the same object now
        left.set()

    async def stays(entered: asyncio.Event, other_inside: asyncio.Event, left: asyncio.Event) -> str | None:
        await entered.wait()
        with shared:
            other_inside.set()
            await left.wait()
            return _names(current_session())

    async def main() -> str | None:
        events = asyncio.Event(), asyncio.Event(), asyncio.Event()
        _, seen = await asyncio.gather(leaves_first(*events), stays(*events))
        return seen

    assert asyncio.run(main()) == "shared/main"


def test_exiting_in_another_thread_neither_raises_nor_touches_that_thread(log: SessionLogger) -> None:
    s = log.session(session_id="moved")
    s.__enter__()
    errors: list[BaseException] = []
    seen: list[Session | None] = []

    def elsewhere() -> None:
        try:
            s.__exit__(None, None, None)
            seen.append(current_session())
        except BaseException as exc:  # noqa: BLE001 - the assertion below reports it
            errors.append(exc)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert not errors and seen == [None], (errors, seen)
    assert current_session() is s  # entered here, never exited here
    s._leave_current()
    assert current_session() is None


_IMPORT_PROBE = """
import json, sys
import flywheel
lazy = "flywheel.ingest.sdk" not in sys.modules
from flywheel import OutcomeReporter, SessionLogger, current_session
from flywheel.ingest import sdk
assert SessionLogger is sdk.SessionLogger and OutcomeReporter is sdk.OutcomeReporter
assert current_session is sdk.current_session and current_session() is None
assert {"SessionLogger", "OutcomeReporter", "current_session", "wrap_openai", "Session"} <= set(dir(flywheel))
assert flywheel.wrap_openai is sdk.wrap_openai and flywheel.Session is sdk.Session
try:
    flywheel.NoSuchName
    unknown_raises = False
except AttributeError:
    unknown_raises = True
heavy = sorted(m for m in ("torch", "pyarrow", "duckdb", "kafka", "numpy", "pandas", "openai", "httpx")
               if m in sys.modules)
print(json.dumps({"lazy": lazy, "unknown_raises": unknown_raises, "heavy": heavy}))
"""


def test_the_short_import_path_is_lazy_and_pulls_in_nothing_heavy() -> None:
    done = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    # lazy: `import flywheel` alone does not import the SDK; heavy: what the SDK's import path pulled in
    assert got == {"lazy": True, "unknown_raises": True, "heavy": []}, got


# ---------------------------------------------------------------------------------------------
# Helpers: a dead broker (events spill to a spool in tmp_path) and the spool's records
# ---------------------------------------------------------------------------------------------
def _spooled(directory: Path) -> list[dict[str, Any]]:
    if not directory.exists():
        return []
    spool = Spool(directory)
    records = [json.loads(r) for r in spool.peek(1_000_000)]
    spool.close()
    return records


def _spilling(tmp_path: Path, name: str = "t", **kw: Any) -> SessionLogger:
    return SessionLogger(dead_address(), name=name, spool_dir=tmp_path / name, linger_s=0.01, **kw)


# ---------------------------------------------------------------------------------------------
# async with
# ---------------------------------------------------------------------------------------------
def test_async_with_emits_one_start_and_one_end_and_sets_the_current_session_per_task(tmp_path: Path) -> None:
    log = _spilling(tmp_path)

    async def agent(name: str, both_inside: asyncio.Barrier, fail: bool) -> list[str | None]:
        seen = [_names(current_session())]
        try:
            async with log.session(session_id=name, task_type="code_edit") as s:
                await both_inside.wait()  # the other task is inside its own session now
                seen.append(_names(current_session()))
                s.tool_call("t", {"who": name})
                await asyncio.sleep(0)
                seen.append(_names(current_session()))
                if fail:
                    raise RuntimeError("the agent crashed")
        except RuntimeError:
            pass
        seen.append(_names(current_session()))
        return seen

    async def main() -> list[list[str | None]]:
        barrier = asyncio.Barrier(2)
        return list(await asyncio.gather(agent("a", barrier, False), agent("b", barrier, True)))

    seen = asyncio.run(main())
    log.close(timeout=5)
    assert seen == [[None, "a/main", "a/main", None], [None, "b/main", "b/main", None]], seen
    events = _spooled(tmp_path / "t")
    by_session = {sid: [(e["type"], e.get("status")) for e in events if e["session_id"] == sid] for sid in "ab"}
    assert by_session == {"a": [("session_start", None), ("tool_call", None), ("session_end", "ok")],
                          "b": [("session_start", None), ("tool_call", None), ("session_end", "error")]}, by_session


def test_async_with_a_sub_agent_emits_spawn_and_finish(tmp_path: Path) -> None:
    log = _spilling(tmp_path)

    async def main() -> None:
        async with log.session(session_id="s") as s:
            async with s.spawn_subagent(agent_id="child") as child:
                assert current_session() is child
            assert current_session() is s

    asyncio.run(main())
    log.close(timeout=5)
    types = [(e["agent_id"], e["type"]) for e in _spooled(tmp_path / "t")]
    assert types == [("main", "session_start"), ("main", "subagent_spawn"), ("main", "subagent_finish"),
                     ("main", "session_end")], types


# ---------------------------------------------------------------------------------------------
# headers() and wrap_openai
# ---------------------------------------------------------------------------------------------
def test_headers_name_the_session_the_agent_its_parent_and_a_known_task_type(tmp_path: Path) -> None:
    from flywheel.serving import proxy

    log = _spilling(tmp_path)
    s = log.session(session_id="s1", task_type="code_edit")
    child = s.spawn_subagent(agent_id="c1")
    assert s.headers() == {"X-Flywheel-Session-Id": "s1", "X-Flywheel-Agent-Id": "main",
                           "X-Flywheel-Task-Type": "code_edit"}, s.headers()
    assert child.headers() == {"X-Flywheel-Session-Id": "s1", "X-Flywheel-Agent-Id": "c1",
                               "X-Flywheel-Parent-Agent-Id": "main", "X-Flywheel-Task-Type": "code_edit"}
    assert log.session(session_id="s2").headers() == {"X-Flywheel-Session-Id": "s2", "X-Flywheel-Agent-Id": "main"}
    assert log.attach("s3", agent_id="w", task_type="qa").headers()["X-Flywheel-Task-Type"] == "qa"
    # the proxy reads the headers the SDK writes
    assert (proxy.H_SESSION, proxy.H_AGENT, proxy.H_PARENT, proxy.H_TASK) == (
        sdk.HEADER_SESSION_ID, sdk.HEADER_AGENT_ID, sdk.HEADER_PARENT_AGENT_ID, sdk.HEADER_TASK_TYPE)
    log.close(timeout=2)


def test_a_session_that_is_not_logged_sends_no_headers(tmp_path: Path, log: SessionLogger) -> None:
    # the proxy would log its model calls without the rest of the session
    assert log.session(session_id="x", task_type="code_edit").headers() == {}
    none_kept = _spilling(tmp_path, sample_rate=0.0)
    assert none_kept.session(session_id="x").headers() == {}
    none_kept.close(timeout=2)


class _Recorder(http.server.BaseHTTPRequestHandler):
    """An OpenAI chat-completions stub that records each request's headers."""

    seen: list[dict[str, str]] = []
    REPLY = json.dumps({"id": "c1", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).seen.append({k: v for k, v in self.headers.items() if k.lower().startswith("x-flywheel")})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.REPLY)))
        self.end_headers()
        self.wfile.write(self.REPLY)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def stub() -> Iterator[tuple[str, list[dict[str, str]]]]:
    seen: list[dict[str, str]] = []
    handler = type("Handler", (_Recorder,), {"seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    server.shutdown()
    server.server_close()


def _lower(headers: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{k.lower(): v for k, v in h.items()} for h in headers]


def test_wrap_openai_sends_the_current_sessions_headers_from_a_sync_client(
        tmp_path: Path, stub: tuple[str, list[dict[str, str]]]) -> None:
    openai = pytest.importorskip("openai")
    url, seen = stub
    log = _spilling(tmp_path)
    client = wrap_openai(openai.OpenAI(base_url=url, api_key="k", max_retries=0))
    assert wrap_openai(client) is client  # wrapping twice adds nothing
    ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    client.chat.completions.create(**ask)  # no session: no headers
    with log.session(session_id="s1", task_type="code_edit") as s:
        client.chat.completions.create(**ask)
        with s.spawn_subagent(agent_id="c1"):
            client.with_options(timeout=5).chat.completions.create(**ask)  # a copy shares the hook
        client.chat.completions.create(**ask, extra_headers={"X-Flywheel-Agent-Id": "explicit"})
    client.chat.completions.create(**ask)
    log.close(timeout=2)
    assert _lower(seen) == [
        {},
        {"x-flywheel-session-id": "s1", "x-flywheel-agent-id": "main", "x-flywheel-task-type": "code_edit"},
        {"x-flywheel-session-id": "s1", "x-flywheel-agent-id": "c1", "x-flywheel-parent-agent-id": "main",
         "x-flywheel-task-type": "code_edit"},
        {"x-flywheel-session-id": "s1", "x-flywheel-agent-id": "explicit", "x-flywheel-task-type": "code_edit"},
        {},
    ], seen


def test_wrap_openai_gives_each_asyncio_task_its_own_sessions_headers(
        tmp_path: Path, stub: tuple[str, list[dict[str, str]]]) -> None:
    openai = pytest.importorskip("openai")
    url, seen = stub
    log = _spilling(tmp_path)

    async def agent(client: Any, name: str, both_inside: asyncio.Barrier) -> None:
        async with log.session(session_id=name):
            await both_inside.wait()
            for _ in range(3):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": name}])

    async def main() -> None:
        client = wrap_openai(openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0))
        barrier = asyncio.Barrier(2)
        await asyncio.gather(agent(client, "a", barrier), agent(client, "b", barrier))
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "none"}])
        await client.close()

    asyncio.run(main())
    log.close(timeout=2)
    got = sorted(h.get("x-flywheel-session-id", "-") + "/" + h.get("x-flywheel-agent-id", "-") for h in _lower(seen))
    assert got == ["-/-"] + ["a/main"] * 3 + ["b/main"] * 3, got


def test_wrap_openai_refuses_what_is_not_a_client() -> None:
    with pytest.raises(TypeError, match="neither an openai client nor an httpx client"):
        wrap_openai(object())


# ---------------------------------------------------------------------------------------------
# FLYWHEEL_ENABLED, FLYWHEEL_SAMPLE_RATE, FLYWHEEL_SPOOL_DIR
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "false", "OFF"])
def test_enabled_0_is_a_no_op_that_sends_nothing(value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(sdk.ENABLED_ENV, value)
    with caplog.at_level(logging.WARNING, logger="flywheel.ingest.sdk"):
        log = _spilling(tmp_path, name="ev")
        reporter = OutcomeReporter(dead_address(), name="oc", spool_dir=tmp_path / "oc")
        with log.session(task_type="t") as s:
            s.tool_call("t", {})
            assert current_session() is s and s.headers() == {}
        reporter.report(s.session_id, kind="k", value=1.0)
        log.close(timeout=2)
        reporter.close(timeout=2)
    assert not log.enabled and not reporter.enabled and log.metrics() == {"enabled": False}
    assert not (tmp_path / "ev").exists() and not (tmp_path / "oc").exists(), list(tmp_path.iterdir())
    warned = [r.getMessage() for r in caplog.records if sdk.ENABLED_ENV in r.getMessage()]
    assert len(warned) == 2, warned  # one per client


def test_an_unknown_enabled_value_warns_once_and_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(sdk.ENABLED_ENV, "maybe")
    with caplog.at_level(logging.WARNING, logger="flywheel.ingest.sdk"):
        logs = [_spilling(tmp_path, name=f"l{i}") for i in range(2)]
    assert all(log.enabled for log in logs)
    assert sum("'maybe' is not valid" in r.getMessage() for r in caplog.records) == 1, caplog.text
    for log in logs:
        log.close(timeout=1)


def test_sample_rate_keeps_whole_sessions_and_the_reporter_drops_the_same_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sdk.SAMPLE_RATE_ENV, "0.3")
    log = _spilling(tmp_path, name="ev")
    reporter = OutcomeReporter(dead_address(), name="oc", spool_dir=tmp_path / "oc", linger_s=0.01)
    assert log.sample_rate == reporter.sample_rate == 0.3
    ids = [f"sess-{i}" for i in range(2000)]  # sequential ids: a weak hash samples them off the rate
    for sid in ids:
        with log.session(session_id=sid) as s:
            s.tool_call("t", {})
        reporter.report(sid, kind="k", value=1.0)
    log.close(timeout=10)
    reporter.close(timeout=10)
    events, outcomes = _spooled(tmp_path / "ev"), _spooled(tmp_path / "oc")
    per_session: dict[str, list[str]] = {}
    for e in events:
        per_session.setdefault(e["session_id"], []).append(e["type"])
    kept = set(per_session)
    assert 0.26 < len(kept) / len(ids) < 0.34, f"{len(kept)} of {len(ids)} sessions kept at rate 0.3"
    assert all(t == ["session_start", "tool_call", "session_end"] for t in per_session.values()), "half a session"
    assert {o["session_id"] for o in outcomes} == kept and len(outcomes) == len(kept), (len(outcomes), len(kept))
    assert log.metrics()["sampled_out"] == reporter.metrics()["sampled_out"] == len(ids) - len(kept)


def test_sampling_is_the_same_in_another_process(tmp_path: Path) -> None:
    ids = [f"s{i}" for i in range(500)]
    here = [sdk._sampled(sid, 0.1) for sid in ids]
    probe = f"from flywheel.ingest import sdk; print(sum(1 << i for i, s in enumerate({ids!r}) if sdk._sampled(s, 0.1)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) == sum(1 << i for i, kept in enumerate(here) if kept)
    assert 0.07 < sum(here) / len(ids) < 0.13, sum(here)


@pytest.mark.parametrize("value", ["abc", "2", "-0.5", "nan"])
def test_an_invalid_sample_rate_warns_once_and_logs_every_session(value: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(sdk.SAMPLE_RATE_ENV, value)
    with caplog.at_level(logging.WARNING, logger="flywheel.ingest.sdk"):
        log = _spilling(tmp_path, name="a")
        reporter = OutcomeReporter(dead_address(), name="b", spool_dir=tmp_path / "b")
    assert log.sample_rate == reporter.sample_rate == 1.0
    assert all(log.attach(f"s{i}").sampled for i in range(200))
    warned = [r.getMessage() for r in caplog.records if sdk.SAMPLE_RATE_ENV in r.getMessage()]
    assert len(warned) == 1 and "[0, 1]" in warned[0], warned
    log.close(timeout=1)
    reporter.close(timeout=1)


def test_an_explicit_sample_rate_wins_over_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sdk.SAMPLE_RATE_ENV, "0.0")
    log = _spilling(tmp_path, sample_rate=1.0)
    assert log.sample_rate == 1.0 and log.attach("s").sampled
    log.close(timeout=1)


def test_the_spool_root_is_spool_dir_else_the_state_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    assert sdk.default_spool_dir("a/gent", "flywheel.events") == (
        tmp_path / "home" / ".local" / "state" / "flywheel" / "spool" / "a_gent@flywheel.events")
    monkeypatch.setenv("XDG_STATE_HOME", "relative/state")  # the XDG spec: a relative path is ignored
    assert sdk.default_spool_root() == tmp_path / "home" / ".local" / "state" / "flywheel" / "spool"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert sdk.default_spool_root() == tmp_path / "state" / "flywheel" / "spool"
    monkeypatch.setenv(sdk.SPOOL_DIR_ENV, str(tmp_path / "spools"))
    assert sdk.default_spool_dir("agent", "flywheel.outcomes") == tmp_path / "spools" / "agent@flywheel.outcomes"


def test_a_logger_spills_under_the_state_directory_not_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cwd = tmp_path / "cwd"
    old = cwd / "var" / "spool" / "agent@flywheel.events"  # where an older SDK spooled: warned, not replayed
    old.mkdir(parents=True)
    legacy = Spool(old)
    legacy.append([b'{"old": 1}'])
    legacy.close()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    with caplog.at_level(logging.WARNING, logger="flywheel.ingest.sdk"):
        log = SessionLogger(dead_address(), name="agent", linger_s=0.01)
        log.attach("s").tool_call("t", {})
        log.close(timeout=5)
    spooled = _spooled(tmp_path / "state" / "flywheel" / "spool" / "agent@flywheel.events")
    assert [e["type"] for e in spooled] == ["tool_call"], spooled
    assert sorted(p.name for p in (cwd / "var" / "spool").iterdir()) == ["agent@flywheel.events"]
    assert any("older SDK version" in r.getMessage() and "var/spool/agent@" in r.getMessage()
               for r in caplog.records), caplog.text
