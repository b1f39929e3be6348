"""What the commands print on: a console that does not cut tables short, and rows as a table."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def output_console(stderr: bool = False) -> Console:
    """A console for tables and lines. On a terminal rich fits them to its width; anything else (a
    file, a pipe) gets them whole: rich would cut every column to 80 characters there."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=1_000_000)


def print_table(console: Console, rows: list[dict], title: str | None = None, boxed: bool = False) -> None:
    """Rows of equal keys as a table, the keys as its header (lines around the cells if `boxed`)."""
    if not rows:
        return
    table = Table(*rows[0].keys(), title=title, **({} if boxed else {"box": None}))
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    console.print(table)
