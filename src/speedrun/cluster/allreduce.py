"""The all-reduce benchmark `speedrun check` runs on a job's tasks, one process per device under
torchrun (`python -m torch.distributed.run ... -m speedrun.cluster.allreduce --out FILE`).

Like nccl-tests' all_reduce_perf: float32 sums of doubling message sizes, each timed over
`--iters` calls after `--warmup` calls, and reported as

    algbw = bytes / time                      (GB/s, 1e9 bytes)
    busbw = algbw x 2 (n - 1) / n             (n = processes in all; see bus_bandwidth)

busbw is the figure to hold against a link's speed: a ring all-reduce moves 2 (n - 1) / n of the
message over each process's link, so busbw stays put as processes are added to a fast enough
network. The time is the slowest process's mean (nccl-tests averages them; the slowest is what a
training step waits for). Each size is checked once: every element must equal 1 + 2 + ... + n.

NCCL on GPUs (one process per GPU), gloo on CPUs. With NCCL, which transport it chose (EFA through
aws-ofi-nccl's libfabric provider, plain sockets, InfiniBand) is read from its own debug output,
which this process asks for (NCCL_DEBUG=INFO into a file per rank beside `--out`) unless the caller
set NCCL_DEBUG. Rank 0 writes the result, a JSON object, to `--out`.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

from speedrun.files import to_json
from speedrun.startup import kept_imports

MiB = 1 << 20


def bus_bandwidth(algbw: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce among `ranks` processes, in algbw's unit."""
    return algbw * 2 * (ranks - 1) / ranks if ranks > 1 else algbw


def message_sizes(largest_bytes: int, smallest_bytes: int = 4096, factor: int = 4) -> list[int]:
    """Message sizes in bytes from `smallest_bytes` up by `factor` to `largest_bytes` (which is
    always the last), whole float32 elements."""
    sizes, size = [], smallest_bytes
    while size < largest_bytes:
        sizes.append(size)
        size *= factor
    sizes.append(largest_bytes)
    return sorted({max(4, s // 4 * 4) for s in sizes})


# NCCL's debug lines that say how it moves data (NCCL 2.x wording; aws-ofi-nccl names its provider).
NET_LINE = re.compile(r"Using network (.+?)\s*$")
OFI_PROVIDER = re.compile(r"Selected [Pp]rovider is (\S+)")
CHANNEL_PATH = re.compile(r" via (\S+)")


def nccl_transport(lines: list[str]) -> tuple[str | None, list[str]]:
    """From NCCL's debug output: the network it chose between machines ("EFA", "sockets",
    "InfiniBand", or its own name; None when it printed none) and the distinct paths its
    channels use (P2P/CUMEM, SHM, NET/Socket/0...)."""
    network = provider = None
    paths: list[str] = []
    for line in lines:
        if m := NET_LINE.search(line):
            network = m.group(1)
        if m := OFI_PROVIDER.search(line):
            provider = m.group(1).rstrip(",.")
        for m in CHANNEL_PATH.finditer(line):
            if m.group(1) not in paths:
                paths.append(m.group(1))
    if network is None:
        return None, paths
    if "Libfabric" in network or "OFI" in network:
        return ("EFA" if provider == "efa" else f"libfabric ({provider or 'provider not named'})"), paths
    return {"Socket": "sockets", "IB": "InfiniBand"}.get(network, network), paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m speedrun.cluster.allreduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where rank 0 writes the result (JSON)")
    p.add_argument("--size", type=float, default=64.0, help="largest message, MiB")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per size first")
    p.add_argument("--id", default="", help="copied into the result (the caller's check of whose it is)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="end after this long even if unfinished: the caller's timeout, so that a check whose "
                        "caller was killed or cut off does not keep the machines busy")
    args = p.parse_args(argv)
    started = time.monotonic()

    def on_time() -> None:
        # Each process keeps its own clock (no collective that would perturb the timings): the first
        # past the limit ends, and the others' next call fails on the closed connection.
        if args.max_seconds is not None and time.monotonic() - started > args.max_seconds:
            print(f"speedrun: the check ran past its {args.max_seconds:g} s (its caller's timeout): ending",
                  flush=True)
            os._exit(3)  # not a clean shutdown: that would wait in a collective the others may never join

    with kept_imports():  # the collector's passes skip torch's objects (speedrun.startup)
        import torch
        import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = torch.cuda.is_available()
    debug_file = None
    if gpu:
        torch.cuda.set_device(local_rank)
        if "NCCL_DEBUG" not in os.environ:  # read back below for the transport NCCL chose
            debug_file = Path(args.out).parent / f"nccl-debug.{rank}.txt"
            debug_file.parent.mkdir(parents=True, exist_ok=True)
            os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=str(debug_file))
    dist.init_process_group("nccl" if gpu else "gloo")
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(device)

    rows = []
    expected = world * (world + 1) / 2
    for size in message_sizes(int(args.size * MiB)):
        x = torch.full((size // 4,), float(rank + 1), dtype=torch.float32, device=device)
        dist.all_reduce(x)
        wrong = int((x != expected).sum().item())
        x.zero_()  # sums of zeros from here: the timed calls cannot overflow to inf
        for _ in range(args.warmup):
            on_time()
            dist.all_reduce(x)
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            on_time()
            dist.all_reduce(x)
        sync()
        seconds = torch.tensor([(time.perf_counter() - start) / args.iters], dtype=torch.float64, device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        algbw = size / seconds.item() / 1e9
        rows.append({"bytes": size, "count": size // 4, "type": "float32", "time_us": seconds.item() * 1e6,
                     "algbw_GBps": algbw, "busbw_GBps": bus_bandwidth(algbw, world), "wrong": wrong})

    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    if rank == 0:
        transport, paths = ("TCP", []) if not gpu else nccl_transport(
            debug_file.read_text(errors="replace").splitlines() if debug_file and debug_file.exists() else [])
        result = {"id": args.id, "backend": dist.get_backend(), "transport": transport, "paths": paths, "ranks": world,
                  "nodes": int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("SPEEDRUN_NUM_TASKS", "1"))),
                  "nproc_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                  "device": torch.cuda.get_device_name(device) if gpu else "cpu", "hosts": sorted(set(hosts)),
                  "iters": args.iters, "warmup": args.warmup, "time": time.time(), "results": rows,
                  "socket_interface": os.environ.get("NCCL_SOCKET_IFNAME" if gpu else "GLOO_SOCKET_IFNAME")}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(to_json(result, indent=1) + "\n")
        tmp.replace(out)
        print(f"wrote {out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
