"""Data parallelism on torch's own engine: the daemon under `torchrun --nproc-per-node N`.

    torchrun --nproc-per-node 2 -m flywheel.learner.daemon --batch-size 64 ...
    torchrun --nproc-per-node 2 -m flywheel.learner.daemon --shard fsdp2 ...   # weights sharded

torchrun sets RANK / WORLD_SIZE / MASTER_ADDR; without them the learner is a single process
and every function here is a no-op. Rank 0 reads the lake, forms the batch plan (episodes
plus their advantages, computed over the whole global batch) and broadcasts it; each rank
trains its contiguous shard; DDP all-reduces (averages) the gradients, which the loss
pre-multiplies by the world size so the result equals one process on the whole batch. Rank 0
alone checkpoints, publishes and logs to MLflow. Backend: gloo on CPU, nccl on CUDA; each rank
takes the GPU torchrun names in LOCAL_RANK (`local_device`).

With `--shard fsdp2` (`Sharded`) each transformer block and the root are `fully_shard`ed: every
rank holds 1/N of each parameter and of its Adam moments, all-gathers a block for its forward and
backward and reduce-scatters (averages, as DDP does) the gradients. Two collectives DDP does not
have follow from that: every rank must run the same number of forwards (`Sharded.micro_batches`),
and rank 0, which checkpoints and publishes alone, cannot gather the other ranks' shards then. So
every rank gathers the full trainable weights and optimizer state onto rank 0 (CPU) after each step
(`Sharded.gather`), and the checkpoint and the version are written from that copy, in the same
single-process form as without sharding.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence, TypeVar

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


def local_device(name: str, cuda_available: bool, env: Mapping[str, str]) -> str:
    """The device this process trains on: under torchrun, rank LOCAL_RANK's GPU, not every rank on cuda:0.

    name: the config's device (auto, cpu or cuda); env: the process environment (torchrun sets LOCAL_RANK).
    """
    if name == "cpu" or (name == "auto" and not cuda_available):
        return "cpu"
    if not cuda_available:
        raise RuntimeError("device=cuda but torch sees no CUDA device")
    return f"cuda:{int(env.get('LOCAL_RANK', '0'))}"


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
    """DDP around the trainable module (it broadcasts rank 0's weights at construction); a sharded one as it is."""
    from torch.distributed.fsdp import FSDPModule

    if not world.distributed or isinstance(module, FSDPModule):
        return module
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.cuda.current_device()] if next(module.parameters()).is_cuda else None
    return DistributedDataParallel(module, device_ids=device_ids)


