"""Publisher validation and LoRA slot bookkeeping: refused directories never reach a server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.fixtures import models as synthetic
from flywheel.serving import publisher
from flywheel.serving.publisher import PublishError, keep_set, load_version
from flywheel.serving.tier import TierConfig

BASE = Path(__file__).resolve().parents[2] / "var" / "models" / "tiny-base"


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (BASE / "model.safetensors").is_file():
        pytest.skip(f"no tiny base model at {BASE}; run `flywheel model init`")
    return synthetic.make_lora_version(BASE, tmp_path_factory.mktemp("v") / "policy-v3", 3, rank=4)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_policy(d: Path, **changes: object) -> None:
    meta = json.loads((d / "policy.json").read_text())
    (d / "policy.json").write_text(json.dumps({**meta, **changes}))


def test_valid_lora_directory_loads(lora_dir: Path) -> None:
    pv = load_version(lora_dir, TierConfig(base_model=str(BASE)))
    assert (pv.version, pv.kind, pv.name) == (3, "lora", "policy-v3")


@pytest.mark.parametrize("changes, message", [
    ({"kind": "delta"}, "kind"),
    ({"policy_version": 0}, "positive integer"),
    ({"policy_version": "3"}, "positive integer"),
    ({"policy_version": 4}, "directory name says version 3"),
])
def test_bad_policy_json_is_refused(lora_dir: Path, tmp_path: Path, changes: dict, message: str) -> None:
    d = _copy(lora_dir, tmp_path / "policy-v3")
    _edit_policy(d, **changes)
    with pytest.raises(PublishError, match=message):
        load_version(d, TierConfig(base_model=str(BASE)))


def test_rank_above_server_limit_and_missing_files_are_refused(lora_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(PublishError, match="exceeds the servers' max_lora_rank"):
        load_version(lora_dir, TierConfig(base_model=str(BASE), max_lora_rank=2))
    d = _copy(lora_dir, tmp_path / "policy-v3")
    (d / "adapter_model.safetensors").unlink()
    with pytest.raises(PublishError, match="missing"):
        load_version(d, TierConfig(base_model=str(BASE)))
    with pytest.raises(PublishError, match="not a directory"):
        load_version(tmp_path / "nope", TierConfig(base_model=str(BASE)))


def test_nan_weights_are_refused(lora_dir: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    d = _copy(lora_dir, tmp_path / "policy-v3")
    tensors = load_file(str(d / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    save_file(tensors, str(d / "adapter_model.safetensors"))
    with pytest.raises(PublishError, match="NaN or inf"):
        load_version(d, TierConfig(base_model=str(BASE)))


def test_keep_set_keeps_routed_new_and_newest() -> None:
    assert keep_set({1, 2}, [1, 2, 5, 6, 7], 8, keep_newest=2) == {1, 2, 7, 8}
    assert keep_set(set(), [], 1, keep_newest=2) == {1}


def test_served_name_of_full_weights_is_the_base_name() -> None:
    tier = TierConfig()
    assert publisher.served_name(4, "full", tier) == "policy-v0"
    assert publisher.served_name(4, "lora", tier) == "policy-v4"
