"""Prediction heads over the frozen base's pooled prompt features (Flax NNX): CacheOpt's length
layer and direction classifier, S3's bucket classifier and RLP's regressor. Regressors predict
quantiles of log-length under the pinball loss, so the median minimises the MAE in tokens; why,
and what that leaves the direction classifier to learn: docs/policies.md, the length predictors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = [
    "KINDS", "BucketClassifier", "CacheOptHead", "DirectionClassifier", "FeatureNorm", "Head",
    "HeadConfig", "HeadOutput", "Kind", "LengthRegressor", "RLPHead", "S3Head", "bucket_of",
    "make_head", "predict_features",
]

Kind = Literal["cacheopt", "s3", "rlp"]
KINDS: tuple[Kind, ...] = ("cacheopt", "s3", "rlp")


@dataclass(frozen=True)
class HeadConfig:
    """Shapes and output conventions shared by every head.

    `max_length` caps every predicted length (the engine's default `max_model_len`);
    lengths are also floored at 1.
    """

    feature_dim: int
    hidden: int = 128
    max_length: int = 2048
    bucket_width: int = 50  # S3
    rlp_padding: int = 100  # RLP
    range_lo: float = 0.05  # CacheOpt: quantile levels of the per-request range [lo, hi]
    range_hi: float = 0.95
    # CacheOpt: feed the direction classifier the base's features beside the length layer's
    # output, as the paper does; off by default (`DirectionClassifier` says why).
    direction_features: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.range_lo < 0.5 < self.range_hi < 1.0:
            raise ValueError(f"need 0 < range_lo < 0.5 < range_hi < 1, got "
                             f"{self.range_lo} and {self.range_hi}")

    @property
    def num_buckets(self) -> int:
        return -(-self.max_length // self.bucket_width)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class HeadOutput:
    """Predicted lengths in tokens (integers as float32) and, for CacheOpt, P(over-prediction)
    and the predicted range [lo, hi] of the true length (its `range_lo`/`range_hi` quantiles)."""

    lengths: jax.Array
    over_prob: jax.Array | None = None
    lo: jax.Array | None = None
    hi: jax.Array | None = None


def bucket_of(lengths: np.ndarray | jax.Array, width: int) -> np.ndarray | jax.Array:
    """S3 bucket of each length: bucket b holds lengths (b * width, (b + 1) * width]."""
    return (lengths - 1) // width


def _clip_lengths(lengths: jax.Array, max_length: int) -> jax.Array:
    return jnp.clip(jnp.round(lengths), 1, max_length)


def _linear(d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, rngs=rngs)


class FeatureNorm(nnx.Module):
    """Standardise features with fixed statistics (set once from the training features)."""

    def __init__(self, dim: int) -> None:
        self.mean = nnx.BatchStat(jnp.zeros(dim, jnp.float32))
        self.std = nnx.BatchStat(jnp.ones(dim, jnp.float32))

    def fit(self, features: np.ndarray) -> None:
        self.mean.set_value(jnp.asarray(features.mean(0), jnp.float32))
        self.std.set_value(jnp.asarray(features.std(0) + 1e-6, jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return (x - self.mean.get_value()) / self.std.get_value()


class LengthRegressor(nnx.Module):
    """Features -> log-length quantiles `[N, len(levels)]`.

    `levels` are ascending and hold 0.5 (the median, the point prediction). The other
    quantiles are the median minus / plus a softplus gap, so they never cross it.
    """

    def __init__(self, cfg: HeadConfig, rngs: nnx.Rngs, levels: tuple[float, ...] = (0.5,)) -> None:
        if 0.5 not in levels or list(levels) != sorted(set(levels)):
            raise ValueError(f"levels must ascend and hold 0.5, got {levels}")
        self.levels = levels
        self.median_index = levels.index(0.5)
        self.norm = FeatureNorm(cfg.feature_dim)
        self.hidden = _linear(cfg.feature_dim, cfg.hidden, rngs)
        self.out = _linear(cfg.hidden, len(levels), rngs)

    def fit_data(self, x: np.ndarray, log_len: np.ndarray) -> None:
        """Standardise with `x`'s statistics and start from the training quantiles.

        Under the pinball loss Adam moves each parameter by about the learning rate per
        step, so output biases starting at 0 would spend hundreds of steps climbing to
        log-lengths around 5; the unconditional quantiles are the best constant guesses.
        """
        self.norm.fit(x)
        q = np.quantile(log_len, self.levels)
        m = self.median_index
        # Each outer quantile's gap to its inner neighbour; softplus^-1 needs it positive.
        gaps = np.maximum(np.concatenate([q[1:m + 1] - q[:m], [1.0], q[m + 1:] - q[m:-1]]), 1e-3)
        bias = np.where(np.arange(len(q)) == m, q[m], np.log(np.expm1(gaps)))
        self.out.bias.set_value(jnp.asarray(bias, jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        raw = self.out(jax.nn.gelu(self.hidden(self.norm(x))))
        m = self.median_index
        median = raw[:, m:m + 1]
        below = median - jnp.cumsum(jax.nn.softplus(raw[:, :m])[:, ::-1], axis=1)[:, ::-1]
        above = median + jnp.cumsum(jax.nn.softplus(raw[:, m + 1:]), axis=1)
        return jnp.concatenate([below, median, above], axis=1)

    def median(self, x: jax.Array) -> jax.Array:
        """Median log-length `[N]` (the point prediction)."""
        return self(x)[:, self.median_index]


class DirectionClassifier(nnx.Module):
    """(standardised features `[N, F]`, log-length quantiles `[N, Q]`) -> logit of
    over-prediction `[N]`.

    The paper feeds the classifier the base's representation too; we read only the length
    layer's output unless `cfg.direction_features` is set. With a few thousand labelled
    prompts the 1,152 feature dimensions let the classifier fit the labels' noise: trained
    on out-of-fold directions it scored held-out ROC AUC 0.505 +- 0.014 with the features
    and 0.628 +- 0.034 without them (3 seeds; `bench/predictor_accuracy.py`).
    """

    def __init__(self, cfg: HeadConfig, rngs: nnx.Rngs, num_quantiles: int = 3) -> None:
        self.with_features = cfg.direction_features
        d_in = num_quantiles + (cfg.feature_dim if cfg.direction_features else 0)
        self.hidden = _linear(d_in, cfg.hidden, rngs)
        self.out = _linear(cfg.hidden, 1, rngs)

    def __call__(self, x: jax.Array, log_quantiles: jax.Array) -> jax.Array:
        inputs = jnp.concatenate([x, log_quantiles], axis=-1) if self.with_features else log_quantiles
        return self.out(jax.nn.gelu(self.hidden(inputs)))[:, 0]


class BucketClassifier(nnx.Module):
    """Features -> logits over `num_buckets` length buckets."""

    def __init__(self, cfg: HeadConfig, rngs: nnx.Rngs) -> None:
        self.norm = FeatureNorm(cfg.feature_dim)
        self.hidden = _linear(cfg.feature_dim, cfg.hidden, rngs)
        self.out = _linear(cfg.hidden, cfg.num_buckets, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.gelu(self.hidden(self.norm(x))))


class CacheOptHead(nnx.Module):
    """CacheOpt's stack: the length layer (median and range quantiles), then the direction
    classifier on top of it.

    `range_margin` (log-length, set by training) widens (or narrows, when negative) the
    predicted range on both sides so that it holds `range_hi - range_lo` of the lengths of
    prompts the layer did not see (conformalised quantile regression on out-of-fold
    predictions): quantile outputs fitted on a few thousand prompts are too narrow on new
    ones (0.81 coverage for a 0.90 target, `bench/predictor_accuracy.py`).
    """

    def __init__(self, cfg: HeadConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.length = LengthRegressor(cfg, rngs, levels=(cfg.range_lo, 0.5, cfg.range_hi))
        self.direction = DirectionClassifier(cfg, rngs)
        self.range_margin = nnx.BatchStat(jnp.zeros((), jnp.float32))

    def calibrate_range(self, log_quantiles: np.ndarray, lengths: np.ndarray) -> None:
        """Set `range_margin` from out-of-fold log-quantiles `[N, 3]` and true lengths."""
        log_len = np.log(lengths)
        scores = np.maximum(log_quantiles[:, 0] - log_len, log_len - log_quantiles[:, 2])
        level = min(1.0, math.ceil((len(scores) + 1) * (self.cfg.range_hi - self.cfg.range_lo))
                    / len(scores))
        self.range_margin.set_value(jnp.asarray(np.quantile(scores, level), jnp.float32))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(log-length quantiles `[N, 3]`: lo, median, hi; over-prediction logit `[N]`)."""
        q = self.length(x)
        return q, self.direction(self.length.norm(x), q)

    def predict(self, x: jax.Array) -> HeadOutput:
        q, logit = self(x)
        margin = self.range_margin.get_value()
        # A negative margin must not move a bound across the median.
        q = jnp.stack([jnp.minimum(q[:, 0] - margin, q[:, 1]), q[:, 1],
                       jnp.maximum(q[:, 2] + margin, q[:, 1])], axis=1)
        lengths = _clip_lengths(jnp.exp(q), self.cfg.max_length)
        return HeadOutput(lengths[:, 1], jax.nn.sigmoid(logit), lengths[:, 0], lengths[:, 2])


class S3Head(nnx.Module):
    """S3's bucket classifier; predicts the upper edge of the most likely bucket."""

    def __init__(self, cfg: HeadConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.classifier = BucketClassifier(cfg, rngs)

    def predict(self, x: jax.Array) -> HeadOutput:
        bucket = jnp.argmax(self.classifier(x), axis=-1)
        return HeadOutput(_clip_lengths((bucket + 1) * self.cfg.bucket_width, self.cfg.max_length))


class RLPHead(nnx.Module):
    """RLP's length regressor; predicts the regressed length plus `rlp_padding` tokens."""

    def __init__(self, cfg: HeadConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.length = LengthRegressor(cfg, rngs)

    def predict(self, x: jax.Array) -> HeadOutput:
        log_len = self.length.median(x)
        return HeadOutput(_clip_lengths(jnp.exp(log_len) + self.cfg.rlp_padding,
                                        self.cfg.max_length))


Head = CacheOptHead | S3Head | RLPHead

_HEADS: dict[Kind, type[Head]] = {"cacheopt": CacheOptHead, "s3": S3Head, "rlp": RLPHead}


def make_head(kind: Kind, cfg: HeadConfig, seed: int = 0) -> Head:
    try:
        cls = _HEADS[kind]
    except KeyError:
        raise ValueError(f"unknown predictor kind {kind!r}; known: {', '.join(KINDS)}") from None
    return cls(cfg, nnx.Rngs(seed))


@nnx.jit
def predict_features(head: Head, features: jax.Array | np.ndarray) -> HeadOutput:
    """`head.predict` compiled (once per feature batch shape)."""
    return head.predict(features)
