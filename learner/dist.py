"""Data parallelism on torch's own engine: the daemon under `torchrun --nproc-per-node N`.

    torchrun --nproc-per-node 2 -m flywheel.learner.daemon --batch-size 64 ...

torchrun sets RANK / WORLD_SIZE / MASTER_ADDR; without them the learner is a single process
and every function here is a no-op. Rank 0 reads the lake, forms the batch plan (episodes
plus their advantages, computed over the whole global batch) and broadcasts it; each rank
trains its contiguous shard; DDP all-reduces (averages) the gradients, which the loss
pre-multiplies by the world size so the result equals one process on the whole batch. Rank 0
alone checkpoints, publishes and logs to MLflow. Backend: gloo on CPU, nccl on CUDA.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class World:
    rank: int
    size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init(device: torch.device) -> World:
    """Join the process group torchrun describes (if any)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World(0, 1)
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    # rank 0 may wait hours for episodes while the others block in broadcast: no collective timeout
    dist.init_process_group(backend=backend, timeout=_dt.timedelta(days=365))
    world = World(dist.get_rank(), dist.get_world_size())
    log.info("dist: rank %d of %d (%s)", world.rank, world.size, backend)
    return world


def broadcast(obj: T, world: World) -> T:
    """Rank 0's object on every rank (pickled; the batch plan is small: token ids and floats)."""
    if not world.distributed:
        return obj
    import torch.distributed as dist

    box: list[Any] = [obj if world.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shard(items: Sequence[T], world: World) -> list[T]:
    """This rank's contiguous slice of the global batch (sizes differ by at most one)."""
    n = len(items)
    start = world.rank * n // world.size
    end = (world.rank + 1) * n // world.size
    return list(items[start:end])


def wrap(module: torch.nn.Module, world: World) -> torch.nn.Module:
    """DDP around the trainable module (it broadcasts rank 0's weights at construction)."""
    if not world.distributed:
        return module
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.cuda.current_device()] if next(module.parameters()).is_cuda else None
    return DistributedDataParallel(module, device_ids=device_ids)


def all_reduce_figures(sums: list[float], maxes: list[float], world: World) -> tuple[list[float], list[float]]:
    """Per-rank figures reduced over all ranks: `sums` added up, `maxes` their maximum (float64)."""
    if not world.distributed:
        return sums, maxes
    import torch.distributed as dist

    t_sum = torch.tensor(sums, dtype=torch.float64)
    t_max = torch.tensor(maxes, dtype=torch.float64)
    dist.all_reduce(t_sum)
    dist.all_reduce(t_max, op=dist.ReduceOp.MAX)
    return t_sum.tolist(), t_max.tolist()


def barrier(world: World) -> None:
    if world.distributed:
        import torch.distributed as dist

        dist.barrier()


def shutdown(world: World) -> None:
    if world.distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
