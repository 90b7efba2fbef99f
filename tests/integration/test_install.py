"""What a base install and each extra really give: issue 20's acceptance for `pip install .` and the extras map.

1. A fresh venv, `pip install <copy of the sources>` with no extras (dependencies from PyPI): the agent-facing
   API imports, torch / pyarrow / duckdb are not installed, and `flywheel --version` and `flywheel status` work.
2. Each sub-command's module imports, and its `main(["--help"])` runs, in a child process where only the
   distributions of base + that command's extras (and their own dependencies, from the installed metadata) can
   be imported: a meta-path finder refuses every other top-level package, as a missing one would be.

    flock /tmp/heavy.lock .venv/bin/python -m pytest -q tests/integration/test_install.py
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from flywheel.cli import COMMANDS

REPO = Path(__file__).resolve().parents[2]
SOURCES = ["pyproject.toml", "README.md", "infra", "ingest", "rewards", "learner", "serving"]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

# sub-command -> the extras its process installs (from pyproject's comments; the base is always there).
# The demo's tools run from a checkout with everything (`make setup` installs .[all]).
DEMO = ("lake", "train", "serve", "dev")
EXTRAS: dict[str, tuple[str, ...]] = {
    "infra": (), "status": (), "proxy": (), "topics": (), "otlp-receiver": ("otlp",),
    "lake-writer": ("lake",), "compact": ("lake",), "episodes": ("lake",), "judge": ("lake",),
    "learner": ("train", "lake"), "model": ("train", "models"), "preflight": ("train",), "swarm-preflight": ("train",),
    "publish": ("serve",), "promote": ("serve", "lake"), "rollback": ("serve", "lake"),
    "report": ("lake", "serve", "dev"),
    "agent-sim": DEMO, "outcome-sim": DEMO, "demo": DEMO, "experiments": DEMO,
}
NOT_INSTALLED = {"bench"}  # bench/ runs from a checkout only (flywheel.cli says so)
# modules that are not a sub-command's entry but have an install promise of their own
MODULES = [("flywheel", ()), ("flywheel.ingest.sdk", ()), ("flywheel.serving.router", ("serve",))]

CHILD = r"""
import importlib, importlib.abc, json, sys
allowed = set(json.loads(sys.argv[1])) | set(sys.stdlib_module_names) | {"flywheel"}
refused = set()

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in allowed or top.startswith("_"):  # private C helpers (_cffi_backend, ...) come with their package
            return None
        refused.add(top)
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Refuse())
module = importlib.import_module(sys.argv[2])
if len(sys.argv) > 3:
    try:
        getattr(module, sys.argv[3])(["--help"])
    except SystemExit as exc:
        assert exc.code in (0, None), f"--help exited {exc.code}"
print("refused (optional imports that fell back):", sorted(refused))
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: list[str]) -> set[str]:
    """The installed distributions these requirements pull in, transitively (markers evaluated, no extras)."""
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _norm(req.name)
        if name in seen or name == "agent-flywheel":
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # not installed here: nothing of it can be imported either
        seen.add(name)
        todo += dist.requires or []
    return seen


def _importable(extras: tuple[str, ...]) -> list[str]:
    reqs = list(PROJECT["dependencies"]) + [r for e in extras for r in PROJECT["optional-dependencies"][e]]
    dists = _closure(reqs)
    return sorted(top for top, owners in md.packages_distributions().items() if any(_norm(d) in dists for d in owners))


def test_every_sub_command_has_its_extras_named() -> None:
    missing = set(COMMANDS) - set(EXTRAS) - NOT_INSTALLED
    assert not missing, f"sub-commands without an entry in EXTRAS (say which extras they need): {sorted(missing)}"
    unknown = {e for extras in EXTRAS.values() for e in extras} - set(PROJECT["optional-dependencies"])
    assert not unknown, f"EXTRAS names extras pyproject does not define: {sorted(unknown)}"


CASES = [(name, *COMMANDS[name][0].split(":"), EXTRAS[name]) for name in COMMANDS if name not in NOT_INSTALLED] + \
        [(module, module, "", extras) for module, extras in MODULES]


@pytest.mark.parametrize(("name", "module", "func", "extras"), CASES, ids=[c[0] for c in CASES])
def test_each_process_imports_with_only_its_extras(name: str, module: str, func: str, extras: tuple[str, ...],
                                                   tmp_path: Path) -> None:
    argv = [sys.executable, "-c", CHILD, json.dumps(_importable(extras)), module] + ([func] if func else [])
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{name} ({module}) with base+{list(extras)}:\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with `pip install .` and no extras, from a copy of the sources (the checkout stays untouched)."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(REPO / name, src / name,
                                                                        **({"ignore": shutil.ignore_patterns("__pycache__")}
                                                                           if (REPO / name).is_dir() else {}))
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    done = subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", str(src)],
                          capture_output=True, text=True, timeout=900, cwd=root, env=_clean_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return env_dir


def _clean_env() -> dict[str, str]:
    """This process's environment without what points into the dev venv or the checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def _run(base_venv: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(base_venv / "bin" / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=_clean_env())


@pytest.mark.slow
def test_a_base_install_has_the_sdk_and_no_heavy_packages(base_venv: Path, tmp_path: Path) -> None:
    probe = ("import importlib.util, json, flywheel; from flywheel import SessionLogger, OutcomeReporter; "
             "print(json.dumps({'file': flywheel.__file__, 'heavy': [m for m in ('torch', 'pyarrow', 'duckdb') "
             "if importlib.util.find_spec(m) is not None]}))")
    done = _run(base_venv, "python", "-c", probe, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["heavy"] == [], f"a base install carries {seen['heavy']}"
    assert seen["file"].startswith(str(base_venv)), f"flywheel imported from {seen['file']}, not the fresh venv"


@pytest.mark.slow
def test_a_base_install_prints_its_version_and_its_status(base_venv: Path, tmp_path: Path) -> None:
    version = _run(base_venv, "flywheel", "--version", cwd=tmp_path)
    assert (version.returncode, version.stdout.strip()) == (0, f"flywheel {PROJECT['version']}"), version.stderr[-2000:]
    status = _run(base_venv, "flywheel", "status", cwd=tmp_path)
    assert status.returncode == 0 and "processes" in status.stdout, status.stdout[-2000:] + status.stderr[-3000:]
