"""The search's controller: one process owns the Optuna study (ask and tell; only it writes the
storage) and runs the trials, `parallel` at a time, on this machine (trials.py).

Each trial is a recipe from the space (space.apply) trained to the target. Its value is what the
objective says it took to get there: `time_to_target_s` or `cost_to_target_usd` from its
results.json. A trial behind the others at a rung of wall time (asha.py) is stopped at a step and
told to Optuna as pruned; so is one that ended without reaching the target (Optuna's TPE ranks
pruned trials below every complete one). A trial that fails is told as failed with its reason and
the search goes on; the same failure three times in a row ends it (exit 3). Bad input reported by a
trial (exit 2) ends it at once.

What a trial's fate was is kept in its Optuna user attributes (`state`, `why`, `dir`, and for a
pruned one `rung_s`, `value`, `bar`, `step`, `checkpoint`), and the decision to stop one is written
before it is asked to stop: a controller started again (the same command, after Ctrl-C or a lost
controller) tells every trial what it became, adopts those still running, resumes those stopped
with a checkpoint, and never starts one twice.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speedrun.errors import EXIT_BAD_INPUT, EXIT_FAILED, SpeedrunError, one_line
from speedrun.money import Price
from speedrun.recipe import Recipe
from speedrun.recipes import recipe_source
from speedrun.tune import asha
from speedrun.tune.space import Dimension, apply
from speedrun.tune.trials import JobTrials, LocalTrials, TrialRun, same_failure

SAME_FAILURES = 3  # this many failures of one kind in a row end the search
STUDY_NAME = "speedrun-tune"
OBJECTIVES = {"time": "time_to_target_s", "cost": "cost_to_target_usd"}  # --objective -> results.json's field
COMPLETE = ("finished", "target_reached")


class StudyFailed(SpeedrunError):
    """The search cannot go on (the same failure again and again, its storage gone): exit 3."""

    exit_code = EXIT_FAILED


@dataclass(frozen=True)
class Search:
    """What a search is: the recipe (with its target), the space, the objective and how trials run."""

    recipe: Recipe
    space: dict[str, Dimension]
    trials: int  # trials in all (every state), this run and earlier ones of the same search
    parallel: int = 1  # trials at a time
    objective: str = "time"  # OBJECTIVES
    budget_s: float | None = None  # seconds of the search's wall time, every run of it together
    seed: int = 0  # the sampler's and every trial's
    data: str | None = None
    train_args: tuple[str, ...] = ()  # more `speedrun train` options for every trial
    first_rung_s: float = 60.0  # seconds of a trial's wall time at the first rung
    eta: int = 3  # ASHA's reduction factor
    price: Price | None = None  # what a trial's machine costs (the trials' PRICE_ENV), for --objective cost

    def plan(self) -> dict[str, Any]:
        """What must stay the same for a search to be continued (JSON data)."""
        return json.loads(json.dumps({
            "recipe": self.recipe.to_dict(), "space": {k: repr(v) for k, v in self.space.items()},
            "objective": self.objective, "seed": self.seed, "data": self.data, "train_args": list(self.train_args),
            "first_rung_s": self.first_rung_s, "eta": self.eta}))


def storage_url(out: Path, storage: str | None) -> str:
    """`storage`, or the SQLite file in the search's directory (only the controller writes it). A
    plain postgresql:// URL means SQLAlchemy's default driver, psycopg2; with only psycopg (3, the
    `speedrun[postgres]` extra) installed, it is the one used."""
    if storage is None:
        return f"sqlite:///{(out / 'study.db').resolve()}"
    if storage.startswith("postgresql://"):
        import importlib.util

        if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
            return "postgresql+psycopg://" + storage.removeprefix("postgresql://")
    return storage


def shown(url: str) -> str:
    """A storage URL fit to print: its password hidden."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy reads: Optuna will say so
        return url


