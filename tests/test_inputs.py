"""Every number a user types has bounds that `--help` shows and that refuse what lies outside them
in one line, exit 2; nothing writes NaN or Infinity into a JSON file."""
import argparse
import json
import math

import pytest
from cli_run import one_line_error, speedrun_here

from speedrun.cli import build_parser
from speedrun.files import to_json
from speedrun.inputs import Bound, env_number


def every_parser(parser: argparse.ArgumentParser, name: str = "speedrun"):
    """(`speedrun COMMAND ...`, its parser) for the top level and every command and subcommand."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from every_parser(sub, f"{name} {sub_name}")


def numeric_actions():
    """(command, option, action) for every option or argument that takes a number."""
    for command, parser in every_parser(build_parser()):
        for action in parser._actions:
            if action.type in (int, float) or isinstance(action.type, Bound):
                yield command, (action.option_strings or [action.dest])[-1], action, parser


def test_every_number_on_the_command_line_is_bounded_and_its_help_shows_the_range():
    found = list(numeric_actions())
    assert len(found) > 40  # the walk sees every command's options
    unbounded = [f"{command} {option}" for command, option, action, _ in found if not isinstance(action.type, Bound)]
    assert not unbounded, unbounded
    for command, option, action, parser in found:
        help_text = " ".join(parser.format_help().split())
        assert action.type.range in help_text, (command, option)


def test_the_docs_table_of_bounds_is_the_command_lines():
    from pathlib import Path

    docs = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    missing = {f"`{option}` | {action.type.range} |" for _, option, action, _ in numeric_actions()
               if f"| `{option}` | {action.type.range} |" not in docs}
    assert not missing, f"docs/training.md's bounds table lacks {sorted(missing)}"


@pytest.mark.parametrize("bound, good, bad", [
    (Bound(int, 1, 10_000), ["1", "10000"], ["0", "10001", "1.5", "abc", "", "nan"]),
    (Bound(float, 0, 1440), ["0", "1440", "2.5"], ["-0.1", "1441", "nan", "inf", "-inf", "1e308", "x"]),
])
def test_a_bound_takes_what_lies_inside_it_and_names_itself_refusing_the_rest(bound, good, bad):
    for text in good:
        assert bound.holds(bound(text))
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=f"is not a .*number in {bound.range}"):
            bound(text)
    assert not bound.holds(True) and not bound.holds("3") and not bound.holds(math.nan)


@pytest.mark.parametrize("argv, expected", [
    (["train", "--epochs", "1000000000"], "argument --epochs: 1000000000 is not a whole number in 1..10,000"),
    (["eval", "run", "--size", "1000000"], "argument --size: 1000000 is not a whole number in 1..4096"),
    (["eval", "run", "--batch-size", "0"], "argument --batch-size: 0 is not a whole number in 1..65,536"),
    (["ablate", "tiny", "--seeds", "100000000"], "argument --seeds: 100000000 is not a whole number in 1..1000"),
    (["ablate", "tiny", "--workers", "0"], "argument --workers: 0 is not a whole number in 1..256"),
    (["check", "job", "--iters", str(10**11)], "argument --iters: 100000000000 is not a whole number in 1..1,000,000"),
    (["tb", "job", "--port", "70000"], "argument --port: 70000 is not a whole number in 1..65,535"),
    (["launch", "job", "--price-per-hour", "1e308", "--", "x.py"],
     "argument --price-per-hour: 1e308 is not a number in 0.0001..10,000"),
    (["logs", "job", "-1"], "argument task: -1 is not a whole number in 0..9999"),
    (["recipes", "--nonsense"], "unrecognized arguments: --nonsense"),
])
def test_a_number_out_of_bounds_is_one_line_exit_2_naming_the_option_and_its_range(argv, expected):
    line = one_line_error(speedrun_here(*argv), expected)
    assert line.startswith("speedrun: error: speedrun") and "--help` for usage" in line


@pytest.mark.parametrize("argv, option", [
    (["ls", ""], "argument name"),
    (["train", "--recipe", ""], "argument --recipe"),
    (["train", "--out", " "], "argument --out"),
    (["launch", "job", "--hosts", "", "--", "x.py"], "argument --hosts"),
    (["data", "synth", "imagenet", ""], "argument DST"),
    (["compare", ""], "argument RUN_DIR|JOB|mlflow://EXPERIMENT"),
])
def test_an_empty_name_or_path_is_refused_not_read_as_here_the_default_or_all(argv, option, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line_error(speedrun_here(*argv), f"{option}: an empty value: give a name or path")
    assert not list(tmp_path.iterdir())  # nothing made


def test_a_loop_of_symbolic_links_is_one_line_wherever_a_path_is_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "run").mkdir()
    for argv in (["eval", "run", "--data", "loop"], ["data", "prepare", "loop", "out"],
                 ["data", "prepare", "run", "loop"], ["data", "synth", "imagenet", "loop"], ["data", "index", "loop"]):
        one_line_error(speedrun_here(*argv), "loop is a loop of symbolic links")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop", "run"]  # nothing made


def test_the_process_start_a_launcher_hands_down_must_be_a_time(monkeypatch):
    from speedrun.errors import SpeedrunError
    from speedrun.local_launch import PROCESS_START_ENV, process_start_time

    monkeypatch.setenv(PROCESS_START_ENV, "1764900000.5")
    assert process_start_time() == 1764900000.5
    for bad in ("abc", "nan", "-5", "1e300"):
        monkeypatch.setenv(PROCESS_START_ENV, bad)
        with pytest.raises(SpeedrunError, match=f"SPEEDRUN_PROCESS_START='{bad}': .* is not a number in 0.."):
            process_start_time()
    assert env_number("SPEEDRUN_NOT_SET_ANYWHERE", Bound(int, 0, 1), default=7) == 7


def test_json_files_hold_no_nan_or_infinity():
    text = to_json({"loss": math.nan, "cost_usd": math.inf, "series": [1.5, -math.inf, (2, math.nan)], "ok": 0.25})
    assert json.loads(text) == {"loss": None, "cost_usd": None, "series": [1.5, None, [2, None]], "ok": 0.25}
    assert "NaN" not in text and "Infinity" not in text
