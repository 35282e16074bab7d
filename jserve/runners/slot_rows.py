"""Device tables with a row per slot of the persistent batch (the penalties' token counts, the
token rules' bias and ban rows): grown with the slots, and written for new sequences through
row indices padded to a power of two, so a few compiled writes serve every count."""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

Rows = TypeVar("Rows")


def grown_rows(tables: Rows, slots: int) -> Rows:
    """Every `[slots, ...]` array of `tables` (a pytree), its rows kept and empty ones added
    up to `slots`."""
    return jax.tree.map(lambda a: jnp.pad(a, [(0, slots - a.shape[0])] + [(0, 0)] * (a.ndim - 1)),
                        tables)


def padded_slots(slots: np.ndarray, num_slots: int) -> np.ndarray:
    """`slots` padded to a power of two with `num_slots`, a row past the table that a
    `mode="drop"` scatter skips."""
    rows = np.full(1 << max(0, len(slots) - 1).bit_length(), num_slots, np.int32)
    rows[:len(slots)] = slots
    return rows
