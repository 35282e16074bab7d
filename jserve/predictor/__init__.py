"""Output-length predictors for the prediction-based policies (CacheOpt, S3, RLP).

Policies call `LengthPredictor.load(kind).predict(prompt_token_ids)`; simulator runs at
scale draw from `load_noise_model(kind).sample(true_lengths, rng)`, calibrated on the
trained predictor's held-out errors. Both return `Prediction`s. `jserve train-predictor`
trains new heads (see `train.py`); a small trained default ships in `default/`.
"""

from jserve.predictor.heads import KINDS, Kind
from jserve.predictor.noise import NoiseModel, load_noise_model
from jserve.predictor.predictor import DEFAULT_DIR, LengthPredictor, Prediction

__all__ = ["DEFAULT_DIR", "KINDS", "Kind", "LengthPredictor", "NoiseModel", "Prediction",
           "load_noise_model"]
