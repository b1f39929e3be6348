"""A user's own small image folder: `speedrun train --recipe folder-small` against fastai, the peer
such a user would reach for (the library of the team behind the 2018 record), side by side.

Both train the same model (`resnet-fmnist`) on the same folder, one after the other on this
machine: fastai 2.8 with its defaults (benchmarks/fastai_folder.py: lr_find, one-cycle Adam,
aug_transforms, 14 epochs), speedrun with the built-in `folder-small` recipe fitted to the folder.
Clocks start when each process is launched and include evaluation. Reported: each side's
accuracy over wall time, the end, accuracy at equal time, and the time each needs to reach the
other's final accuracy.

The folder (made if missing): 4,000 training and 1,000 validation images of 48 x 48 px, Fashion-
MNIST garments at random scale and position on a textured background (`speedrun data synth
fmnist-tree DST --side 48 --train 4000 --val 1000`). fastai is installed for this benchmark only,
in benchmarks/.venv-fastai, by a separate step that downloads it from PyPI (fastai 2.8.4 declares
torch<2.9, and runs on this machine's torch with the pins below); the benchmark itself sends
nothing over the network.

    python benchmarks/folder_peer.py --install-fastai   # once
    python benchmarks/folder_peer.py                    # about 10 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv-fastai"
FASTAI_PINS = ["fastai==2.8.4", "fastcore>=1.8,<1.9", "fasttransform==0.0.2", "fastprogress==1.0.3",
               "fastdownload==0.0.7", "plum-dispatch"]
FASTAI_DEPS = ["pandas", "scipy", "scikit-learn", "matplotlib", "requests", "pyyaml", "beartype"]


def install_fastai() -> None:
    """Make the benchmark's fastai environment (downloads from PyPI)."""
    python = VENV / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)], check=True)
    # --no-deps: fastai's torch<2.9 pin would replace this machine's torch.
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *FASTAI_PINS], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *FASTAI_DEPS], check=True)


def fastai_python() -> Path:
    """The Python of the benchmark's fastai environment."""
    python = VENV / "bin" / "python"
    if not python.exists():
        sys.exit(f"no fastai environment at {VENV}: "
                 "make it once with python benchmarks/folder_peer.py --install-fastai")
    return python


def run_fastai(data: Path, side: int, epochs: int) -> list[dict]:
    t0 = time.time()
    proc = subprocess.run([str(fastai_python()), str(HERE / "fastai_folder.py"),
                           str(data), str(side), str(epochs), str(t0)],
                          capture_output=True, text=True, env={**_env(), "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        sys.exit(f"fastai failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return [r for r in rows if "epoch" in r]


def run_speedrun(data: Path, out: Path) -> tuple[list[dict], dict]:
    proc = subprocess.run([sys.executable, "-m", "speedrun", "train", "--recipe", "folder-small", "--data", str(data),
                           "--target", "none", "--out", str(out)], capture_output=True, text=True, env=_env())
    if proc.returncode != 0:
        sys.exit(f"speedrun failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    results = json.loads((out / "results.json").read_text())
    return [{"epoch": r["epoch"], "wall_s": r["wall_s"], "top1": r["top1"]} for r in rows], results


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}


def best_by(curve: list[dict], seconds: float) -> float | None:
    """Best top-1 among the evaluations finished within `seconds`."""
    seen = [r["top1"] for r in curve if r["wall_s"] <= seconds]
    return max(seen) if seen else None


def time_to(curve: list[dict], top1: float) -> float | None:
    return next((r["wall_s"] for r in curve if r["top1"] >= top1), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("/tmp/speedrun-bench/fmnist48-4k"))
    parser.add_argument("--fastai-epochs", type=int, default=14)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "folder-peer-cpu.json")
    parser.add_argument("--install-fastai", action="store_true", help="make benchmarks/.venv-fastai (PyPI) and stop")
    args = parser.parse_args()
    if args.install_fastai:
        install_fastai()
        return

    sys.path.insert(0, str(HERE.parent / "src"))
    from speedrun.data import folder_summary
    from speedrun.data.synth import fmnist_tree

    if not (args.data / "train").is_dir():
        fmnist_tree(args.data, 4000, 1000, side=48)
    side, count = folder_summary(str(args.data))

    fastai = run_fastai(args.data, side, args.fastai_epochs)
    run_dir = Path(f"/tmp/speedrun-bench/folder-peer-{time.strftime('%Y%m%d-%H%M%S')}")
    speedrun, results = run_speedrun(args.data, run_dir)

    equal = min(fastai[-1]["wall_s"], speedrun[-1]["wall_s"])
    report = {
        "what": f"benchmarks/folder_peer.py: {count} training images of {side} px ({args.data}), resnet-fmnist on both "
                "sides, one after the other on this machine; clocks from process launch, evaluation included",
        "date": time.strftime("%Y-%m-%d"),
        "fastai": {"epochs": len(fastai), "final_top1": fastai[-1]["top1"], "wall_s": fastai[-1]["wall_s"],
                   "curve": fastai},
        "speedrun": {"recipe": results["recipe"]["name"], "epochs": len(speedrun), "final_top1": speedrun[-1]["top1"],
                     "wall_s": speedrun[-1]["wall_s"], "curve": speedrun},
        "equal_time_s": equal,
        "best_top1_by_equal_time": {"fastai": best_by(fastai, equal), "speedrun": best_by(speedrun, equal)},
        "time_to_fastai_final": {"fastai": time_to(fastai, fastai[-1]["top1"]),
                                 "speedrun": time_to(speedrun, fastai[-1]["top1"])},
    }
    mine, theirs = report["time_to_fastai_final"]["speedrun"], report["time_to_fastai_final"]["fastai"]
    report["ratio_time_to_fastai_final"] = mine / theirs if mine else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")

    print(f"{'':10} {'epochs':>6} {'final top-1':>12} {'wall':>8}   best by {equal:.0f} s")
    for name in ("fastai", "speedrun"):
        r = report[name]
        print(f"{name:10} {r['epochs']:>6} {100 * r['final_top1']:>11.2f}% {r['wall_s']:>7.0f}s   "
              f"{100 * report['best_top1_by_equal_time'][name]:.2f}%")
    ratio = report["ratio_time_to_fastai_final"]
    print(f"time to fastai's final {100 * fastai[-1]['top1']:.2f}%: speedrun {mine and f'{mine:.0f} s'} / fastai "
          f"{theirs:.0f} s = {f'{ratio:.2f}x' if ratio else 'not reached'}; written to {args.out}")


if __name__ == "__main__":
    main()
