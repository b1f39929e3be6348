"""`speedrun compare` and `speedrun ablate`, through the command line, on runs the tests make."""
import json
import os
import signal
import subprocess
import sys

import pytest

from cli_run import speedrun, speedrun_here, start, wait_for
from speedrun.ablate import FULL, TRICKS, variants
from speedrun.compare import compare, differing_fields, flatten_recipe, read_run
from speedrun.recipes import BUILTIN

WIDE = {**os.environ, "COLUMNS": "250"}  # a table row stays on one line


def results(run_dir) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def table_rows(stdout: str) -> list[str]:
    """The table's data lines (one per run), in order."""
    return [line for line in stdout.splitlines() if line.strip().startswith(("r-", "live"))]


def test_compare_skips_files_it_cannot_read_naming_each_and_plots_into_a_folder(tmp_path):
    import shutil

    good = tmp_path / "good"
    good.mkdir()
    (good / "results.json").write_text(json.dumps({"status": "finished", "recipe": {"name": "r"},
                                                   "time_to_target_s": 12.5, "best": {"top1": 0.9}}))
    (good / "metrics.jsonl").write_text(json.dumps({"wall_s": 5.0, "top1": 0.9, "images_per_s": 100.0}) + "\n")
    (tmp_path / "latin").mkdir()
    (tmp_path / "latin" / "results.json").write_bytes(b'{"status": "caf\xe9"}')
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "results.json").write_text("[" * 100_000 + "]" * 100_000)
    shutil.copytree(good, tmp_path / "badlog")
    (tmp_path / "badlog" / "metrics.jsonl").write_bytes(b"\xff\xfe\n")
    (tmp_path / "plots").mkdir()
    names = ("good", "latin", "deep", "badlog")
    proc = speedrun_here("compare", *(str(tmp_path / n) for n in names), "--json", "--plot", str(tmp_path / "plots"))
    assert proc.returncode == 0, proc.stderr
    records = json.loads(proc.stdout)
    assert [r["run"] for r in records] == [str(good)]
    assert records[0]["time_to_target_s"] == 12.5 and records[0]["best_top1"] == 0.9
    assert records[0]["images_per_s"] == 100.0 and records[0]["cost_usd"] is None
    assert (tmp_path / "plots" / "compare.png").read_bytes()[:4] == b"\x89PNG"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "left out 3 of 4" in lines[0], proc.stderr  # no library's warning either
    assert all(str(tmp_path / n) in lines[0] for n in names[1:])


