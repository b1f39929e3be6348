"""Which trials to stop: asynchronous successive halving (Li et al. 2018, "ASHA") over wall time.

Rungs lie at `first_rung_s * eta**k` seconds of a trial's own wall time (its evaluations' `wall_s`,
from its process start). When a trial's evaluations pass a rung, its progress there (the best value
of the target's metric among its evaluations up to the rung) is set against what every other trial
had reached by the same elapsed time: trials still running or stopped later than the rung by what
they had at it, trials that ended before it by their last best (a trial that reached the target
stays at the top of every later rung). The trial goes on only if it is among the best
max(1, n // eta) of the n trials there (itself included), else it is stopped at a step: Optuna's
SuccessiveHalvingPruner rule, over seconds instead of steps. A trial that is first to a rung
always goes on.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    """A trial judged at a rung: whether it goes on, its value there, and the bar it had to reach."""

    rung_s: float
    value: float
    bar: float
    others: int  # other trials at the rung
    go_on: bool

    def why(self, metric: str) -> str:
        return (f"behind at the {self.rung_s:g} s rung: {metric} {self.value:.4f} against {self.bar:.4f} "
                f"(the best 1/eta of {self.others + 1} trials there)")


def rungs(first_rung_s: float, eta: int, until_s: float) -> list[float]:
    """The rung times, seconds, up to `until_s`."""
    out, r = [], first_rung_s
    while r <= until_s:
        out.append(r)
        r *= eta
    return out


def best_by(evals: list[dict], metric: str, at_s: float) -> float | None:
    """The best `metric` among the evaluations made by `at_s` seconds of wall time; None: none yet."""
    seen = [e[metric] for e in evals if e["wall_s"] <= at_s and e.get(metric) is not None]
    return max(seen) if seen else None


def judge(evals: list[dict], others: list[tuple[list[dict], bool]], metric: str, rung_s: float,
          eta: int) -> Verdict | None:
    """The verdict on a trial with `evals` at `rung_s`, or None when it has nothing to show by then.
    `others`: every other trial's evaluations and whether it has ended; only those that lasted to
    the rung (or ended) count, by what they had at it."""
    mine = best_by(evals, metric, rung_s)
    if mine is None:
        return None
    values = [mine]
    for their, ended in others:
        lasted = bool(their) and their[-1]["wall_s"] >= rung_s
        if lasted or ended:
            value = best_by(their, metric, rung_s if lasted else float("inf"))
            if value is not None:
                values.append(value)
    values.sort(reverse=True)
    bar = values[max(1, len(values) // eta) - 1]
    return Verdict(rung_s, mine, bar, len(values) - 1, mine >= bar)
