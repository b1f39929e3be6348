"""Sharded validation over real gloo process groups gives exactly the single-process metrics.

21 validation images in batches of 6 make 4 batches (6, 6, 6, 3): 2 ranks get 2 + 2, 3 ranks get
2 + 2 + 0 (an empty rank), so uneven and empty shares are both covered.
"""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from speedrun.data.base import Shard
from speedrun.data.imagefolder import ImageFolderSource
from ranks import start_ranks
from test_data_helpers import make_tree

SIZE, BATCH = 32, 6


def _model() -> torch.nn.Module:
    """A fixed tiny CNN: any input size (global pooling), the same weights in every process."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 7),
    ).eval()


def _metrics(root: str, rect: bool, shard: Shard) -> tuple[torch.Tensor, int]:
    """(loss sum, top-1, top-5, count) over this rank's batches, and how many batches it had."""
    source = ImageFolderSource(root, workers=0)
    mean = torch.tensor(source.mean).view(3, 1, 1)
    std = torch.tensor(source.std).view(3, 1, 1)
    model = _model()
    totals = torch.zeros(4, dtype=torch.float64)
    batches = 0
    with torch.no_grad():
        for images, labels in source.val_batches(SIZE, BATCH, rect, shard):
            logits = model((images.float() - mean) / std).double()
            top5 = logits.topk(5, dim=1).indices
            totals += torch.stack([
                torch.nn.functional.cross_entropy(logits, labels, reduction="sum"),
                (top5[:, 0] == labels).sum().double(),
                (top5 == labels[:, None]).any(dim=1).sum().double(),
                torch.tensor(float(len(labels)), dtype=torch.float64),
            ])
            batches += 1
    return totals, batches


def _rank_main(rank: int, world: int, init: str, root: str, rect: bool, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        totals, batches = _metrics(root, rect, Shard(rank, world))
        dist.all_reduce(totals)
        if rank == 0:
            torch.save(totals, out)
        torch.save(torch.tensor(batches), f"{out}.batches{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("dist") / "d", classes=7, train_per_class=1, val_per_class=3,
                     sizes=[(96, 72), (72, 96), (120, 60), (64, 64), (60, 110), (100, 70)])


# Each rank costs seconds: square validation only at world 3.
@pytest.mark.slow
@pytest.mark.parametrize("world,rect", [(1, True), (2, True), (3, True), (3, False)])
def test_sharded_validation_matches_one_process(tree, tmp_path, world, rect):
    root = str(tree)
    expected, batches = _metrics(root, rect, Shard())
    assert batches == 4 and expected[3] == 21  # 7 classes x 3 images; 21 / 6 -> 4 batches
    out = str(tmp_path / "metrics.pt")
    init = f"file://{tmp_path / 'rendezvous'}"
    ranks = start_ranks(_rank_main, (world, init, root, rect, out), world)
    deadline = time.monotonic() + 300
    while not ranks.join(timeout=2):  # raises if a rank failed
        if time.monotonic() > deadline:  # a hang fails the test instead of stalling the suite
            for p in ranks.processes:
                p.kill()
            pytest.fail(f"{world} ranks did not finish in 300 s")
    got = torch.load(out)
    # Counts are exact; the loss sum differs only by float64 summation order.
    assert got[1:].tolist() == expected[1:].tolist()
    assert torch.allclose(got[0], expected[0], rtol=1e-12, atol=0)
    per_rank = [int(torch.load(f"{out}.batches{r}")) for r in range(world)]
    assert per_rank == {1: [4], 2: [2, 2], 3: [2, 2, 0]}[world]


def _index_rank(rank: int, world: int, init: str, root: str, out: str) -> None:
    from speedrun.data.index import load_index_once
    from speedrun.dist import DistContext, JobShare

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        index = load_index_once(root, JobShare(DistContext(rank, world, 0, torch.device("cpu"))), workers=1)
        torch.save({"checked": vars(index.checked), "paths": index.train.paths.tolist() + index.val.paths.tolist()},
                   f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_in_a_job_rank_0_builds_the_index_and_the_others_read_it_without_walking(tmp_path):
    root = make_tree(tmp_path / "d", classes=3, train_per_class=4, val_per_class=2)
    out = str(tmp_path / "index")
    ranks = start_ranks(_index_rank, (3, f"file://{tmp_path / 'rendezvous'}", str(root), out), 3)
    deadline = time.monotonic() + 300
    while not ranks.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail("3 ranks did not finish in 300 s")
    seen = [torch.load(f"{out}.{r}") for r in range(3)]
    assert seen[0]["checked"]["headers"] == 18 and seen[0]["checked"]["written"]
    for other in seen[1:]:  # no folder listed, no header read: rank 0's cache, read as written
        assert (other["checked"]["folders"], other["checked"]["headers"]) == (0, 0)
        assert other["paths"] == seen[0]["paths"]
