"""Helpers that many cluster modules share: doing a thing on every host at once (`parallel`), and
how long whole-job commands wait for one host (`REACH_TIMEOUT_S`)."""
from __future__ import annotations

import concurrent.futures
from typing import Callable, Sequence, TypeVar

from speedrun.cluster.task import CommandFailed
from speedrun.errors import SpeedrunError

# How long whole-job commands (ls, kill, logs) wait for one host before they report it unreachable
# and go on with the others, seconds.
REACH_TIMEOUT_S = 5.0

T = TypeVar("T")
R = TypeVar("R")


def parallel(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """fn on every item at once (threads: the work is waiting on hosts); results in order.
    If some fail, raises the first failure, noting how many others failed too."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(items))) as pool:
        futures = [pool.submit(fn, x) for x in items]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            if len(errors) > 1 and isinstance(errors[0], SpeedrunError) and not isinstance(errors[0], CommandFailed):
                raise SpeedrunError(f"{errors[0]} (and {len(errors) - 1} more failed alike)") from errors[0]
            raise errors[0]
        return [f.result() for f in futures]
