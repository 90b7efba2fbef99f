"""The learner's torchrun parts that need no second process: which device a rank takes, how many
micro-batches a sharded rank must run, the shard setting's rules, and the adapter-name mapping."""

from __future__ import annotations

import pytest
import torch

from flywheel.base.config import ConfigError
from flywheel.learner.config import LearnerConfig
from flywheel.learner.dist import World, local_device, most_micro_batches, shard
from flywheel.learner.model import adapter_entries


def test_each_torchrun_rank_takes_its_local_gpu_not_gpu_0() -> None:
    assert local_device("cuda", True, {"LOCAL_RANK": "3", "RANK": "11"}) == "cuda:3"
    assert local_device("auto", True, {"LOCAL_RANK": "1"}) == "cuda:1"
    assert local_device("cuda", True, {}) == "cuda:0"  # one process, no torchrun
    assert local_device("auto", False, {"LOCAL_RANK": "1"}) == "cpu"
    assert local_device("cpu", True, {"LOCAL_RANK": "1"}) == "cpu"
    with pytest.raises(RuntimeError, match="no CUDA device"):
        local_device("cuda", False, {"LOCAL_RANK": "0"})


@pytest.mark.parametrize("rows, ranks, micro", [(7, 2, 3), (16, 2, 3), (5, 4, 1), (9, 3, 4), (2, 2, 8)])
def test_the_micro_batch_count_every_sharded_rank_runs_is_the_largest_shards(rows: int, ranks: int, micro: int) -> None:
    counts = [-(-len(shard(list(range(rows)), World(r, ranks))) // micro) for r in range(ranks)]
    assert most_micro_batches(rows, World(0, ranks), micro) == max(counts), counts


def test_the_shard_setting_is_checked() -> None:
    with pytest.raises(ConfigError, match="shard"):
        LearnerConfig(shard="zero3").check()
    with pytest.raises(ConfigError, match="parity_samples"):
        LearnerConfig(shard="fsdp2", publish=True, parity_samples=8).check()
    LearnerConfig(shard="fsdp2", publish=True, parity_samples=0).check()
    LearnerConfig(shard="fsdp2", publish=False).check()


def test_an_adapter_file_fills_the_models_lora_entries_by_name() -> None:
    entries = {"m.q_proj.lora_A.default.weight": torch.zeros(2, 4), "m.q_proj.lora_B.default.weight": torch.zeros(4, 2)}
    adapter = {"m.q_proj.lora_A.weight": torch.ones(2, 4), "m.q_proj.lora_B.weight": torch.full((4, 2), 2.0)}
    out = adapter_entries(entries, adapter)
    assert torch.equal(out["m.q_proj.lora_A.default.weight"], adapter["m.q_proj.lora_A.weight"])
    assert torch.equal(out["m.q_proj.lora_B.default.weight"], adapter["m.q_proj.lora_B.weight"])
    with pytest.raises(AssertionError, match="lora_B"):
        adapter_entries(entries, {"m.q_proj.lora_A.weight": torch.ones(2, 4)})
