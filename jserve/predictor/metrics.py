"""Accuracy of a length predictor on held-out prompts (CacheOpt's Fig. 17h quantities).

A prediction *over*-predicts when it exceeds the true length (the allocation wastes
memory) and *under*-predicts when it falls short (the request outgrows its allocation
and must be extended or preempted); an exact hit is neither. The mean deviations are
taken within each side, so they say how far off a predictor is when it is wrong in that
direction, which is what padding and reservation policies must absorb.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["LengthMetrics", "format_metrics_table", "length_metrics"]


@dataclass(frozen=True)
class LengthMetrics:
    num: int
    mae: float  # mean |pred - true| in tokens
    acc_within: float  # fraction with |pred - true| <= tolerance
    tolerance: int
    over_rate: float  # fraction with pred > true
    under_rate: float  # fraction with pred < true
    mean_over: float  # mean (pred - true) over the over-predicted; 0 if none
    mean_under: float  # mean (true - pred) over the under-predicted; 0 if none
    direction_acc: float | None = None  # CacheOpt: classifier's accuracy on "pred > true"

    def to_json(self) -> dict[str, float | int | None]:
        return asdict(self)


def _mean_or_zero(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else 0.0


def length_metrics(pred: np.ndarray, true: np.ndarray, tolerance: int = 50,
                   over_prob: np.ndarray | None = None) -> LengthMetrics:
    """Metrics of predicted against true lengths; `over_prob` adds the direction accuracy."""
    pred = np.asarray(pred, np.float64)
    true = np.asarray(true, np.float64)
    if pred.shape != true.shape or pred.ndim != 1 or pred.size == 0:
        raise ValueError(f"need two equal non-empty 1-d arrays, got {pred.shape} and {true.shape}")
    err = pred - true
    over, under = err > 0, err < 0
    direction_acc = None
    if over_prob is not None:
        direction_acc = float(np.mean((np.asarray(over_prob) > 0.5) == over))
    return LengthMetrics(
        num=int(pred.size),
        mae=float(np.abs(err).mean()),
        acc_within=float(np.mean(np.abs(err) <= tolerance)),
        tolerance=tolerance,
        over_rate=float(over.mean()),
        under_rate=float(under.mean()),
        mean_over=_mean_or_zero(err[over]),
        mean_under=_mean_or_zero(-err[under]),
        direction_acc=direction_acc,
    )


def format_metrics_table(rows: dict[str, LengthMetrics]) -> str:
    """A fixed-width table, one row per predictor."""
    header = (f"{'predictor':<10} {'n':>5} {'MAE':>7} {'acc@tol':>8} {'over':>6} {'under':>6} "
              f"{'mean over':>10} {'mean under':>11} {'dir acc':>8}")
    lines = [header, "-" * len(header)]
    for name, m in rows.items():
        direction = "-" if m.direction_acc is None else f"{m.direction_acc:.3f}"
        lines.append(f"{name:<10} {m.num:>5} {m.mae:>7.1f} {m.acc_within:>8.3f} {m.over_rate:>6.3f} "
                     f"{m.under_rate:>6.3f} {m.mean_over:>10.1f} {m.mean_under:>11.1f} "
                     f"{direction:>8}")
    return "\n".join(lines)
