"""`LengthPredictor`: what a scheduling policy calls to guess a request's output length.

A predictor is the frozen base (the serving model's SmolLM2-135M weights) as prompt
encoder plus one trained head (`heads.py`). `LengthPredictor.load()` reads a trained
directory (default: the one shipped inside the package, `jserve/predictor/default`), so
`LLM(policy="cacheopt")` works without training anything.

The base model is loaded once per process and shared by every predictor that uses it
(pass `base=` to share the serving engine's own copy instead). Encoding a prompt is a
prefill of at most `max_prompt_len` tokens on the base, compiled per power-of-two shape
bucket on first use; cache predictions per request rather than asking twice.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from jserve.predictor.checkpoint import PredictorSpec, load_head
from jserve.predictor.encoder import PromptEncoder
from jserve.predictor.heads import Head, Kind, predict_features
from jserve.models.loading import LoadedModel, load_model

__all__ = ["DEFAULT_DIR", "LengthPredictor", "Prediction", "to_predictions"]

DEFAULT_DIR = Path(__file__).resolve().parent / "default"


@dataclass(frozen=True)
class Prediction:
    """A predicted output length in tokens, in [1, max_length].

    `length` is what the kind's system allocates for: CacheOpt's raw estimate (the median;
    its policy pads it), the upper edge of S3's bucket, RLP's estimate already plus 100
    tokens. `over_prob` is CacheOpt's P(length > true length), from its direction
    classifier. `lo` and `hi` are CacheOpt's per-request range of the true length (its
    predicted 5% and 95% quantiles by default, `HeadConfig.range_lo`/`range_hi`), the
    [a_i, b_i] whose width b_i - a_i the paper's Hoeffding padding (Eq. 3) takes:
    t_i = (hi - lo) * sqrt(-ln(1 - c) / 2). All three are None for the other kinds.
    """

    length: int
    over_prob: float | None = None
    lo: int | None = None
    hi: int | None = None

    @property
    def columns(self) -> tuple[int, int]:
        """`(predicted_len, predicted_dir)` as the engine's request columns hold them: the
        direction is +1 where the classifier expects an over-prediction (`over_prob > 0.5`),
        -1 where it expects an under-prediction, 0 without a classifier."""
        if self.over_prob is None:
            return self.length, 0
        return self.length, 1 if self.over_prob > 0.5 else -1


def to_predictions(lengths: np.ndarray, over_prob: np.ndarray | None = None,
                   lo: np.ndarray | None = None, hi: np.ndarray | None = None) -> list[Prediction]:
    """Predictions from arrays of lengths and (CacheOpt) over-prediction probabilities and
    range bounds."""
    n = len(lengths)
    over_prob = [None] * n if over_prob is None else [float(p) for p in over_prob]
    lo = [None] * n if lo is None else [int(v) for v in lo]
    hi = [None] * n if hi is None else [int(v) for v in hi]
    return [Prediction(int(length), p, a, b)
            for length, p, a, b in zip(lengths, over_prob, lo, hi, strict=True)]


@functools.lru_cache(maxsize=2)
def _shared_base(name: str) -> LoadedModel:
    return load_model(name)


class LengthPredictor:
    """Predicts output lengths of chat-templated prompts (token ids, as the engine holds them)."""

    def __init__(self, kind: Kind, head: Head, encoder: PromptEncoder) -> None:
        self.kind = kind
        self.head = head
        self.encoder = encoder

    @classmethod
    def load(cls, kind: Kind = "cacheopt", directory: Path | str | None = None, *,
             base: LoadedModel | None = None) -> LengthPredictor:
        """The `kind` predictor trained in `directory` (default: the shipped one).

        `base` shares an already loaded base model; it must be the one the heads were
        trained on (`config.json`'s `encoder.base_model`).
        """
        directory = Path(directory or DEFAULT_DIR)
        spec = PredictorSpec.read(directory)
        head = load_head(directory, spec, kind)
        base = base or _shared_base(spec.encoder.base_model)
        return cls(kind, head, PromptEncoder(base, spec.encoder))

    @staticmethod
    def base_model(directory: Path | str | None = None) -> str:
        """Name of the model whose tokens (and weights) the predictors in `directory` read."""
        return PredictorSpec.read(Path(directory or DEFAULT_DIR)).encoder.base_model

    @property
    def max_length(self) -> int:
        return self.head.cfg.max_length

    def predict(self, prompt_token_ids: Sequence[int]) -> Prediction:
        return self.predict_batch([prompt_token_ids])[0]

    def predict_batch(self, prompts: Sequence[Sequence[int]]) -> list[Prediction]:
        """One prediction per prompt, encoded together (cheaper than one call per prompt)."""
        if not prompts:
            return []
        out = jax.tree.map(np.asarray, predict_features(self.head, self.encoder.encode(prompts)))
        return to_predictions(out.lengths, out.over_prob, out.lo, out.hi)
