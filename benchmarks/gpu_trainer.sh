#!/usr/bin/env bash
# The trainer's GPU check, prepared to run in one go on one H200 (each step has its own timeout,
# 5.5 minutes in all at the most, so that it fits what is left of this project's device time):
#   1. ResNet-50 training images/s at 128, 224 and 288 px on synthetic data: fp32/NCHW/eager
#      baseline vs bf16 + channels_last, eager and compiled (benchmarks/throughput.py);
#   2. Fashion-MNIST time to 93% top-1 with the default recipe (speedrun train on CUDA).
# Runs from a checkout without installing: PYTHONPATH=src. Fashion-MNIST is looked up as usual
# (set SPEEDRUN_DATA to a folder holding fashion-mnist/*.gz on a machine without the Debian
# package). Results go to $OUT when set (the device tool's output folder), else ./gpu-results.
# On a lent, offline GPU machine: copy the four .gz files into an ignored folder (e.g.
# .gpu/fashion-mnist/), carry it, and run `SPEEDRUN_DATA=$PWD/.gpu bash benchmarks/gpu_trainer.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)" | tee -a "$out/device.txt"

echo "== Fashion-MNIST, default recipe, target 93% top-1"
timeout 100 python3 -m speedrun train --device cuda --target top1=0.93 --checkpoint-every 0 \
    --out /tmp/speedrun-fm93 2>&1 | tail -20 | tee "$out/fashion_mnist.txt"
cp /tmp/speedrun-fm93/results.json "$out/fashion_mnist_results.json" 2>/dev/null

echo "== ResNet-50 throughput, eager"
timeout 80 python3 benchmarks/throughput.py --variants baseline speedrun 2>&1 | tee "$out/throughput_eager.txt"

echo "== ResNet-50 throughput, torch.compile"
timeout 150 python3 benchmarks/throughput.py --variants +compile 2>&1 | tee "$out/throughput_compile.txt"
