"""Accuracy of a length predictor on held-out prompts (CacheOpt's Fig. 17h quantities).

A prediction *over*-predicts when it exceeds the true length (the allocation wastes
memory) and *under*-predicts when it falls short (the request outgrows its allocation
and must be extended or preempted); an exact hit is neither. The mean deviations are
taken within each side, so they say how far off a predictor is when it is wrong in that
direction, which is what padding and reservation policies must absorb.

For CacheOpt the direction classifier is scored beside the trivial classifier that always
answers the majority direction of its training labels, by accuracy and by ROC AUC (0.5:
no information, whatever the class balance), and the predicted range [lo, hi] by how
often it holds the true length and how wide it is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["LengthMetrics", "format_metrics_table", "length_metrics", "roc_auc"]


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
    direction_auc: float | None = None  # CacheOpt: ROC AUC of over_prob for "pred > true"
    direction_majority_acc: float | None = None  # always the training labels' majority
    range_coverage: float | None = None  # CacheOpt: fraction with lo <= true <= hi
    range_width: float | None = None  # CacheOpt: mean hi - lo in tokens

    def to_json(self) -> dict[str, float | int | None]:
        return asdict(self)


def _mean_or_zero(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else 0.0


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """P(score of a random positive > score of a random negative), ties counting half
    (the Mann-Whitney statistic over the product of the class sizes)."""
    scores, labels = np.asarray(scores), np.asarray(labels, bool)
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("ROC AUC needs both classes")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]  # 1-based, ties averaged
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def length_metrics(pred: np.ndarray, true: np.ndarray, tolerance: int = 50,
                   over_prob: np.ndarray | None = None, majority_over: bool | None = None,
                   lo: np.ndarray | None = None, hi: np.ndarray | None = None) -> LengthMetrics:
    """Metrics of predicted against true lengths. `over_prob` adds the direction's accuracy
    and AUC, `majority_over` (the training labels' majority is "over") the trivial
    classifier's accuracy, `lo` and `hi` the range's coverage and width."""
    pred = np.asarray(pred, np.float64)
    true = np.asarray(true, np.float64)
    if pred.shape != true.shape or pred.ndim != 1 or pred.size == 0:
        raise ValueError(f"need two equal non-empty 1-d arrays, got {pred.shape} and {true.shape}")
    err = pred - true
    over, under = err > 0, err < 0
    direction_acc = direction_auc = majority_acc = coverage = width = None
    if over_prob is not None:
        direction_acc = float(np.mean((np.asarray(over_prob) > 0.5) == over))
        if over.any() and not over.all():
            direction_auc = roc_auc(np.asarray(over_prob), over)
    if majority_over is not None:
        majority_acc = float(np.mean(over == majority_over))
    if lo is not None and hi is not None:
        coverage = float(np.mean((lo <= true) & (true <= hi)))
        width = float(np.mean(np.asarray(hi, np.float64) - lo))
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
        direction_auc=direction_auc,
        direction_majority_acc=majority_acc,
        range_coverage=coverage,
        range_width=width,
    )


def format_metrics_table(rows: dict[str, LengthMetrics]) -> str:
    """A fixed-width table, one row per predictor."""
    header = (f"{'predictor':<10} {'n':>5} {'MAE':>7} {'acc@tol':>8} {'over':>6} {'under':>6} "
              f"{'mean over':>10} {'mean under':>11} {'dir acc':>8} {'majority':>8} "
              f"{'dir AUC':>8} {'range cov':>9} {'width':>6}")
    lines = [header, "-" * len(header)]
    for name, m in rows.items():
        lines.append(f"{name:<10} {m.num:>5} {m.mae:>7.1f} {m.acc_within:>8.3f} {m.over_rate:>6.3f} "
                     f"{m.under_rate:>6.3f} {m.mean_over:>10.1f} {m.mean_under:>11.1f} "
                     f"{_opt(m.direction_acc, 8, 3)} {_opt(m.direction_majority_acc, 8, 3)} "
                     f"{_opt(m.direction_auc, 8, 3)} {_opt(m.range_coverage, 9, 3)} "
                     f"{_opt(m.range_width, 6, 0)}")
    return "\n".join(lines)


def _opt(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"