def open_study(url: str, search: Search):
    """The study at `url`, made or continued; SpeedrunError when it holds another search,
    StudyFailed when its storage does not answer."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    engine = {"connect_args": {"connect_timeout": 10}} if url.startswith("postgresql") else {}
    try:
        storage = optuna.storages.RDBStorage(url, engine_kwargs=engine)
        study = optuna.create_study(storage=storage, study_name=STUDY_NAME, direction="minimize", load_if_exists=True)
    except SQLAlchemyError as e:
        raise StudyFailed(f"the study's storage {shown(url)} does not answer: {one_line(e.orig or e)}") from None
    except (ValueError, ImportError) as e:  # a URL Optuna cannot use, a driver not installed
        raise SpeedrunError(f"--storage {shown(url)}: {one_line(e)}") from None
    plan = study.user_attrs.get("plan")
    if plan is None:
        study.set_user_attr("plan", search.plan())
    elif plan != search.plan():
        differ = [k for k in plan if plan[k] != search.plan().get(k)]
        raise SpeedrunError(f"the study in {shown(url)} is another search (its {', '.join(differ)} differ): "
                            "choose another --out (or --storage)")
    # Seeded by what the study already holds: a continued search does not draw its first trials' values again.
    study.sampler = optuna.samplers.TPESampler(seed=search.seed + len(study.trials), constant_liar=True)
    return study


class Controller:
    """Runs a search to its end (see the module's text)."""

    def __init__(self, out: Path, search: Search, study, say: Callable[[str], None],
                 trials: LocalTrials | JobTrials, env: dict[str, str]):
        self.out, self.search, self.study, self.say = out, search, study, say
        self.trials, self.env = trials, env  # where trials run, and their environment
        self.metric = search.recipe.target.metric
        self.running: dict[int, TrialRun] = {}
        self.trial_ids: dict[int, int] = {t.number: t._trial_id for t in study.trials}
        self.ended_evals: dict[int, list[dict]] = {}  # the ended trials' evaluations, for the rungs
        self.failures: list[str] = []  # the reasons of the last failures in a row
        self.ending: str | None = None  # why no trial is started any more
        self.failed: str | None = None  # why the search failed (exit 3), when it did
        self.started = time.monotonic()
        self.spent_before = float(study.user_attrs.get("spent_s", 0.0))

    def run(self) -> None:
        """Until `trials` trials have ended (or the budget is spent, or the search failed)."""
        import optuna

        for t in self.study.get_trials(deepcopy=False):
            if t.state != optuna.trial.TrialState.RUNNING:
                self.ended_evals[t.number] = self.trials.existing(t.number, t.user_attrs).evals()
        try:
            self.take_over()
            while True:
                self.reap()
                self.judge()
                self.check_budget()
                self.fill()
                if not self.running:
                    break
                time.sleep(self.trials.poll_s)
        except KeyboardInterrupt:
            self.halt()
            raise KeyboardInterrupt(f"search stopped, {len(self.running)} trial(s) at a step: "
                                    "run the same command to continue") from None
        finally:
            self.study.set_user_attr("spent_s", self.spent_s())
        if self.failed:
            raise StudyFailed(self.failed)

    def halt(self) -> None:
        """Every running trial stopped at a step and waited for, left running in the study: the same
        command resumes them."""
        for run in self.running.values():
            run.interrupt()
        for run in self.running.values():
            run.wait()

    def spent_s(self) -> float:
        return self.spent_before + time.monotonic() - self.started

    # A trial's lifetime: started (fill), judged at each rung (judge), ended (reap -> tell).

    def take_over(self) -> None:
        """The trials an earlier controller left running: told when they ended since, adopted when
        they still run, resumed (or started over, without a checkpoint) otherwise."""
        import optuna

        for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            run = self.trials.existing(t.number, t.user_attrs)
            if run.alive():
                self.running[t.number] = run
                self.say(f"trial {t.number}: still running, adopted")
            elif run.stopped_for or run.results().get("status") in (*COMPLETE, "failed"):
                self.tell(run)
            else:
                self.begin(run, t.params)

    def fill(self) -> None:
        """New trials while there is room and the search wants more."""
        while not self.ending and len(self.running) < self.search.parallel and \
                len(self.study.trials) < self.search.trials:
            trial = self.study.ask({k: d.distribution() for k, d in self.search.space.items()})
            self.trial_ids[trial.number] = trial._trial_id
            self.begin(self.trials.new(trial.number, self.running), trial.params)

    def begin(self, run: TrialRun, params: dict[str, Any]) -> None:
        """Write the trial's recipe and start (or resume) it."""
        trial = self.trial(run.number)
        trial.set_user_attr("dir", run.dir)
        if run.task is not None:
            trial.set_user_attr("task", run.task)
        try:
            recipe = apply(self.search.recipe, params, f"{self.search.recipe.name}-trial{run.number:03d}")
        except SpeedrunError as e:
            return self.tell(run, failure=str(e))
        values = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
        run.write_recipe(recipe_source(recipe, f'"""Trial {run.number} of speedrun tune: {values}."""\n'))
        resumed = run.start(self.search.seed, self.search.data, self.search.train_args, self.env)
        self.running[run.number] = run
        where = f" on task {run.task}" if run.task is not None else ""
        self.say(f"trial {run.number}{' resumed' if resumed else ''}{where}: {values}")

    def judge(self) -> None:
        """Stop each running trial that is behind at a rung it has passed (asha.py)."""
        for number, run in self.running.items():
            evals = run.evals()
            others = [(r.evals(), False) for n, r in self.running.items() if n != number]
            others += [(e, True) for e in self.ended_evals.values()]
            while run.stopped_for is None and evals:
                rung = self.search.first_rung_s * self.search.eta ** len(run.verdicts)
                if evals[-1]["wall_s"] < rung:
                    break
                verdict = asha.judge(evals, others, self.metric, rung, self.search.eta)
                trial = self.trial(number)
                if verdict is None or verdict.go_on:
                    run.verdicts.append(rung)
                    trial.set_user_attr("rungs_passed", run.verdicts)
                    if verdict is not None:
                        trial.report(1 - verdict.value, step=int(rung))  # an error: the study minimises
                    continue
                for key, value in (("rung_s", rung), ("value", verdict.value), ("bar", verdict.bar)):
                    trial.set_user_attr(key, value)
                trial.set_user_attr("stopping", verdict.why(self.metric))  # before the stop: a new controller knows
                run.stop(verdict.why(self.metric))
                self.say(f"trial {number}: {verdict.why(self.metric)}; stopping it at a step")

    def check_budget(self) -> None:
        budget = self.search.budget_s
        if budget is None or self.spent_s() < budget or self.ending:
            return
        self.ending = f"the budget ({budget:g} s of search) is spent"
        self.stop_all(self.ending)

    def stop_all(self, why: str) -> None:
        for number, run in self.running.items():
            if run.stopped_for is None:
                self.trial(number).set_user_attr("stopping", why)
                run.stop(why)

    def reap(self) -> None:
        for number, run in list(self.running.items()):
            if run.ended():
                del self.running[number]
                self.tell(run)

    def tell(self, run: TrialRun, failure: str | None = None) -> None:
        """Tell Optuna what the ended trial `run` became (see the module's text)."""
        import optuna

        State = optuna.trial.TrialState
        results = run.results()
        status = results.get("status")
        value = results.get(OBJECTIVES[self.search.objective])
        trial = self.trial(run.number)
        self.ended_evals[run.number] = run.evals()
        if failure is None and run.exit_code == EXIT_BAD_INPUT:  # what every trial would meet: the others wait
            self.halt()
            raise SpeedrunError(f"trial {run.number}: {run.failure()}")
        if failure is None and status in COMPLETE and value is not None:
            state, why, told = "complete", None, State.COMPLETE
        elif failure is None and status in COMPLETE:
            best = (results.get("best") or {}).get(self.metric)
            state, told = "not_reached", State.PRUNED
            why = (f"ended without reaching {self.search.recipe.target} (best {self.metric} {best:.4f})"
                   if best is not None else f"ended without reaching {self.search.recipe.target}")
            if value is None and status == "target_reached":
                why = f"no {OBJECTIVES[self.search.objective]} in its results.json"
        elif failure is None and status == "stopped" and run.stopped_for:
            state, why, told = ("pruned" if "rung" in run.stopped_for else "stopped"), run.stopped_for, State.PRUNED
            trial.set_user_attr("step", results.get("steps"))
            trial.set_user_attr("checkpoint", results.get("last_checkpoint"))
        else:
            state, told = "failed", State.FAIL
            why = failure or results.get("failure") or run.failure()
        trial.set_user_attr("state", state)
        if why:
            trial.set_user_attr("why", why)
        self.study.tell(trial, value if told == State.COMPLETE else None, state=told)
        if told == State.COMPLETE:
            self.say(f"trial {run.number}: reached {self.search.recipe.target}, {self.search.objective} {value:.4g}")
        else:
            at = f" at step {results['steps']}" if status == "stopped" and results.get("steps") else ""
            self.say(f"trial {run.number}: {state.replace('_', ' ')}{at}" + ("" if state == "pruned" else f" ({why})"))
        self.count_failure(why if state == "failed" else None)

    def count_failure(self, why: str | None) -> None:
        if why is None:
            self.failures = []
            return
        self.failures = [*self.failures, why] if self.failures and same_failure(self.failures[-1], why) else [why]
        if len(self.failures) >= SAME_FAILURES and not self.failed:
            self.failed = self.ending = f"the same failure {SAME_FAILURES} times in a row: {why}; the search stopped"
            self.stop_all("the search stopped after repeated failures")

    def trial(self, number: int):
        import optuna

        return optuna.Trial(self.study, self.trial_ids[number])
