"""The simulator's stand-in for a trained predictor: each request's predicted length is drawn
from the trained one's held-out errors, per true-length bin, in the space where its errors add,
so runs at scale need no base model. How each part is drawn, and the coverage measured:
docs/policies.md, the length predictors.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from jserve.predictor.checkpoint import NOISE_FILE
from jserve.predictor.heads import Kind, bucket_of
from jserve.predictor.predictor import DEFAULT_DIR, Prediction, to_predictions

__all__ = ["NoiseModel", "load_noise_model", "write_noise_models"]

ErrorSpace = Literal["log", "bucket"]

QUANTILE_LEVELS: tuple[float, ...] = tuple(np.round(np.linspace(0.0, 1.0, 21), 2).tolist())
_OVER, _NOT_OVER = "over", "not_over"


def _quantiles(values: np.ndarray) -> tuple[float, ...]:
    # Six decimals: far below the spread of any error distribution, and a readable JSON.
    return tuple(round(float(q), 6) for q in np.quantile(values, QUANTILE_LEVELS))


def _to_space(lengths: np.ndarray, space: ErrorSpace, bucket_width: int) -> np.ndarray:
    if space == "log":
        return np.log(lengths.astype(np.float64))
    return bucket_of(lengths.astype(np.int64), bucket_width).astype(np.float64)


def _from_space(values: np.ndarray, space: ErrorSpace, bucket_width: int,
                max_length: int) -> np.ndarray:
    if space == "log":
        lengths = np.exp(values)
    else:
        lengths = (np.maximum(np.round(values), 0) + 1) * bucket_width
    return np.clip(np.round(lengths), 1, max_length).astype(np.int64)


Sides = tuple[tuple[float, ...], tuple[float, ...]]  # quantiles of log(length/lo), log(hi/length)


@dataclass(frozen=True)
class RangeBin:
    """One true-length bin's range sides, split at its median absolute error."""

    abs_error_split: float
    small_error: Sides
    large_error: Sides

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RangeBin:
        return cls(data["abs_error_split"], *(tuple(tuple(q) for q in data[k])
                                              for k in ("small_error", "large_error")))


