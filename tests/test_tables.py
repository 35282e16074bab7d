"""Tests for jserve.benchmarking.tables: the Markdown the bench reports print, on given cells."""

from __future__ import annotations

import math

import pytest

from jserve.benchmarking.tables import cell, markdown_head, markdown_row, markdown_table


def test_markdown_row_and_head() -> None:
    assert markdown_row(["rate", 1.5, "50.0%"]) == "| rate | 1.5 | 50.0% |"
    assert markdown_row([]) == "|  |"
    assert markdown_head(["a", "b"]) == ["| a | b |", "|---|---|"]
    assert markdown_head(["a", "b"], ["---", "---:"]) == ["| a | b |", "|---|---:|"]
    with pytest.raises(ValueError, match="2 columns but 1"):
        markdown_head(["a", "b"], ["---"])


def test_markdown_table_is_the_head_then_a_row_each() -> None:
    assert markdown_table(["x", "y"], [(1, 2), ("-", "3.0x")]) == [
        "| x | y |", "|---|---|", "| 1 | 2 |", "| - | 3.0x |"]
    assert markdown_table(["x"], []) == ["| x |", "|---|"]


def test_cell_marks_what_was_not_measured() -> None:
    assert cell(0.1234, ".1%") == "12.3%"
    assert cell(3, "d") == "3"
    assert cell(None, ".2f") == "-"
    assert cell(math.nan, ".2f", "n/a") == "n/a"
    assert cell(math.inf, ".2f") == "inf"
