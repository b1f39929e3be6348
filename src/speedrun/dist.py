"""Process-group set-up from torchrun's environment, and the few reductions the loop needs.

One process per device. Under `torchrun` the variables RANK, WORLD_SIZE, LOCAL_RANK and
MASTER_ADDR/MASTER_PORT are set and we join the group with env://; without them this is a
single process and nothing distributed is started. NCCL on CUDA, gloo on CPU.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from speedrun.data.base import Shard
from speedrun.errors import SpeedrunError

# A collective that waits longer than this raises instead of hanging forever when a peer died.
DEFAULT_TIMEOUT_S = 300


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job, and the device it trains on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def shard(self) -> Shard:
        return Shard(self.rank, self.world_size)


def pick_device(requested: str | None) -> str:
    """"cuda" when asked or available, else "cpu"; a clear error when CUDA is asked but absent."""
    if requested in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise SpeedrunError("--device cuda was asked for, but PyTorch sees no CUDA device here; use --device cpu")
    if requested not in ("cpu", "cuda"):
        raise SpeedrunError(f"unknown device {requested!r} (use cpu or cuda)")
    return requested


def init_distributed(device_kind: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Join the process group torchrun describes (if any) and pick this process's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_kind == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise SpeedrunError(
                f"local rank {local_rank} has no GPU: this machine has {torch.cuda.device_count()}; "
                "use --nproc-per-node at most that"
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device_kind == "cuda" else "gloo",
            init_method="env://",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device_kind == "cuda" else None,
        )
    return DistContext(rank, world_size, local_rank, device)


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum `tensor` over all ranks in place (a no-op in a single process); returns it."""
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_object(obj, ctx: DistContext):
    """Rank 0's `obj` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown(ctx: DistContext) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


@torch.no_grad()
def average_buffers(model: torch.nn.Module, ctx: DistContext) -> None:
    """Average floating-point buffers (BatchNorm running statistics) over ranks. Each rank's
    statistics come from its own batches; averaged, every rank evaluates the same model and the
    checkpoint rank 0 writes is that model."""
    if not ctx.distributed:
        return
    for buffer in model.buffers():
        if buffer.is_floating_point():
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
            buffer.div_(ctx.world_size)


def processes(n: int | None) -> str:
    """"1 process", "8 processes"."""
    return f"{n} process" if n == 1 else f"{n} processes"