def test_compare_of_a_folder_of_runs_never_takes_a_runs_own_files_for_another_run(tmp_path):
    # W&B keeps a copy of a tracked run's results.json among the run's tracker files.
    for run in ("a/seed0", "b/seed0"):
        (tmp_path / run).mkdir(parents=True)
        (tmp_path / run / "results.json").write_text(json.dumps({"status": "finished", "recipe": {"name": "r"},
                                                                 "best": {"top1": 0.5}}))
    copy = tmp_path / "a/seed0/trackers/wandb/offline-run-1/files"
    copy.mkdir(parents=True)
    (copy / "results.json").write_text((tmp_path / "a/seed0/results.json").read_text())
    proc = speedrun_here("compare", str(tmp_path), "--json", "--plot", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert [r["run"] for r in json.loads(proc.stdout)] == [str(tmp_path / "a/seed0"), str(tmp_path / "b/seed0")]


@pytest.mark.slow
def test_compare_finished_unfinished_not_reached_and_different_recipes(tiny_target_run, tmp_path):
    import shutil

    slower = tmp_path / "slower.py"
    slower.write_text("import dataclasses\nfrom speedrun.recipes import BUILTIN\n"
                      "recipe = dataclasses.replace(BUILTIN['tiny'], name='tiny-wd', optimizer=dataclasses.replace("
                      "BUILTIN['tiny'].optimizer, weight_decay=1e-3))\n")
    made = {
        "r-other-recipe": ["--recipe", str(slower), "--target", "top1=0.6"],
        "r-not-reached": ["--recipe", "tiny", "--epochs", "2", "--target", "top1=0.99"],
    }
    # The two runs are independent: they train side by side. The third, the session's tiny run that
    # reached its target (top-1 0.2), is copied.
    procs = {name: start("train", *args, "--out", str(tmp_path / name)) for name, args in made.items()}
    shutil.copytree(tiny_target_run.out, tmp_path / "r-reached")
    for proc in procs.values():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    # A run that is still going: results.json says "running" after its first evaluation.
    live = start("train", "--recipe", "tiny", "--epochs", "50", "--target", "top1=0.99",
                 "--out", str(tmp_path / "live"))
    try:
        wait_for(lambda: ((tmp_path / "live/results.json").is_file()
                          and results(tmp_path / "live")["status"] == "running"),
                 120, "the live run's first evaluation")
        proc = speedrun("compare", "r-not-reached", "live", "r-reached", "r-other-recipe", "--plot", "cmp.png",
                        env=WIDE, cwd=tmp_path)
    finally:
        live.send_signal(signal.SIGINT)
        live.communicate(timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    # Reached first, fastest first; then the rest by best top-1.
    reached = sorted(("r-reached", "r-other-recipe"), key=lambda n: results(tmp_path / n)["time_to_target_s"])
    assert [r.split()[0] for r in rows[:2]] == reached
    assert {r.split()[0] for r in rows[2:]} == {"r-not-reached", "live"}
    by_name = {r.split()[0]: r for r in rows}
    assert "not reached" in by_name["r-not-reached"] and "running" in by_name["live"] and "not yet" in by_name["live"]
    assert (tmp_path / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The same through the Python API: the fields that differ, and their values per run.
    result = compare([read_run(tmp_path / n) for n in (*made, "r-reached")])
    assert {"optimizer.weight_decay", "target.value", "epochs"} <= set(result.differing)
    assert "optimizer.momentum" not in result.differing and "model" not in result.differing
    rows = {row["run"].rsplit("/", 1)[-1]: row for row in result.rows()}
    assert (rows["r-other-recipe"]["optimizer.weight_decay"] == "0.001"
            and rows["r-reached"]["optimizer.weight_decay"] == "0.0005")
    assert rows["r-not-reached"]["target.value"] == "0.99" and rows["r-not-reached"]["epochs"] == "2"
    assert (rows["r-not-reached"]["time to target"] == "not reached"
            and rows["r-reached"]["time to target"].endswith(" s"))
    # Once it is stopped the same run reads "interrupted"; a run that says running with no process
    # holding it (killed outright) reads "stopped".
    assert results(tmp_path / "live")["status"] == "interrupted"
    data = results(tmp_path / "live")
    (tmp_path / "live/results.json").write_text(json.dumps({**data, "status": "running"}))
    proc = speedrun("compare", "live", "--plot", "one.png", env=WIDE, cwd=tmp_path)
    assert "stopped" in table_rows(proc.stdout)[0]


def test_compare_refuses_what_is_not_a_run(tmp_path):
    for args, expected in (([str(tmp_path)], "holds no run"), (["no-such-job"], "neither a directory nor a job")):
        proc = speedrun_here("compare", *args, "--plot", str(tmp_path / "x.png"))
        assert proc.returncode == 2 and expected in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# What each trick's variant may change, written out here independently of speedrun.ablate.
TRICK_FIELDS = {
    "progressive-resizing": {"phases.size", "phases.copy"},
    "dynamic-batch": {"phases.batch_size", "phases.lr"},
    "rect-val": {"phases.rect_val"},
    "no-wd-norm": {"optimizer.no_decay"},
    "warmup": {"phases.lr", "scale_warmup_epochs"},
    "zero-init": {"zero_init"},
    "ema": {"ema_decay"},
    "eval-flip": {"eval_flip"},
}


@pytest.mark.parametrize("name", ["tiny", "fashion-mnist", "imagenet-16x8", "imagenet-1x8"])
def test_each_variant_differs_from_the_full_recipe_in_its_trick_only(name):
    recipe = BUILTIN[name]
    found = variants(recipe)
    assert set(TRICK_FIELDS) == set(TRICKS)
    for trick, variant in found.items():
        if trick == FULL:
            assert variant == recipe
            continue
        changed = set(differing_fields([dict(recipe.to_dict(), name=""), dict(variant.to_dict(), name="")]))
        assert changed and changed <= TRICK_FIELDS[trick], (trick, changed)
    # A trick the recipe does not use is not run (and asking for it is an error in the CLI).
    assert ("rect-val" in found) == any(p.rect_val for p in recipe.phases)
    assert ("ema" in found) == (recipe.ema_decay is not None)


def test_turned_off_tricks_mean_what_the_help_says():
    full = BUILTIN["imagenet-16x8"]
    v = variants(full)
    assert {p.size for p in v["progressive-resizing"].phases} == {288}
    assert {p.batch_size for p in v["dynamic-batch"].phases} == {64}
    # Linear scaling: 128-image phases at 3.76 become 64-image phases at 1.88 (the same LR per image).
    assert v["dynamic-batch"].phases[1].lr == pytest.approx(1.88)
    assert v["warmup"].phases[0].lr == 3.76 and v["warmup"].scale_warmup_epochs == 0
    assert flatten_recipe(v["no-wd-norm"].to_dict())["optimizer.no_decay"] == "none"


@pytest.mark.slow
def test_ablate_runs_every_variant_with_two_seeds_and_an_interrupted_one_finishes_the_rest(tmp_path):
    out = tmp_path / "abl"
    # One trick: the full recipe and the variant, two seeds each, are what the machinery needs
    # (what each trick changes in the recipe: test_each_variant_differs_from_the_full_recipe_in_its_trick_only).
    argv = ["ablate", "tiny", "--only", "zero-init", "--seeds", "2", "--target", "top1=0.6", "--out", str(out)]
    runs = [(v, s) for s in range(2) for v in (FULL, "zero-init")]
    # Ctrl-C (SIGINT to the whole foreground group, as a terminal sends it) during the third run.
    proc = start(*argv, start_new_session=True, env=WIDE)
    try:  # two whole runs first: on a loaded 2-core machine three took over 300 s
        wait_for(lambda: (out / "full/seed1").is_dir(), 900, "the third run to start")
    except AssertionError:
        os.killpg(proc.pid, signal.SIGINT)  # it stops its run too: nothing left training beside later tests
        proc.communicate(timeout=120)
        raise
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 130
    # Read once it has stopped: the third run may still finish between a look and the Ctrl-C.
    done_before = {r for r in runs if (out / r[0] / f"seed{r[1]}/results.json").is_file()
                   and results(out / r[0] / f"seed{r[1]}")["status"] in ("finished", "target_reached")}
    assert set(runs[:2]) <= done_before and runs[3] not in done_before
    stamps = {r: (out / r[0] / f"seed{r[1]}/results.json").stat().st_mtime_ns for r in done_before}

    again = speedrun(*argv, env=WIDE)
    assert again.returncode == 0, again.stderr
    assert f"{len(done_before)} of 4 runs already done" in again.stdout
    for r in runs:
        assert results(out / r[0] / f"seed{r[1]}")["status"] in ("finished", "target_reached"), r
    assert all((out / r[0] / f"seed{r[1]}/results.json").stat().st_mtime_ns == t for r, t in stamps.items())
    # Each variant ran its own recipe: the recipe in its results differs from the full one in its trick.
    full = results(out / "full/seed0")["recipe"]
    changed = set(differing_fields([dict(full, name=""), dict(results(out / "zero-init/seed1")["recipe"], name="")]))
    assert changed and changed <= TRICK_FIELDS["zero-init"]
    summary = json.loads((out / "ablation.json").read_text())
    assert [row["off"] for row in summary["rows"]] == [FULL, "zero-init"]
    assert all(row["not reached"].endswith("/2") for row in summary["rows"])
    assert (out / "compare.png").is_file()
    # The same command on a finished ablation runs nothing.
    third = speedrun(*argv, env=WIDE)
    assert third.returncode == 0 and "4 of 4 runs already done" in third.stdout


def test_ablate_refuses_unknown_and_unused_tricks(tmp_path):
    for only, expected in (("nope", "unknown trick nope"), ("rect-val", "does not use rect-val")):
        proc = speedrun_here("ablate", "tiny", "--only", only, "--out", str(tmp_path / "a"))
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
    assert not (tmp_path / "a").exists()


@pytest.fixture
def one_run(tiny_one_epoch_run):
    """A finished one-epoch run of the tiny recipe, under a long path (tables must not cut it);
    made once per session (conftest.py)."""
    return tiny_one_epoch_run


def bad_runs(root, good) -> dict[str, str]:
    """Run directories whose results.json is valid JSON of the wrong shape, by name: what stderr
    must say about each."""
    made = {"list": [], "string-recipe": {**results(good), "recipe": "tiny"},
            "string-time": {**results(good), "time_to_target_s": "12 s"}}
    for name, content in made.items():
        (root / name).mkdir()
        (root / name / "results.json").write_text(json.dumps(content))
    (root / "cut").mkdir()
    (root / "cut/results.json").write_text('{"status": "fini')
    return {"list": "the whole file is []", "string-recipe": 'recipe is "tiny"',
            "string-time": 'time_to_target_s is "12 s"', "cut": "is not JSON"}


@pytest.mark.slow
def test_compare_names_bad_runs_and_prints_the_rest_whole_when_piped(one_run, tmp_path):
    import shutil

    expected = bad_runs(tmp_path, one_run)
    # A metrics line without wall_s (another tool's) is left out of the plot, not fatal.
    odd = tmp_path / "odd-metrics"
    shutil.copytree(one_run, odd)
    with open(odd / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"epoch": 2, "top1": 0.5}) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # piped, as `speedrun compare ... | less`
    proc = speedrun("compare", str(one_run), *(str(tmp_path / n) for n in expected), str(odd), "--plot", "p.png",
                    cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "…" not in proc.stdout
    for line in proc.stdout.splitlines():  # every run's row whole: full path, full status
        if str(one_run) in line or str(odd) in line:
            assert results(one_run)["status"] in line.split()
    assert str(one_run) in proc.stdout and str(odd) in proc.stdout
    for name, why in expected.items():
        assert f"{tmp_path / name}" in proc.stderr and why in proc.stderr, (name, proc.stderr)
    assert "left out 4 of 6" in proc.stderr
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_compare_with_only_bad_runs_is_one_line(one_run, tmp_path):
    expected = bad_runs(tmp_path, one_run)
    proc = speedrun_here("compare", *(str(tmp_path / n) for n in expected), "--plot", str(tmp_path / "p.png"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "nothing to compare" in proc.stderr and all(why in proc.stderr for why in expected.values())


@pytest.mark.slow
def test_compare_in_a_read_only_directory_costs_the_plot_not_the_table(one_run, read_only_dir):
    for extra in ([], ["--plot", str(read_only_dir / "sub" / "p.png")]):
        proc = speedrun("compare", str(one_run), *extra, cwd=read_only_dir)
        assert proc.returncode == 0, proc.stderr
        assert str(one_run) in proc.stdout and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "plot not written" in proc.stderr
        assert "Read-only file system" in proc.stderr


@pytest.mark.slow
def test_compare_json_and_csv_give_the_table_to_scripts(one_run, tmp_path):
    import csv

    as_json = speedrun("compare", str(one_run), "--json", cwd=tmp_path)
    assert as_json.returncode == 0, as_json.stderr
    rows = json.loads(as_json.stdout)
    assert [r["run"] for r in rows] == [str(one_run)] and rows[0]["status"] == results(one_run)["status"]
    as_csv = speedrun("compare", str(one_run), "--csv", cwd=tmp_path)
    assert as_csv.returncode == 0, as_csv.stderr
    assert list(csv.DictReader(as_csv.stdout.splitlines())) == [{k: "" if v is None else str(v) for k, v in r.items()}
                                                                for r in rows]
    assert isinstance(rows[0]["best_top1"], float) and 0 < rows[0]["best_top1"] <= 1  # a fraction, not "91.20%"
    assert isinstance(rows[0]["images_per_s"], float)
    assert (tmp_path / "compare.png").is_file()  # the plot is still written, by default here


@pytest.mark.slow
def test_compare_reads_runs_without_loading_torch(one_run, tmp_path):
    # Reading results.json and metrics.jsonl needs no torch, whose import costs seconds of CPU
    # (the test suite runs compare dozens of times; a user runs it on a laptop without torch).
    code = ("import runpy, sys\n"
            "sys.argv = ['speedrun', 'compare', sys.argv[1], '--json']\n"
            "try:\n    runpy.run_module('speedrun', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch loaded:', 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(one_run)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "torch loaded: False"
    assert json.loads("\n".join(proc.stdout.splitlines()[:-1]))[0]["run"] == str(one_run)


@pytest.mark.slow
def test_ablate_refuses_no_trick_a_run_directory_and_a_read_only_out(one_run, read_only_dir, tmp_path):
    before = sorted(p.name for p in one_run.iterdir())
    for args, expected in (
        (["--only", ",", "--out", str(tmp_path / "a")], "names no trick"),
        (["--out", str(one_run)], "holds no ablation"),
        (["--out", str(read_only_dir / "abl")], "Read-only file system"),
        (["--out", str(one_run / "results.json")], "is a file"),
    ):
        proc = speedrun_here("ablate", "tiny", *args)
        assert proc.returncode == 2 and expected in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists() and sorted(p.name for p in one_run.iterdir()) == before


@pytest.mark.slow
def test_compare_by_cost_sorts_by_dollars_to_target_and_shows_what_each_run_cost(tiny_target_run, tmp_path):
    import shutil

    from speedrun.money import Price, cost_fields

    # One real run, three ways: priced differently and reaching the target at other times.
    made = {"r-fast": (30.0, Price("p5.48xlarge", "on-demand", 4, 10.0, "test")),
            "r-cheap": (60.0, Price("g6e.xlarge", "spot", 2, 1.0, "test")),
            "r-unpriced": (45.0, None)}
    for name, (seconds, price) in made.items():
        shutil.copytree(tiny_target_run.out, tmp_path / name)
        data = results(tmp_path / name)
        data.update(time_to_target_s=seconds, **cost_fields(price, seconds + 10.0, seconds))
        (tmp_path / name / "results.json").write_text(json.dumps(data))
    order = {}
    for by in ("time", "cost"):
        proc = speedrun("compare", *made, "--by", by, "--json", "--plot", f"{by}.png", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        rows = json.loads(proc.stdout)
        order[by] = [r["run"] for r in rows]
        assert (tmp_path / f"{by}.png").read_bytes()[:4] == b"\x89PNG"
    assert order["time"] == ["r-fast", "r-unpriced", "r-cheap"]
    assert order["cost"] == ["r-cheap", "r-fast", "r-unpriced"]  # no price: after those with one
    by_run = {r["run"]: r for r in rows}
    assert by_run["r-fast"]["cost_to_target_usd"] == pytest.approx(4 * 10.0 * 30 / 3600)  # $0.3333
    assert by_run["r-fast"]["cost_usd"] == pytest.approx(4 * 10.0 * 40 / 3600)  # $0.4444
    assert by_run["r-cheap"]["cost_to_target_usd"] == pytest.approx(2 * 1.0 * 60 / 3600)  # $0.0333
    assert by_run["r-cheap"]["cost_usd"] == pytest.approx(2 * 1.0 * 70 / 3600)  # $0.0389
    assert by_run["r-unpriced"]["cost_to_target_usd"] is None and by_run["r-unpriced"]["cost_usd"] is None
    assert by_run["r-fast"]["time_to_target_s"] == 30.0
    table = speedrun("compare", *made, "--by", "cost", "--plot", "t.png", cwd=tmp_path).stdout
    assert "$0.3333" in table and "$0.0389" in table  # the table for people keeps $ and units in the cells
    bad = speedrun("compare", *made, "--by", "price", cwd=tmp_path)
    assert bad.returncode == 2 and "invalid choice: 'price'" in bad.stderr


def test_ablate_reports_each_tricks_effect_in_dollars_where_runs_have_a_price():
    from speedrun.ablate import Plan, summarise, table
    from speedrun.compare import RunSummary

    def run(name: str, seed: int, seconds: float, usd: float | None) -> RunSummary:
        return RunSummary(f"{name}/seed{seed}", None, "target_reached", {}, {"metric": "top1", "value": 0.9}, seconds,
                          {"top1": 0.91}, None, 1, "cpu", seed, None, None, cost_to_target_usd=usd)
    trick = next(iter(TRICKS))
    plan = Plan(BUILTIN["tiny"], (trick,), 2, None)
    runs = {(FULL, 0): run(FULL, 0, 100.0, 1.0), (FULL, 1): run(FULL, 1, 100.0, 2.0),
            (trick, 0): run(trick, 0, 150.0, 1.5), (trick, 1): run(trick, 1, 120.0, 3.0)}
    rows = {r["off"]: r for r in table(summarise(plan, runs))}
    assert rows[FULL]["$ vs full"] == "1 (reference)" and rows[FULL]["$ to target"] == "$1.5"
    assert rows[trick]["$ to target"] == "$2.25" and rows[trick]["$ vs full"] == "1.50x (1.50-1.50)"
    assert rows[trick]["vs full"] == "1.35x (1.20-1.50)"
    unpriced = {k: RunSummary(**{**vars(v), "cost_to_target_usd": None}) for k, v in runs.items()}
    assert "$ to target" not in table(summarise(plan, unpriced))[0]  # no price: no dollar columns
