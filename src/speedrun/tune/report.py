"""What a search leaves: its trials as records and a table sorted by the objective, `best_recipe.py`
(a recipe file `speedrun train --recipe` takes, its provenance in its docstring) and `tune.png`
(the objective per trial; accuracy against wall time for the best five)."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speedrun.files import read_jsonl
from speedrun.recipes import recipe_source
from speedrun.tune.space import apply, describe
from speedrun.tune.study import Search

UNITS = {"time": ("time to target", "s"), "cost": ("$ to target", "$")}


@dataclass(frozen=True)
class TrialRecord:
    """One trial as the study holds it."""

    number: int
    state: str  # complete, pruned, not_reached, stopped (the budget, the search), failed, running
    params: dict[str, Any]
    value: float | None  # the objective's figure (s or $), complete trials only
    why: str | None  # why it was pruned, stopped or failed
    dir: str | None  # its run directory, relative to the search's

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def records(study) -> list[TrialRecord]:
    """Every trial, the best first (complete ones by their value, then the rest by number)."""
    out = []
    for t in study.get_trials(deepcopy=False):
        state = t.user_attrs.get("state", "running")
        out.append(TrialRecord(t.number, state, dict(t.params), t.value if state == "complete" else None,
                               t.user_attrs.get("why"), t.user_attrs.get("dir")))
    return sorted(out, key=lambda r: (r.value is None, r.value if r.value is not None else 0, r.number))


def fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def rows(found: list[TrialRecord], objective: str) -> list[dict[str, str]]:
    """Printable rows: the trial, its parameters, the objective's figure, its state and why."""
    label, unit = UNITS[objective]
    names = sorted({k for r in found for k in r.params})
    out = []
    for r in found:
        figure = "-" if r.value is None else (f"{r.value:.1f} s" if unit == "s" else f"${r.value:.4g}")
        out.append({"trial": str(r.number), **{k: fmt(r.params[k]) if k in r.params else "-" for k in names},
                    label: figure, "state": r.state, "why": r.why or ""})
    return out


def write_best_recipe(out: Path, search: Search, best: TrialRecord, trials: int) -> Path:
    """best_recipe.py in `out`: the recipe `best`'s parameters make, with where it came from."""
    recipe = apply(search.recipe, best.params, f"{search.recipe.name}-tuned")
    label, unit = UNITS[search.objective]
    figure = f"{best.value:.1f} s" if unit == "s" else f"${best.value:.4g}"
    params = "\n".join(f"    {k} = {fmt(v)}" for k, v in sorted(best.params.items()))
    space = "\n".join(f"    {k}: {v}" for k, v in describe(search.space).items())
    doc = (f'"""{recipe.name}: {search.recipe.name} as tuned by `speedrun tune` on {time.strftime("%Y-%m-%d")}.\n\n'
           f"Trial {best.number} of {trials} in {out.resolve()} (its run: {best.dir}):\n"
           f"{label} {search.recipe.target}: {figure} (objective: {search.objective}, seed {search.seed}).\n\n"
           f"Its parameters:\n{params}\n\nThe space searched:\n{space}\n"
           f'"""\n')
    path = out / "best_recipe.py"
    path.write_text(recipe_source(recipe, doc))
    return path


def plot(out: Path, found: list[TrialRecord], objective: str, metric: str, target: float) -> Path:
    """tune.png: each trial's figure (pruned and failed ones marked at the top), and the target's
    metric against wall time for the five best trials."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label, unit = UNITS[objective]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    done = [r for r in found if r.value is not None]
    top = max((r.value for r in done), default=1.0) * 1.1
    left.scatter([r.number for r in done], [r.value for r in done], label="reached the target")
    for state, marker in (("pruned", "v"), ("not_reached", "x"), ("stopped", "s"), ("failed", "X")):
        numbers = [r.number for r in found if r.state == state]
        if numbers:
            left.scatter(numbers, [top] * len(numbers), marker=marker, label=state.replace("_", " "))
    left.set_xlabel("trial")
    left.set_ylabel(f"{label} ({unit})")
    left.grid(alpha=0.3)
    left.legend(loc="lower right", fontsize="small")
    for r in done[:5]:
        evals = read_jsonl(out / r.dir / "metrics.jsonl") if r.dir and (out / r.dir / "metrics.jsonl").exists() else []
        right.plot([e["wall_s"] for e in evals], [100 * e[metric] for e in evals], marker="o",
                   label=f"trial {r.number}")
    right.axhline(100 * target, color="gray", linestyle="--", label="target")
    right.set_xlabel("wall time since the trial's start (s)")
    right.set_ylabel(f"validation {metric} (%)")
    right.grid(alpha=0.3)
    right.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    path = out / "tune.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
