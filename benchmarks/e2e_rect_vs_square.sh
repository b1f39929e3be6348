#!/usr/bin/env bash
# End to end through the CLI: `speedrun train` on the learnable generated tree (Fashion-MNIST
# garments placed off-centre on canvases of varied aspect ratio), the same recipe twice, once
# with rectangular and once with square validation at the same size (48 px). Training is
# deterministic (--deterministic, same seed), so the two runs differ only in validation.
#
#   bash benchmarks/e2e_rect_vs_square.sh                 # CPU, ~45 min on 2 cores
#   DEVICE=cuda WORKERS=16 bash benchmarks/e2e_rect_vs_square.sh
#
# Env: WORK (default a temp dir), DEVICE (cpu|cuda, default cpu), WORKERS (default 2),
# TRAIN / VAL (images, default 8000 / 2000), EPOCHS (default 8), FMNIST (IDX folder).
set -euo pipefail
WORK=${WORK:-$(mktemp -d -t speedrun-e2e-XXXX)}
DEVICE=${DEVICE:-cpu}
WORKERS=${WORKERS:-2}
TRAIN=${TRAIN:-8000}
VAL=${VAL:-2000}
EPOCHS=${EPOCHS:-8}
SPEEDRUN=${SPEEDRUN:-speedrun}

[ -d "$WORK/fm/train" ] || $SPEEDRUN data synth fmnist-tree "$WORK/fm" --train "$TRAIN" --val "$VAL" --workers "$WORKERS" ${FMNIST:+--source "$FMNIST"}

for mode in rect square; do
  rect=$([ $mode = rect ] && echo True || echo False)
  cat > "$WORK/recipe_$mode.py" <<EOF
from speedrun.recipe import OptimizerSettings, Phase, Recipe

_data = dict(size=48, batch_size=128, min_scale=0.35, rect_val=$rect)
recipe = Recipe(
    name="fmnist-tree-$mode",
    model="resnet-fmnist",
    dataset="imagefolder",
    optimizer=OptimizerSettings(name="sgd", momentum=0.9, nesterov=True, weight_decay=5e-4, label_smoothing=0.1),
    phases=(
        Phase(0, 1, lr=(0.05, 0.3), **_data),
        Phase(1, $EPOCHS, lr=(0.3, 0.0), **_data),
    ),
)
EOF
  $SPEEDRUN train --recipe "$WORK/recipe_$mode.py" --data "$WORK/fm" --device "$DEVICE" --workers "$WORKERS" \
    --target none --checkpoint-every 0 --deterministic --seed 0 --out "$WORK/run_$mode"
done

python3 - "$WORK" <<'EOF'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
for mode in ("rect", "square"):
    evals = [json.loads(line) for line in (work / f"run_{mode}" / "metrics.jsonl").read_text().splitlines()]
    curve = " ".join(f"{100 * e['top1']:.2f}" for e in evals)
    print(f"{mode:6s} validation at 48 px: final top-1 {100 * evals[-1]['top1']:.2f}% "
          f"(top-5 {100 * evals[-1]['top5']:.2f}%, {evals[-1]['count']} images); top-1 by epoch: {curve}")
EOF
