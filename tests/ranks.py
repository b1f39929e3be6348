"""torch.distributed ranks that a test starts itself, in processes of their own (not through torchrun).

Forked by a forkserver: not forked from the pytest process itself (threaded: a child forked from it
can deadlock), and not spawned, where every rank imports torch and speedrun again (4-5 CPU s apiece
on 2 cores). The server starts once per pytest process with those imported, then forks each rank in
milliseconds. Its ranks are its children, not the test's: the suite's CPU meter does not count them.
"""
from __future__ import annotations

import multiprocessing
from collections.abc import Callable

import torch.multiprocessing as mp

PRELOAD = ["pytest", "torch", "torch.distributed", "speedrun.engine"]


def start_ranks(fn: Callable, args: tuple, nprocs: int, join: bool = False) -> mp.ProcessContext | None:
    """torch.multiprocessing.start_processes(fn, args, nprocs, join) on a forkserver: fn(rank, *args)
    in each of `nprocs` processes."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # before the server's first start; later calls change nothing
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")
