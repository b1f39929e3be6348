"""Training throughput (images/s) of one model on synthetic data: speedrun's step settings side by
side with a plain baseline, and the effect of each setting taken away.

    baseline        fp32, NCHW memory layout, eager, torch's default SGD   (torchvision reference defaults)
    speedrun        bf16 autocast on CUDA (fp32 on CPU), channels_last, fused SGD, cuDNN autotuning
                    (speedrun train's step on a GPU)
    no-bf16         speedrun without bf16 (fp32)
    no-channels-last speedrun with NCHW memory
    no-fused        speedrun with torch's default (foreach) SGD
    no-autotune     speedrun without cuDNN autotuning (torch.backends.cudnn.benchmark = False)
    +compile        speedrun with torch.compile                             (speedrun train --compile)

All use the same model, optimizer (SGD momentum, no weight decay on norm/bias) and train step
(`speedrun.learner.train_step`); data are random tensors already on the device, so this measures
the model's step alone. On a GPU:

    PYTHONPATH=src python benchmarks/throughput.py --model resnet50 --sizes 128 224 288 --batch 256 256 192

On the CPU (a quick check that it runs): the defaults below, a small model at small sizes.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from speedrun.files import write_text
from speedrun.learner import choose_precision, device_capability, train_step
from speedrun.model import build_model
from speedrun.optim import build_optimizer
from speedrun.recipe import OptimizerSettings

SPEEDRUN = dict(precision="auto", channels_last=True, compile=False, fused=True, autotune=True)
VARIANTS = {
    "baseline": dict(precision="fp32", channels_last=False, compile=False, fused=False, autotune=True),
    "speedrun": SPEEDRUN,
    "no-bf16": {**SPEEDRUN, "precision": "fp32"},
    "no-channels-last": {**SPEEDRUN, "channels_last": False},
    "no-fused": {**SPEEDRUN, "fused": False},
    "no-autotune": {**SPEEDRUN, "autotune": False},
    "+compile": {**SPEEDRUN, "compile": True},
}


def images_per_second(model_name: str, size: int, batch: int, device: torch.device, steps: int, warmup: int,
                      precision: str, channels_last: bool, compile: bool, fused: bool, autotune: bool,
                      compile_backend: str = "inductor") -> float:
    """Steady-state training images/s: `warmup` untimed steps (cuDNN autotuning, compilation),
    then `steps` timed ones."""
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = autotune
    precision = choose_precision(precision, device.type, device_capability(device))
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    # As the trainer (learner.to_device): channels_last on GPUs only; oneDNN's corrupts the heap
    # for some narrow convolutions, so on the CPU every variant is contiguous.
    layout = torch.channels_last if channels_last and device.type == "cuda" else torch.contiguous_format
    model = build_model(model_name, num_classes=1000, in_chans=3).to(device, memory_format=layout)
    optimizer = build_optimizer(model, OptimizerSettings(weight_decay=1e-4), lr=0.01, fused=fused)
    net = torch.compile(model, dynamic=False, backend=compile_backend) if compile else model
    x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=layout)
    y = torch.randint(0, 1000, (batch,), device=device)
    criterion = nn.CrossEntropyLoss()
    for _ in range(warmup):
        train_step(net, optimizer, criterion, x, y, precision, scaler)
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        train_step(net, optimizer, criterion, x, y, precision, scaler)
    _sync(device)
    return steps * batch / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50" if cuda else "resnet18")
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 224, 288] if cuda else [64, 96])
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 192, 128] if cuda else [16, 16])
    parser.add_argument("--steps", type=int, default=30 if cuda else 3)
    parser.add_argument("--warmup", type=int, default=10 if cuda else 1)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS) if cuda else ["baseline", "speedrun"],
                        choices=list(VARIANTS))
    parser.add_argument("--ablate-at", type=int, metavar="SIZE",
                        help="every --variants entry at this size only; baseline and speedrun at the others "
                             "(on an H200 each variant costs ~12 s, most of it cuDNN autotuning)")
    parser.add_argument("--json", help="also write the images/s per size and variant here")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile's backend for +compile (default: inductor, as `speedrun train "
                             "--compile`; aot_eager traces the same graphs without generating kernels: "
                             "gpu_check.sh's smoke run, which checks the script, not the speed)")
    args = parser.parse_args()
    if len(args.batch) != len(args.sizes):
        parser.error("give one --batch per --sizes entry")
    if args.ablate_at is not None and args.ablate_at not in args.sizes:
        parser.error(f"--ablate-at {args.ablate_at} is not one of --sizes")
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{args.model} training images/s on {name}, torch {torch.__version__}, synthetic data")
    reference = "baseline" if "baseline" in args.variants else args.variants[0]
    print(f"{'size':>6} {'batch':>6} " + " ".join(f"{v:>14}" for v in args.variants) + f"   ratio vs {reference}")
    rows = []
    for size, batch in zip(args.sizes, args.batch):
        variants = [v for v in args.variants
                    if args.ablate_at in (None, size) or v in ("baseline", "speedrun", reference)]
        rates = {v: images_per_second(args.model, size, batch, device, args.steps, args.warmup, **VARIANTS[v],
                                      compile_backend=args.compile_backend)
                 for v in variants}
        ratios = ", ".join(f"{v} {rates[v] / rates[reference]:.2f}x" for v in variants if v != reference)
        cells = (f"{rates[v]:>14.0f}" if v in rates else f"{'-':>14}" for v in args.variants)
        print(f"{size:>6} {batch:>6} " + " ".join(cells) + f"   {ratios}", flush=True)
        rows.append({"size": size, "batch": batch, "images_per_s": {v: round(r, 1) for v, r in rates.items()}})
        if args.json:  # after every size, atomically: a run cut short by a timeout keeps its finished rows
            write_text(args.json, json.dumps({
                "model": args.model, "device": name, "torch": torch.__version__, "steps": args.steps,
                "warmup": args.warmup, "compile_backend": args.compile_backend, "rows": rows,
                "complete": len(rows) == len(args.sizes),  # gpu_check.sh tells this from a run cut short
            }, indent=2))


if __name__ == "__main__":
    main()
