"""Prediction heads over the frozen base's pooled prompt features (Flax NNX).

Three predictors, one per system that the engine compares:

- CacheOpt: a length layer (the paper's "added linear layer": features -> representation
  -> log-length) and a binary direction classifier fed the base's representation (the
  pooled features) and the length layer's representation, which predicts whether the
  length will be over-predicted. The length layer also predicts two quantiles of the
  log-length around its median (levels `range_lo`, `range_hi`: 5% and 95%): the
  per-request range [a_i, b_i] of the true length that the paper's Hoeffding padding
  (its Eq. 2-3) takes. The policy pads by that range and the direction.
- S3: a classifier over 50-token output-length buckets; the predicted length is the
  chosen bucket's upper edge, which is what S3 allocates.
- RLP: a length regressor whose prediction is padded by 100 tokens, RLP's allocation.

Regressors predict quantiles of the natural log of the length and are trained with the
pinball (quantile) loss on it (see `train.py`); at level 0.5 that is half the L1 loss,
whose minimiser is the conditional median. The median of log-length is the log of the
median length, so exp(prediction) estimates the median reply length, which is exactly the
estimate that minimises the expected absolute error in tokens (the MAE reported), and
quantiles of log-length are the logs of the length's quantiles, so the range transfers
too. Regressing raw lengths with squared error would instead chase the mean of a
heavy-tailed distribution (ShareGPT replies run from a few tokens to two thousand) and
let a few long replies dominate the gradient.

A consequence worth knowing: the error of a conditional median is over or under with
probability 1/2 whatever the prompt, so the direction classifier can only learn where the
length layer misses the conditional median (e.g. where it regresses towards the typical
length); `bench/predictor_accuracy.py` measures how much that is.

Every head standardises its input with statistics of the training features, stored as
non-trainable variables so that a checkpoint is self-contained: the base's final-norm
hidden states have a few dimensions tens of times larger than the rest.
"""

from __future__ import annotations

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
    """Features -> (log-length quantiles `[N, len(levels)]`, the length layer's
    representation `[N, hidden]`).

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

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        rep = jax.nn.gelu(self.hidden(self.norm(x)))
        raw = self.out(rep)
        m = self.median_index
        median = raw[:, m:m + 1]
        below = median - jnp.cumsum(jax.nn.softplus(raw[:, :m])[:, ::-1], axis=1)[:, ::-1]
        above = median + jnp.cumsum(jax.nn.softplus(raw[:, m + 1:]), axis=1)
        return jnp.concatenate([below, median, above], axis=1), rep

    def median(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(median log-length `[N]`, representation)."""
        q, rep = self(x)
        return q[:, self.median_index], rep


class DirectionClassifier(nnx.Module):
    """(standardised features, length representation) -> logit of over-prediction."""

    def __init__(self, cfg: HeadConfig, rngs: nnx.Rngs) -> None:
        self.hidden = _linear(cfg.feature_dim + cfg.hidden, cfg.hidden, rngs)
        self.out = _linear(cfg.hidden, 1, rngs)

    def __call__(self, x: jax.Array, rep: jax.Array) -> jax.Array:
        return self.out(jax.nn.gelu(self.hidden(jnp.concatenate([x, rep], axis=-1))))[:, 0]


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
    classifier on top of it."""

    def __init__(self, cfg: HeadConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.length = LengthRegressor(cfg, rngs, levels=(cfg.range_lo, 0.5, cfg.range_hi))
        self.direction = DirectionClassifier(cfg, rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(log-length quantiles `[N, 3]`: lo, median, hi; over-prediction logit `[N]`)."""
        q, rep = self.length(x)
        return q, self.direction(self.length.norm(x), rep)

    def predict(self, x: jax.Array) -> HeadOutput:
        q, logit = self(x)
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
        log_len, _ = self.length.median(x)
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
