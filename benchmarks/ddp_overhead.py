"""Communication overhead of DistributedDataParallel: step time of N processes (gloo on the CPU,
NCCL with one GPU each when there are enough GPUs) against one process with the same
per-process batch, side by side in this script. With perfect scaling the ratio is 1.0; the
excess is the gradient all-reduce that DDP overlaps with the backward pass.

    python benchmarks/ddp_overhead.py                       # 2 CPU processes, 1 thread each
    python benchmarks/ddp_overhead.py --model resnet18 --size 64 --batch 32
"""
from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from speedrun.learner import train_step
from speedrun.model import build_model
from speedrun.optim import build_optimizer
from speedrun.recipe import OptimizerSettings


def step_time(rank: int, world: int, args: argparse.Namespace, port: int, results) -> None:
    """Median seconds per training step on this rank (stored in results[rank])."""
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    torch.manual_seed(0)
    in_chans = 1 if args.model.startswith("resnet-fmnist") else 3
    model = build_model(args.model, 10, in_chans).to(device, memory_format=torch.channels_last)
    optimizer = build_optimizer(model, OptimizerSettings(), lr=0.01)
    net = DDP(model, device_ids=[rank] if cuda else None, bucket_cap_mb=args.bucket_cap_mb) if world > 1 else model
    x = torch.randn(args.batch, in_chans, args.size, args.size, device=device).contiguous(
        memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,), device=device)
    criterion = nn.CrossEntropyLoss()
    times = []
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        train_step(net, optimizer, criterion, x, y, "bf16" if cuda else "fp32")
        if cuda:
            torch.cuda.synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    results[rank] = sorted(times)[len(times) // 2]
    if world > 1:
        dist.destroy_process_group()


def measure(world: int, args: argparse.Namespace) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(step_time, args=(world, args, port, results), nprocs=world, join=True)
    return max(results.values())  # the job moves at its slowest rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet-fmnist")
    parser.add_argument("--size", type=int, default=28, help="image size in pixels")
    parser.add_argument("--batch", type=int, default=128, help="per-process batch")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    single = measure(1, args)
    multi = measure(args.processes, args)
    print(f"{args.model}, {args.size} px, batch {args.batch} per process, {args.threads} thread(s) per process")
    print(f"  1 process:            {1000 * single:8.1f} ms/step")
    print(f"  {args.processes} processes (DDP):   {1000 * multi:8.1f} ms/step")
    print(f"  overhead ratio:       {multi / single:8.2f}x  (1.00 = no communication cost)")


if __name__ == "__main__":
    main()
