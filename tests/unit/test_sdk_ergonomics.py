"""The SDK as agent developers use it: the short import path and the context-local current session.

No broker and no disk: a SessionLogger without a bootstrap is a no-op whose sessions still work as
context managers, which is all the current-session bookkeeping needs.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest

from flywheel.ingest import sdk
from flywheel.ingest.sdk import Session, SessionLogger, current_session


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
assert {"SessionLogger", "OutcomeReporter", "current_session"} <= set(dir(flywheel))
try:
    flywheel.NoSuchName
    unknown_raises = False
except AttributeError:
    unknown_raises = True
heavy = sorted(m for m in ("torch", "pyarrow", "duckdb", "kafka", "numpy", "pandas") if m in sys.modules)
print(json.dumps({"lazy": lazy, "unknown_raises": unknown_raises, "heavy": heavy}))
"""


def test_the_short_import_path_is_lazy_and_pulls_in_nothing_heavy() -> None:
    done = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    # lazy: `import flywheel` alone does not import the SDK; heavy: what the SDK's import path pulled in
    assert got == {"lazy": True, "unknown_raises": True, "heavy": []}, got
