"""The hidden cache's part of a runner's `Batch` (`Batch.features["hidden_cache"]`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from jserve.cache_features.hidden_cache.section import NAME

if TYPE_CHECKING:
    from jserve.engine.batch import Batch


@dataclass(frozen=True)
class HiddenBatch:
    """`mask[i]`: the batch's sequence `i` holds the hidden cache (its blocks hold each
    layer's attention input rows, K page then V page; its K/V are recomputed every step)."""

    mask: np.ndarray  # [S] bool, some true

    @property
    def moves_blocks(self) -> bool:
        return False

    def sliced(self, lo: int, hi: int) -> HiddenBatch | None:
        mask = self.mask[lo:hi]
        return HiddenBatch(mask) if mask.any() else None

    def shape_terms(self, batch: Batch, bytes_per_block: int) -> dict[str, object]:
        """Their K/V recomputed over every past row (`StepShape.hidden_tokens`)."""
        return {"hidden_tokens": int(batch.start[self.mask].sum())}


def hidden_mask(batch: Batch) -> np.ndarray | None:
    """[S] bool: which of the batch's sequences hold the hidden cache; None when none does."""
    own = batch.features.get(NAME)
    return None if own is None else own.mask