@dataclass(frozen=True)
class NoiseModel:
    """Draws predictions of one kind given true lengths; see docs/policies.md.

    `bin_edges[i]` is the largest true length of bin `i` (the last bin is unbounded);
    `error_quantiles[i]` are the error quantiles of bin `i` at `QUANTILE_LEVELS`;
    `over_prob_quantiles` (CacheOpt only) maps "over" / "not_over" to the quantiles of the
    direction classifier's probability among held-out prompts of that actual direction;
    `range_quantiles` (CacheOpt only) holds, per bin, the median absolute error of the bin
    (in error space) and, for the prompts at or below it and for those above it, the
    quantiles of log(length / lo) and of log(hi / length).
    """

    kind: Kind
    space: ErrorSpace
    max_length: int
    bucket_width: int
    bin_edges: tuple[float, ...]
    error_quantiles: tuple[tuple[float, ...], ...]
    over_prob_quantiles: dict[str, tuple[float, ...]] | None
    num_calibration: int
    range_quantiles: tuple[RangeBin, ...] | None = None

    @classmethod
    def fit(cls, kind: Kind, true: np.ndarray, pred: np.ndarray, *, max_length: int,
            bucket_width: int, over_prob: np.ndarray | None = None, lo: np.ndarray | None = None,
            hi: np.ndarray | None = None, num_bins: int = 4) -> NoiseModel:
        """Calibrate on held-out true and predicted lengths (and CacheOpt's probabilities
        and ranges)."""
        true, pred = np.asarray(true), np.asarray(pred)
        if true.shape != pred.shape or true.size < num_bins:
            raise ValueError(f"need matching arrays of at least {num_bins} lengths")
        space: ErrorSpace = "bucket" if kind == "s3" else "log"
        errors = _to_space(pred, space, bucket_width) - _to_space(true, space, bucket_width)
        # Interior edges at true-length quantiles; repeated edges (many equal lengths) merge.
        edges = np.unique(np.quantile(true, np.arange(1, num_bins) / num_bins))
        bins = np.searchsorted(edges, true, side="left")
        over_quantiles = None
        if over_prob is not None:
            over = pred > true
            if over.all() or not over.any():
                raise ValueError("need held-out prompts of both directions to calibrate over_prob")
            over_prob = np.asarray(over_prob)
            over_quantiles = {_OVER: _quantiles(over_prob[over]),
                              _NOT_OVER: _quantiles(over_prob[~over])}
        range_quantiles = None
        if lo is not None and hi is not None:
            below = np.log(pred / np.asarray(lo, np.float64))
            above = np.log(np.asarray(hi, np.float64) / pred)
            range_bins = []
            for b in range(len(edges) + 1):
                in_bin = bins == b
                split = float(np.median(np.abs(errors[in_bin])))
                small = in_bin & (np.abs(errors) <= split)
                large = in_bin & ~small
                if not large.any():  # every error equal: one group serves both
                    large = small
                range_bins.append(RangeBin(
                    round(split, 6), (_quantiles(below[small]), _quantiles(above[small])),
                    (_quantiles(below[large]), _quantiles(above[large]))))
            range_quantiles = tuple(range_bins)
        return cls(kind, space, max_length, bucket_width, tuple(float(e) for e in edges),
                   tuple(_quantiles(errors[bins == b]) for b in range(len(edges) + 1)),
                   over_quantiles, int(true.size), range_quantiles)

    def sample(self, true_lengths: Sequence[int] | np.ndarray,
               rng: np.random.Generator) -> list[Prediction]:
        """One noisy prediction per true length."""
        true = np.asarray(true_lengths)
        if true.ndim != 1 or (true.size and true.min() < 1):
            raise ValueError("true lengths must be a 1-d sequence of positive integers")
        bins = np.searchsorted(np.asarray(self.bin_edges), true, side="left")
        levels = rng.random(true.size)
        errors = np.empty(true.size)
        for b, quantiles in enumerate(self.error_quantiles):
            errors[bins == b] = np.interp(levels[bins == b], QUANTILE_LEVELS, quantiles)
        lengths = _from_space(_to_space(true, self.space, self.bucket_width) + errors, self.space,
                              self.bucket_width, self.max_length)
        if self.over_prob_quantiles is None:
            return to_predictions(lengths)
        levels = rng.random(true.size)
        over_prob = np.where(lengths > true,
                             np.interp(levels, QUANTILE_LEVELS, self.over_prob_quantiles[_OVER]),
                             np.interp(levels, QUANTILE_LEVELS, self.over_prob_quantiles[_NOT_OVER]))
        if self.range_quantiles is None:
            return to_predictions(lengths, over_prob)
        lo, hi = self._sample_range(lengths, bins, np.abs(errors), rng.random(true.size))
        return to_predictions(lengths, over_prob, lo, hi)

    def _sample_range(self, lengths: np.ndarray, bins: np.ndarray, abs_errors: np.ndarray,
                      levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[lo, hi] around drawn `lengths`, both sides at one level per request, from the
        group of the request's bin that its drawn error falls in; rounded and clipped like
        the real head's, so lo <= length <= hi."""
        below, above = np.empty(lengths.size), np.empty(lengths.size)
        for b, range_bin in enumerate(self.range_quantiles or ()):
            large = abs_errors > range_bin.abs_error_split
            for group, (q_below, q_above) in ((~large, range_bin.small_error),
                                              (large, range_bin.large_error)):
                rows = (bins == b) & group
                below[rows] = np.interp(levels[rows], QUANTILE_LEVELS, q_below)
                above[rows] = np.interp(levels[rows], QUANTILE_LEVELS, q_above)
        lo = np.clip(np.round(lengths * np.exp(-below)), 1, lengths)
        hi = np.clip(np.round(lengths * np.exp(above)), lengths, self.max_length)
        return lo.astype(np.int64), hi.astype(np.int64)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "levels": list(QUANTILE_LEVELS)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NoiseModel:
        data = dict(data)
        if tuple(data.pop("levels")) != QUANTILE_LEVELS:
            raise ValueError("noise model stored at other quantile levels than this version uses")
        over = data["over_prob_quantiles"]
        ranges = data.get("range_quantiles")
        return cls(**{**data, "bin_edges": tuple(data["bin_edges"]),
                      "error_quantiles": tuple(tuple(q) for q in data["error_quantiles"]),
                      "over_prob_quantiles": None if over is None
                      else {k: tuple(v) for k, v in over.items()},
                      "range_quantiles": None if ranges is None
                      else tuple(RangeBin.from_json(r) for r in ranges)})


def write_noise_models(directory: Path, models: dict[str, NoiseModel]) -> None:
    (directory / NOISE_FILE).write_text(
        json.dumps({kind: m.to_json() for kind, m in models.items()}, indent=1) + "\n")


def load_noise_model(kind: Kind = "cacheopt", directory: Path | str | None = None) -> NoiseModel:
    """The `kind` noise model stored with a trained predictor (default: the shipped one)."""
    path = Path(directory or DEFAULT_DIR) / NOISE_FILE
    models = json.loads(path.read_text())
    if kind not in models:
        raise ValueError(f"{path} has no {kind!r} noise model (it has {', '.join(models)})")
    return NoiseModel.from_json(models[kind])
