"""Refusing the first offender of a plan: the checks the core and every cache feature run
are boolean masks over the entries of one of the plan's mappings, so a plan of a few
hundred requests is checked in whole-array operations, and the message names the first
entry (in plan order) that fails, with the first rule it breaks."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from jserve.errors import PlanError

Check = tuple[np.ndarray, Callable[[int], str]]  # (offends, message for the i-th entry)


def refuse_first(seq_ids: Sequence[int], checks: Sequence[Check]) -> None:
    """Raise for the first entry (in plan order) that fails any check, with the message
    of the first check it fails."""
    bad = np.zeros(len(seq_ids), bool)
    for offends, _ in checks:
        bad |= offends
    if bad.any():
        i = int(np.argmax(bad))
        message = next(message for offends, message in checks if offends[i])
        raise PlanError(message(i))


def not_live(seq_ids: Sequence[int], rows: np.ndarray, verb: str) -> Check:
    return rows < 0, lambda i: f"plan tries to {verb} seq {seq_ids[i]}, which is not a live request"


def values(mapping: Mapping[int, int]) -> np.ndarray:
    return np.fromiter(mapping.values(), np.int64, len(mapping))


def member(keys: Collection[int], of: Collection[int]) -> np.ndarray:
    if not of:
        return np.zeros(len(keys), bool)
    return np.fromiter(map(of.__contains__, keys), bool, len(keys))
