"""What a user types, checked where it is read: numbers within bounds (`Bound` as an argparse type,
its range shown by `--help`; `env_number` for the environment), names and paths that are not
empty (`given`), and the parser that refuses the rest in one line (`Parser`).

Why bounds at all: an unbounded number fails late and badly. A 10^6 px image crashed inside a C++
kernel, `ablate --seeds 100000000` ran out of memory, `data synth` with 10^9 images hung, and a
price of 1e308 $/h wrote `"cost_usd": Infinity`, which is not JSON. Each bound is generous (far
past any real use) and printed, so the user reads it before being refused by it.

An empty name or path is refused rather than read as "here", "the default" or "all": `ls ''`
listed every job, `data index ''` indexed the working directory.

The parser every `speedrun` command uses (`Parser`) makes a usage error one line, exit 2, like
every other refusal, and ends each bounded option's help with its range.
"""
from __future__ import annotations

import argparse
import copy
import errno
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from speedrun.errors import SpeedrunError


@dataclass(frozen=True)
class Bound:
    """A number in [lo, hi]: `int` (a whole number) or `float` (finite: never NaN or infinity).
    Called with the command line's text, as argparse calls a `type`."""

    kind: type
    lo: float
    hi: float

    @property
    def range(self) -> str:
        return f"{_show(self.lo)}..{_show(self.hi)}"

    def __str__(self) -> str:
        return f"{'a whole number' if self.kind is int else 'a number'} in {self.range}"

    def __call__(self, text: str) -> int | float:
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {self}") from None
        if not self.holds(value):
            raise argparse.ArgumentTypeError(f"{text} is not {self}")
        return value

    def holds(self, value) -> bool:
        """Whether `value` (already a number) is inside the bounds."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.kind is int and not isinstance(value, int):
            return False
        return math.isfinite(value) and self.lo <= value <= self.hi


def given(text: str) -> str:
    """An argparse type for a name or path: the text as typed, refused when empty or blank, or
    when it names a loop of symbolic links (which every later use would fail on, deep inside)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty value: give a name or path (or leave the option out)")
    if os.path.islink(text):
        try:
            os.stat(text)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise argparse.ArgumentTypeError(f"{text} is a loop of symbolic links") from None
    return text


def given_path(text: str) -> Path:
    """`given`, as a Path (argparse's `type=Path` reads an empty value as ".", the working directory)."""
    return Path(given(text))


def parse_env(items: list[str], option: str, *, show: bool = True) -> dict[str, str]:
    """KEY=VALUE items of `option` as a dict; SpeedrunError for one not of that form (quoting it
    unless `show` is False: values that may be secret are never printed)."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise SpeedrunError(f"bad {option}{f' {item!r}' if show else ''}: write KEY=VALUE")
        env[key] = value
    return env


def env_number(name: str, bound: Bound, default: float | None = None) -> float | None:
    """The environment variable `name` read as `bound`'s kind, or `default` when it is unset or
    empty; outside the bounds (or not a number) is bad input: SpeedrunError, one line, exit 2."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return bound(text)
    except argparse.ArgumentTypeError as e:
        raise SpeedrunError(f"{name}={text!r}: {e}") from None


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, with each bounded option's range after its help: "(1..10,000)"."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and isinstance(action.type, Bound):  # argparse shows no line for no help
            action = copy.copy(action)
            action.help = f"({action.type.range})"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if isinstance(action.type, Bound) and action.type.range not in text:
            text = f"{text} ({action.type.range})" if text else f"({action.type.range})"
        return text


class Parser(argparse.ArgumentParser):
    """argparse's parser with one-line usage errors (the usage itself is one `--help` away) and
    `HelpFormatter`. Subcommands' parsers are made of this class too (argparse's default)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"speedrun: error: {self.prog}: {message} (`{self.prog} --help` for usage)", file=sys.stderr)
        sys.exit(2)


def _show(x: float) -> str:
    if x == int(x) and abs(x) >= 10_000:
        return f"{int(x):,}"
    return f"{x:g}"


# Bounds more than one command shares (one name, one meaning).
SEED = Bound(int, 0, 2**32 - 1)  # numpy's generator and the decode workers' seeds take 32 bits
WORKERS = Bound(int, 1, 256)  # decode (or index, or prepare) processes per device
PROCESSES = Bound(int, 1, 1024)  # processes per machine (--nproc-per-node)
PORT = Bound(int, 1, 65535)  # a TCP port
USD_PER_HOUR = Bound(float, 0.0001, 10_000)  # a machine's price, $ per hour (above 0: never a free machine)
TASKS = Bound(int, 1, 10_000)  # machines (tasks) in a job
