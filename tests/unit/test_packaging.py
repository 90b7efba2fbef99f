"""What `pip install .` puts into a fresh environment: the `flywheel` namespace and its console script, nothing else.

The wheel is built from a copy of the tracked sources with the project's own build backend (no
network), then installed without dependencies into a new venv, and site-packages is compared
with what the venv held before.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ["pyproject.toml", "README.md", "infra", "ingest", "rewards", "learner", "serving"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = out.glob("agent_flywheel-*.whl")
    return path


def test_the_wheel_holds_only_the_flywheel_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"flywheel"}, sorted(tops)
    assert "flywheel/ingest/sdk.py" in names and "flywheel/base/config.py" in names and "flywheel/cli.py" in names
    assert "flywheel/rewards/rewards.toml" in names and "flywheel/pom.xml" in names, "package data missing"
    fixtures = [n for n in names if "synthetic" in n or "fixture" in n or n.startswith("flywheel/bench")]
    assert not fixtures, f"test fixtures shipped in the wheel: {fixtures}"


def test_pip_install_adds_only_the_namespace_and_the_console_script(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    before = {p.name for p in site.iterdir()}
    bins = {p.name for p in (env_dir / "bin").iterdir()}
    done = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    added = {p.name for p in site.iterdir()} - before
    assert {a for a in added if not a.endswith(".dist-info")} == {"flywheel"}, sorted(added)
    assert {p.name for p in (env_dir / "bin").iterdir()} - bins == {"flywheel"}
    # the namespace is importable from outside the checkout without any of the heavy extras being needed
    probe = "import flywheel, flywheel.base.config, flywheel.ingest.schema; print(flywheel.__version__)"
    version = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert version.returncode == 0 and version.stdout.strip(), version.stderr[-2000:]


def test_no_two_test_files_share_a_name() -> None:
    # tests/ folders are not packages, so pytest imports each file by its base name: two files with one name
    # make the whole run stop at collection ("import file mismatch"), which running one folder never shows
    seen: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test files sharing a name: {clashes}"


def test_the_editable_install_resolves_through_a_static_path_file() -> None:
    """Editors and type checkers follow `flywheel.*` to the repository's files: the editable install is setuptools'
    strict mode (a .pth naming a folder of links), not an import hook they cannot read; every package file is linked
    (a module added since the last `make setup` is not: make setup re-links)."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    assert not list(site.glob("__editable__*agent_flywheel*finder.py")), "an import-hook editable install: run make setup"
    roots = [Path(line.strip()) for pth in site.glob("__editable__.agent_flywheel*.pth")
             for line in pth.read_text().splitlines() if line.strip() and not line.startswith("import ")]
    assert roots, f"no static .pth for agent-flywheel in {site}"
    root = next(r for r in roots if (r / "flywheel").is_dir())
    tasks = root / "flywheel" / "demo" / "tasks.py"
    assert tasks.resolve() == REPO / "infra" / "demo" / "tasks.py", f"{tasks} resolves to {tasks.resolve()}"
    folders = {"infra": "flywheel", "ingest": "flywheel/ingest", "rewards": "flywheel/rewards",
               "learner": "flywheel/learner", "serving": "flywheel/serving"}
    missing = [str(p.relative_to(REPO)) for folder, linked in folders.items() for p in (REPO / folder).rglob("*.py")
               if "__pycache__" not in p.parts
               and not (root / linked / p.relative_to(REPO / folder)).exists()]
    assert not missing, f"package files without a link in {root} (run make setup): {missing}"
