"""A minimal distributed job for launch tests: every process joins the gloo group torchrun describes,
sums its rank + 1 with all the others (all_reduce) and writes what it saw to <out>/rank<R>.json."""
import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
record = {"rank": rank, "world_size": world, "sum": total.item(), "task": os.environ.get("SPEEDRUN_TASK"),
          "run_dir": os.environ.get("SPEEDRUN_RUN_DIR")}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(record, f)
print(f"rank {rank} of {world}: sum {total.item():g}")
dist.destroy_process_group()
