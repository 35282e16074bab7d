"""Markdown tables for the bench scripts' reports, written one way.

The reproduction scripts print their figures as Markdown tables that land in
bench/results/*.md; one row and one rule format keeps every report rendering alike
and lets a script say what a cell holds rather than how a table is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["cell", "markdown_head", "markdown_row", "markdown_table"]


def markdown_row(cells: Iterable[object]) -> str:
    """One row: ``| a | b |``."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_head(cells: Sequence[object], align: Sequence[str] | None = None) -> list[str]:
    """A header row and the rule under it; `align` gives each column's rule (``---`` left,
    ``---:`` right), all ``---`` by default."""
    rule = align if align is not None else ["---"] * len(cells)
    if len(rule) != len(cells):
        raise ValueError(f"{len(cells)} columns but {len(rule)} alignments")
    return [markdown_row(cells), "|" + "|".join(rule) + "|"]


def markdown_table(head: Sequence[object], rows: Iterable[Iterable[object]],
                   align: Sequence[str] | None = None) -> list[str]:
    """A whole table, one line per element: `markdown_head` then a `markdown_row` per row."""
    return markdown_head(head, align) + [markdown_row(r) for r in rows]


def cell(x: float | None, spec: str, missing: str = "-") -> str:
    """`x` formatted by `spec`, or `missing` where a run had nothing to measure (None or NaN)."""
    return missing if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
