"""What an image-folder index costs at ImageNet's size: this speedrun's loader beside the old one.

Generates ImageNet-shaped trees (1,000 class folders in train/ and in val/, 10 val images per
class, the rest in train/; small real JPEGs, 16 distinct ones written over and over) of each
`--sizes` total, once, under `--dir` (kept between runs, outside git). On each tree, for the old
loader (`--old-rev`'s src/speedrun/data/index.py, which stats every file on every load, with a
cache of its own) and the new one (trusted by folder):

- cold build (no cache), warm load (nothing changed), and a warm load after 1,000 files were
  added in 10 folders;
- each as seconds and the loading process's peak RSS (a run of its own), then the number of
  path stat calls (stat, lstat, newfstatat, statx) counted by `strace -f -c` over the process
  and its header-reading workers (a second run; Python's own start, measured alone, subtracted).
  The count does not depend on this disk: on NFS or EFS each such call is a round trip.

Then 8 processes loading the largest tree at once (8 nodes starting on one file system, each
on its own): wall time until all are done, and their stat calls together.

    python benchmarks/index_scale.py                                  # 100k, 400k, 1.28M files
    python benchmarks/index_scale.py --sizes 20000 --json /tmp/i.json # a quick look
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
STAT_CALLS = ("stat", "lstat", "newfstatat", "statx")
CLASSES, VAL_PER_CLASS = 1000, 10


# ---------------------------------------------------------------------------------------------
# The trees


def jpegs() -> list[bytes]:
    """16 small real JPEGs (24-48 px a side, 4:3 and 3:4), a few hundred bytes each."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for i in range(16):
        w, h = (48, 36) if i % 2 else (36, 48)
        w, h = w - 2 * (i % 4) * 3, h - 2 * (i % 4) * 3
        low = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(low).resize((w, h), Image.Resampling.BILINEAR).save(buf, "JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def make_tree(root: Path, total: int) -> Path:
    """root/{train,val}/nNNNNNNNN/nNNNNNNNN_K.JPEG, `total` files; skipped when already made."""
    if (root / ".complete").exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    blobs = jpegs()
    per_train = (total - CLASSES * VAL_PER_CLASS) // CLASSES
    k = 0
    t = time.perf_counter()
    for split, per in (("train", per_train), ("val", VAL_PER_CLASS)):
        for c in range(CLASSES):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            for i in range(per):
                with open(folder / f"n{c:08d}_{i}.JPEG", "wb") as f:
                    f.write(blobs[k % len(blobs)])
                k += 1
    (root / ".complete").write_text(f"{k}\n")
    print(f"made {root}: {k:,} files in {time.perf_counter() - t:.0f} s", flush=True)
    return root


def add_files(root: Path, tag: str, folders: int = 10, per_folder: int = 100) -> list[Path]:
    """1,000 new files in 10 train folders picked by `tag` (distinct tags: distinct folders)."""
    blob = jpegs()[0]
    rng = random.Random(tag)
    made = []
    for c in rng.sample(range(CLASSES), folders):
        for i in range(per_folder):
            path = root / "train" / f"n{c:08d}" / f"added-{tag}-{i}.JPEG"
            path.write_bytes(blob)
            made.append(path)
    return made


# ---------------------------------------------------------------------------------------------
# One load, in a process of its own (`--child`)

OLD_CACHE = ".speedrun-index-v1.npz"


def child(which: str, root: str, old_module: str) -> None:
    """Load the index of `root` with the `which` loader and print one JSON line of figures."""
    sys.path.insert(0, str(SRC))
    import numpy  # noqa: F401  (before `before`: the fixed cost, not the index's)
    from speedrun.data import transforms  # noqa: F401  (PIL, which both loaders read headers with)
    if which == "old":
        import importlib.util

        spec = importlib.util.spec_from_file_location("old_index", old_module)
        module = importlib.util.module_from_spec(spec)
        sys.modules["old_index"] = module  # dataclasses look their module up while it runs
        spec.loader.exec_module(module)
        module.CACHE_NAME = OLD_CACHE  # its own cache, beside the new one's
        load = module.load_index
    elif which == "new":
        from speedrun.data.index import load_index as load
    else:  # "start": Python and the imports alone, for the baseline
        import numpy  # noqa: F401
        from speedrun.data import index  # noqa: F401

        print(json.dumps({"seconds": 0}))
        return
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = time.perf_counter()
    index = load(root, workers=2)
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    arrays = [getattr(split, f) for split in (index.train, index.val) for f in ("paths", "labels", "widths", "heights")]
    print(json.dumps({"seconds": seconds, "peak_rss_mb": peak, "rss_before_mb": before,
                      "images": len(index.train) + len(index.val), "index_mb": sum(a.nbytes for a in arrays) / 2**20}))


def run_child(which: str, root: Path, old_module: Path, strace: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", which, str(root), str(old_module)]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    if not strace:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    return {"stat_calls": stat_calls(cmd, env)}


def stat_calls(cmd: list[str], env: dict) -> int:
    """Path stat calls made by `cmd` and every process it starts, from `strace -f -c`'s table."""
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as summary:
        subprocess.run(["strace", "-f", "-c", "--seccomp-bpf", "-e", f"trace={','.join(STAT_CALLS)}",
                        "-o", summary.name, *cmd], capture_output=True, text=True, env=env, check=True)
        table = summary.read()
    total = 0
    for line in table.splitlines():
        parts = line.split()
        if parts and parts[-1] in STAT_CALLS and re.fullmatch(r"\d+", parts[3]):
            total += int(parts[3])
    return total


def cache_of(which: str, root: Path) -> Path:
    return root / (OLD_CACHE if which == "old" else ".speedrun-index.npz")


def measure(which: str, root: Path, old_module: Path, baseline: int, cold: bool = False) -> dict:
    """Seconds and peak RSS from one run, stat calls (less Python's start) from another; `cold`:
    the loader's cache removed before each."""
    if cold:
        cache_of(which, root).unlink(missing_ok=True)
    figures = run_child(which, root, old_module, strace=False)
    if cold:
        cache_of(which, root).unlink(missing_ok=True)
    figures["stat_calls"] = run_child(which, root, old_module, strace=True)["stat_calls"] - baseline
    return figures


def at_once(which: str, root: Path, old_module: Path, n: int, baseline: int) -> dict:
    """`n` processes loading `root` together: wall time until the last is done, stat calls of all."""
    argv = [sys.executable, __file__, "--child", which, str(root), str(old_module)]
    script = (f"import subprocess, sys; ps = [subprocess.Popen({argv!r}, "
              f"stdout=subprocess.DEVNULL) for _ in range({n})]; sys.exit(max(p.wait() for p in ps))")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", script], env=env, check=True)
    seconds = time.perf_counter() - t
    calls = stat_calls([sys.executable, "-c", script], env) - n * baseline
    return {"processes": n, "seconds": seconds, "stat_calls": calls}


# ---------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "speedrun-bench" / "index-scale")
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 400_000, 1_281_167])
    p.add_argument("--old-rev", default="2e4788b", help="git revision whose index.py is 'the old loader'")
    p.add_argument("--at-once", type=int, default=8, help="processes loading the largest tree together")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    repo = Path(__file__).resolve().parent.parent
    old_module = args.dir / f"old_index_{args.old_rev}.py"
    args.dir.mkdir(parents=True, exist_ok=True)
    old_module.write_text(subprocess.run(["git", "-C", str(repo), "show", f"{args.old_rev}:src/speedrun/data/index.py"],
                                         capture_output=True, text=True, check=True).stdout)
    baseline = run_child("start", args.dir, old_module, strace=True)["stat_calls"]
    print(f"Python's start with the imports: {baseline} stat calls (subtracted below)", flush=True)
    results = {"old_rev": args.old_rev, "python_start_stat_calls": baseline, "trees": []}
    for total in args.sizes:
        root = make_tree(args.dir / f"tree-{total}", total)
        row: dict = {"files": total, "folders": 2 * CLASSES}
        for which in ("old", "new"):
            row[f"{which}_cold"] = measure(which, root, old_module, baseline, cold=True)
        for which in ("old", "new"):
            row[f"{which}_warm"] = measure(which, root, old_module, baseline)
        added = []
        try:
            # Each measurement's runs see 1,000 files the cache has not seen: a batch per run.
            for which in ("old", "new"):
                added += add_files(root, f"{which}-timed")
            for which in ("old", "new"):
                row[f"{which}_added"] = run_child(which, root, old_module, strace=False)
            for which in ("old", "new"):
                added += add_files(root, f"{which}-counted")
            for which in ("old", "new"):
                counted = run_child(which, root, old_module, strace=True)["stat_calls"]
                row[f"{which}_added"]["stat_calls"] = counted - baseline
        finally:
            for path in added:
                path.unlink()
            # Their folders dated a minute back: a folder changed just before its cache was
            # written is not trusted, and the next figures are of a tree at rest.
            then = time.time_ns() - 60 * 10**9
            for folder in {path.parent for path in added}:
                os.utime(folder, ns=(then, then))
        if total == max(args.sizes) and args.at_once:
            for which in ("old", "new"):
                run_child(which, root, old_module, strace=False)  # a cache that holds the tree as it is
                row[f"{which}_at_once"] = at_once(which, root, old_module, args.at_once, baseline)
        results["trees"].append(row)
        report(row)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")


def report(row: dict) -> None:
    print(f"\n{row['files']:,} files in {row['folders']:,} folders")
    print(f"{'':24}{'old: s':>9}{'RSS MB':>9}{'stats':>11}   {'new: s':>9}{'RSS MB':>9}{'stats':>11}")
    for case, label in (("cold", "cold build"), ("warm", "warm load"), ("added", "after 1,000 added")):
        cells = []
        for which in ("old", "new"):
            f = row[f"{which}_{case}"]
            cells.append(f"{f['seconds']:9.2f}{f.get('peak_rss_mb', float('nan')):9.0f}{f['stat_calls']:11,}")
        print(f"{label:24}{cells[0]}   {cells[1]}")
    if "new_at_once" in row:
        o, n = row["old_at_once"], row["new_at_once"]
        print(f"{o['processes']} processes at once     {o['seconds']:9.2f}{'':9}{o['stat_calls']:11,}   "
              f"{n['seconds']:9.2f}{'':9}{n['stat_calls']:11,}")
    print(flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
    else:
        main()
