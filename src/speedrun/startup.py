"""A process's start: the imports every training or evaluating process keeps for its whole life.

Importing torch, torchvision and torch._dynamo (which torch.optim imports on first use) makes
about 340,000 Python objects that live as long as the process. Python's cyclic garbage collector
runs many times during those imports, and each of its full passes afterwards walks every one of
them again, in the training loop and in whatever is imported later (TensorBoard, matplotlib).
`kept_imports` imports with the collector paused and then freezes what exists (`gc.freeze`: those
objects are left out of every later pass). A 1-epoch `speedrun train --recipe tiny --device cpu`
took 8.3-8.8 CPU s before and 5.6-6.6 after on a 2-core box (docs/measurements.md); nothing that
runs changes, only the collector's bookkeeping.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def kept_imports() -> Iterator[None]:
    """Run the block (the imports a process keeps) without the cyclic collector, then freeze every
    object it left, so that later collections skip them; the collector is as it was afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