@contextlib.contextmanager
def no_sync(module: torch.nn.Module) -> Iterator[None]:
    """Backward passes that only accumulate gradients: no all-reduce (DDP) or reduce-scatter (FSDP2) in them."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        with module.no_sync():  # type: ignore[operator]
            yield
        return
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def full(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded one (a collective: every rank calls it in the same order); others as they are."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def most_micro_batches(n_rows: int, world: World, micro_batch: int) -> int:
    """The largest number of micro-batches any rank's shard of `n_rows` rows makes (shard's slices)."""
    sizes = [(r + 1) * n_rows // world.size - r * n_rows // world.size for r in range(world.size)]
    return max(-(-size // micro_batch) for size in sizes)


class Sharded:
    """A module `fully_shard`ed over the ranks, and rank 0's full CPU copy of its checkpointed state.

    `weights` holds the state-dict entries a checkpoint and a version need (the trainable ones:
    LoRA's adapter, or every weight in full mode) and `optimizer_state` the optimizer's state in its
    own state_dict() numbering, both as of the last `gather`: rank 0 reads them alone, when the
    other ranks may be waiting for its broadcast. Every parameter is sharded on dim 0 (FSDP2's
    placement), so a full tensor becomes this rank's shard without any communication (`shard`).
    """

    def __init__(self, module: torch.nn.Module, world: World, mesh: Any, names: list[str]) -> None:
        self.module = module
        self.world = world
        self.mesh = mesh
        self.names = names
        self.weights: dict[str, torch.Tensor] = {}
        self.optimizer_state: dict[int, dict[str, Any]] = {}

    def shard(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's dim-0 shard of a full tensor, as FSDP2 holds it (local: no collective)."""
        from torch.distributed.tensor import Shard, distribute_tensor

        return distribute_tensor(value.to(self.mesh.device_type), self.mesh, [Shard(0)], src_data_rank=None)

    def local_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full state dict as this rank's shards (what load_state_dict of the sharded module takes)."""
        return {k: self.shard(v) for k, v in state.items()}

    def gather(self, optimizer: torch.optim.Optimizer) -> None:
        """Every rank: the full weights and optimizer state onto rank 0's CPU (one all-gather per tensor)."""
        keep = self.world.is_main
        entries = self.module.state_dict()
        weights = {}
        for name in self.names:
            value = full(entries[name]).detach()
            if keep:
                weights[name] = value.cpu().clone()
        state: dict[int, dict[str, Any]] = {}
        for index, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
            slot = {k: full(v).detach() if isinstance(v, torch.Tensor) else v
                    for k, v in optimizer.state.get(param, {}).items()}
            if keep and slot:
                state[index] = {k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in slot.items()}
        if keep:
            self.weights, self.optimizer_state = weights, state

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Shard optimizer state loaded from a single-rank checkpoint, and make state_dict() the gathered one."""
        from torch.distributed.tensor import DTensor

        for param, slot in optimizer.state.items():
            for key, value in slot.items():
                # load_state_dict puts the full moments beside sharded parameters; "step" stays a scalar
                if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                        and value.shape == param.shape:
                    slot[key] = self.shard(value)
        optimizer.register_state_dict_post_hook(self._full_optimizer_state)

    def _full_optimizer_state(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        assert self.world.is_main, "only rank 0 writes checkpoints: the other ranks hold no gathered copy"
        return {"state": self.optimizer_state, "param_groups": state_dict["param_groups"]}


def shard_module(module: torch.nn.Module, device: torch.device, trainable_only: bool) -> Sharded:
    """fully_shard each transformer block (the model's `_no_split_modules`) and then the root.

    trainable_only: rank 0's gathered copy keeps the trainable entries only (LoRA: the frozen base
    is re-read from base_model, as without sharding); else every state-dict entry (full mode).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    get_base = getattr(module, "get_base_model", None)  # a PeftModel's wrapped HF model
    base = get_base() if get_base is not None else module
    kinds = set(getattr(base, "_no_split_modules", None) or ())
    blocks = [m for m in module.modules() if type(m).__name__ in kinds]
    assert blocks, f"shard: {type(base).__name__} names no transformer block class (_no_split_modules {kinds})"
    world = World(dist.get_rank(), dist.get_world_size())
    mesh = init_device_mesh(device.type, (world.size,))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    names = [k for k in module.state_dict() if not trainable_only or k in trainable]
    log.info("dist: fsdp2 sharded %d %s blocks and the root over %d ranks", len(blocks), "/".join(sorted(kinds)),
             world.size)
    return Sharded(module, world, mesh, names)


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


def shutdown(world: World, clean: bool = True) -> None:
    """Leave the process group: after a clean run, every rank at once; after a failure, not at all.

    A rank of a 2-rank FSDP2 run once died at exit after `destroy_process_group` ("terminate called without an
    active exception", SIGABRT; issue 35, not reproduced here in 18 runs beside CPU hogs): a C++ object with a live
    thread was destroyed during interpreter finalization. So the objects that hold the group (the sharded module,
    its DTensors and mesh, the optimizer's sharded moments: the caller drops its references first) are collected
    while the interpreter is whole, and a barrier keeps a rank from tearing the group down while its peer still
    talks to it. After a failure the peer may be inside a collective: destroying then can hang (torchtitan#1342),
    and torchrun ends the other ranks anyway.
    """
    if not world.distributed:
        return
    import gc

    import torch.distributed as dist

    if not clean:
        log.warning("dist: rank %d failed; leaving the process group to torchrun", world.rank)
        return
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
