"""Train the length predictors' heads on cached base features (optax, orbax, resumable):
CacheOpt in the paper's two steps with its direction labels collected out of fold, S3 and RLP
in one; every stage checkpoints each epoch and resumes exactly. Why out of fold, and our
choices against the paper with what was measured: docs/policies.md, the length predictors.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from jserve.predictor.checkpoint import METRICS_FILE, PredictorSpec, resume_dir, save_head
from jserve.predictor.data import build_dataset, cached_features
from jserve.predictor.encoder import EncoderConfig, PromptEncoder
from jserve.predictor.heads import (
    CacheOptHead, DirectionClassifier, Head, HeadConfig, Kind, LengthRegressor, RLPHead, S3Head,
    bucket_of, make_head, predict_features,
)
from jserve.predictor.metrics import LengthMetrics, length_metrics
from jserve.predictor.noise import NoiseModel, write_noise_models
from jserve.models.loading import load_model

__all__ = [
    "Directions", "TrainConfig", "TrainOptions", "TrainResult", "bucket_loss", "direction_loss",
    "directions", "fit", "length_loss", "out_of_fold_directions", "split_validation",
    "train_direction", "train_head", "train_length", "train_predictors",
]

MEDIAN_BASELINE = "median"  # the metrics row of the constant training-median guess

Batch = dict[str, jax.Array]
LossFn = Callable[[Any, Batch], jax.Array]


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser settings of every stage (AdamW; weight decay regularises the small heads),
    the examples kept out to choose each stage's epoch (`fit`), and the folds over which
    CacheOpt's direction labels are collected."""

    epochs: int = 20
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 1e-2
    seed: int = 0
    direction_folds: int = 5
    val_fraction: float = 0.1  # kept out of each stage's training to choose its epoch

    def __post_init__(self) -> None:
        if self.direction_folds < 2:
            raise ValueError(f"direction_folds must be >= 2, got {self.direction_folds}")
        if not 0.0 <= self.val_fraction < 0.5:
            raise ValueError(f"val_fraction must be in [0, 0.5), got {self.val_fraction}")


@dataclass(frozen=True)
class TrainOptions:
    """One `jserve train-predictor` run."""

    output: Path = Path("predictor")
    kinds: tuple[Kind, ...] = ("cacheopt", "s3", "rlp")
    num_train: int = 3000
    num_test: int = 1000
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    hidden: int = 128
    train: TrainConfig = field(default_factory=TrainConfig)
    resume: bool = False
    progress: bool = True


@dataclass(frozen=True)
class TrainResult:
    metrics: dict[str, LengthMetrics]  # held-out, per kind and for MEDIAN_BASELINE
    num_train: int
    num_test: int
    encode_seconds: float
    train_seconds: float


# ------------------------------------------------------------------------------ losses


def pinball_loss(q: jax.Array, target: jax.Array, levels: tuple[float, ...]) -> jax.Array:
    """Quantile loss summed over `levels` (columns of `q`), averaged over the batch; at the
    single level 0.5 it is half the L1 loss."""
    tau = jnp.asarray(levels, jnp.float32)
    diff = target[:, None] - q
    return jnp.mean(jnp.sum(jnp.maximum(tau * diff, (tau - 1.0) * diff), axis=1))


def length_loss(regressor: LengthRegressor, batch: Batch) -> jax.Array:
    return pinball_loss(regressor(batch["x"]), batch["log_len"], regressor.levels)


def direction_loss(classifier: DirectionClassifier, batch: Batch) -> jax.Array:
    logit = classifier(batch["x"], batch["log_quantiles"])
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logit, batch["over"]))


def bucket_loss(head: S3Head, batch: Batch) -> jax.Array:
    logits = head.classifier(batch["x"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["bucket"]))


# ------------------------------------------------------------------------------ the loop


def _train_state(module: nnx.Module, optimizer: nnx.Optimizer, best: dict[str, Any],
                 best_loss: float) -> dict[str, Any]:
    return {"model": nnx.to_pure_dict(nnx.state(module)),
            "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
            "best_model": best, "best_loss": np.asarray(best_loss, np.float32)}


def _restore_into(obj: nnx.Module | nnx.Optimizer, pure: dict[str, Any]) -> None:
    state = nnx.state(obj)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(obj, state)


def _stable_draws(n: int, seed: list[int]) -> np.ndarray:
    """One uniform draw per example, the first `m` the same for any `n >= m`: a split made
    from them keeps every example of a smaller run on its side when `--resume` adds data."""
    return np.random.default_rng(seed).random(n)


def split_validation(n: int, cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, validation rows): about `cfg.val_fraction` of `n` examples, seeded,
    kept out of training to choose the epoch (see `fit`)."""
    val = _stable_draws(n, [cfg.seed, 2]) < cfg.val_fraction
    return np.flatnonzero(~val), np.flatnonzero(val)


def fit(module: nnx.Module, loss_fn: LossFn, data: dict[str, np.ndarray], cfg: TrainConfig,
        ckpt_dir: Path, desc: str, progress: bool = True) -> None:
    """Train `module`'s parameters in place on `data` (equal-length arrays).

    Early stopping: `cfg.val_fraction` of the examples (`split_validation`) are not trained
    on; after every epoch the loss on them is measured and the module ends with the
    parameters of the epoch where it was lowest. The heads have ~150k parameters for a few
    thousand prompts and memorise them within a few epochs (training MAE 45 tokens against
    147 on unseen prompts after 20 epochs); CacheOpt's direction classifier learns from
    what the length layer does on its training prompts, so that must look like what it does
    on new ones. Without validation examples (`val_fraction` 0) the last epoch is kept.

    Resumes from the latest checkpoint in `ckpt_dir` when there is one, up to `cfg.epochs`
    epochs in all (so a resumed run with more epochs goes on where the last one stopped).
    """
    train_rows, val_rows = split_validation(len(next(iter(data.values()))), cfg)
    val = {k: v[val_rows] for k, v in data.items()}
    data = {k: v[train_rows] for k, v in data.items()}
    optimizer = nnx.Optimizer(module, optax.adamw(cfg.lr, weight_decay=cfg.weight_decay),
                              wrt=nnx.Param)
    best, best_loss = nnx.to_pure_dict(nnx.state(module)), math.inf
    manager = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=1))
    start = manager.latest_step() or 0
    if start:
        restored = manager.restore(start, args=ocp.args.StandardRestore(
            _train_state(module, optimizer, best, best_loss)))
        _restore_into(module, restored["model"])
        _restore_into(optimizer, restored["optimizer"])
        best, best_loss = restored["best_model"], float(restored["best_loss"])
        if val_rows.size:  # a run resumed with more data chooses on the grown validation set
            kept = nnx.clone(module)
            _restore_into(kept, best)
            best_loss = float(loss_fn(kept, val))

    @nnx.jit
    def step(module: nnx.Module, optimizer: nnx.Optimizer, batch: Batch) -> jax.Array:
        loss, grads = nnx.value_and_grad(loss_fn)(module, batch)
        optimizer.update(module, grads)
        return loss

    evaluate = nnx.jit(loss_fn)
    n = len(next(iter(data.values())))
    steps = math.ceil(n / cfg.batch_size)
    bar = tqdm(total=cfg.epochs * steps, initial=min(start, cfg.epochs) * steps, desc=desc,
               unit="step", disable=not progress)
    with bar:
        for epoch in range(start, cfg.epochs):
            order = np.random.default_rng([cfg.seed, epoch]).permutation(n)
            losses = []
            for i in range(0, n, cfg.batch_size):
                idx = order[i:i + cfg.batch_size]
                losses.append(step(module, optimizer, {k: v[idx] for k, v in data.items()}))
                bar.update(1)
            val_loss = float(evaluate(module, val)) if val_rows.size else -math.inf
            if val_loss <= best_loss or not val_rows.size:
                best, best_loss = nnx.to_pure_dict(nnx.state(module)), val_loss
            bar.set_postfix(epoch=epoch + 1, loss=f"{float(np.mean(jax.device_get(losses))):.4f}",
                            val=f"{val_loss:.4f}")
            manager.save(epoch + 1, args=ocp.args.StandardSave(
                _train_state(module, optimizer, best, best_loss)))
    manager.wait_until_finished()
    manager.close()
    _restore_into(module, best)


def train_length(regressor: LengthRegressor, x: np.ndarray, lengths: np.ndarray,
                 cfg: TrainConfig, ckpt_dir: Path, desc: str, progress: bool = True) -> None:
    """Step 1 (and RLP's whole training): the length layer alone on the true lengths."""
    log_len = np.log(lengths).astype(np.float32)
    regressor.fit_data(x, log_len)
    fit(regressor, length_loss, {"x": x, "log_len": log_len}, cfg, ckpt_dir, desc, progress)


@dataclass(frozen=True)
class Directions:
    """Step 2's data for each training prompt: the length layer's log-length quantiles
    `[N, 3]` and whether its median over-predicted (1.0) or not (0.0)."""

    log_quantiles: np.ndarray
    over: np.ndarray


def directions(regressor: LengthRegressor, x: np.ndarray, lengths: np.ndarray,
               max_length: int) -> Directions:
    """`regressor`'s outputs on `x` and its directions against the true `lengths`, its
    median rounded and clipped as a head predicts it (the paper's "over": > true)."""
    q = np.asarray(regressor(jnp.asarray(x)))
    pred = np.clip(np.round(np.exp(q[:, regressor.median_index])), 1, max_length)
    return Directions(q, (pred > lengths).astype(np.float32))


def out_of_fold_directions(cfg_head: HeadConfig, levels: tuple[float, ...], x: np.ndarray,
                           lengths: np.ndarray, cfg: TrainConfig, directory: Path,
                           progress: bool = True) -> Directions:
    """Each training prompt's `directions` under a step-1 length layer that never saw it
    (`cfg.direction_folds` folds; each fold's layer trains on the others)."""
    fold_of = (_stable_draws(len(x), [cfg.seed, 1]) * cfg.direction_folds).astype(np.int64)
    folds = [np.flatnonzero(fold_of == k) for k in range(cfg.direction_folds)]
    q = np.empty((len(x), len(levels)), np.float32)
    over = np.empty(len(x), np.float32)
    for k, held in enumerate(folds):
        rest = np.setdiff1d(np.arange(len(x)), held)
        regressor = LengthRegressor(cfg_head, nnx.Rngs(cfg.seed + 1 + k), levels=levels)
        train_length(regressor, x[rest], lengths[rest], cfg,
                     resume_dir(directory, f"cacheopt-fold{k}"),
                     f"cacheopt directions, fold {k + 1}/{len(folds)}", progress)
        fold = directions(regressor, x[held], lengths[held], cfg_head.max_length)
        q[held], over[held] = fold.log_quantiles, fold.over
    return Directions(q, over)


def train_direction(head: CacheOptHead, x: np.ndarray, data: Directions, cfg: TrainConfig,
                    ckpt_dir: Path, progress: bool = True) -> None:
    """Step 2: the direction classifier on the collected directions (length layer fixed)."""
    x_std = np.asarray(head.length.norm(jnp.asarray(x)))
    fit(head.direction, direction_loss,
        {"x": x_std, "log_quantiles": data.log_quantiles, "over": data.over}, cfg, ckpt_dir,
        "cacheopt 2/2 direction", progress)


def train_head(head: Head, x: np.ndarray, lengths: np.ndarray, cfg: TrainConfig,
               directory: Path, progress: bool = True) -> np.ndarray | None:
    """Train one head in place on training features `x` and true lengths (see docs/policies.md).

    Returns CacheOpt's direction labels (None for the other kinds): the trivial baseline
    guesses their majority.
    """
    if isinstance(head, S3Head):
        head.classifier.norm.fit(x)
        data = {"x": x, "bucket": bucket_of(lengths, head.cfg.bucket_width).astype(np.int32)}
        fit(head, bucket_loss, data, cfg, resume_dir(directory, "s3"), "s3 buckets", progress)
        return None
    if isinstance(head, RLPHead):
        train_length(head.length, x, lengths, cfg, resume_dir(directory, "rlp"), "rlp length",
                     progress)
        return None
    train_length(head.length, x, lengths, cfg, resume_dir(directory, "cacheopt-length"),
                 "cacheopt 1/2 length", progress)
    data = out_of_fold_directions(head.cfg, head.length.levels, x, lengths, cfg, directory,
                                  progress)
    head.calibrate_range(data.log_quantiles, lengths)
    train_direction(head, x, data, cfg, resume_dir(directory, "cacheopt-direction"), progress)
    return data.over


# ------------------------------------------------------------------------------ a whole run


EXTENSIBLE = ("epochs", "num_train")  # what `--resume` may raise; every other setting must match


def _check_extends(old: PredictorSpec, new: PredictorSpec, out: Path) -> None:
    """`new` continues `old`: the same settings but for more epochs and more training data;
    more data needs more epochs (every stage has already run its `old` epochs on the old data)."""
    before = {k: v for k, v in old.to_json().items() if k != "training"}
    after = {k: v for k, v in new.to_json().items() if k != "training"}
    fixed = sorted(k for k in old.training.keys() | new.training.keys()
                   if k not in EXTENSIBLE and old.training.get(k) != new.training.get(k))
    if before != after or fixed:
        changed = ", ".join(fixed) or "the encoder, heads or kinds"
        raise ValueError(f"{out} holds a run with other settings ({changed} differ; see "
                         f"{out / 'config.json'}): resume it with the same options (more --epochs "
                         "or --num-train may be given) or choose another --output")
    for name in EXTENSIBLE:
        if new.training[name] < old.training[name]:
            raise ValueError(f"--resume extends a run: {name} {new.training[name]} is below the "
                             f"run's {old.training[name]}")
    if new.training["num_train"] > old.training["num_train"] \
            and new.training["epochs"] <= old.training["epochs"]:
        raise ValueError(f"{out} already ran {old.training['epochs']} epochs; to train on more "
                         "prompts pass more --epochs too (every stage goes on from its last epoch)")


def _check_resume(options: TrainOptions, spec: PredictorSpec) -> None:
    """Refuse to mix runs: resume the same training, or extend it with more epochs or more
    training prompts (the same held-out ones), never overwrite one silently."""
    out = options.output
    if options.resume:
        if (out / "config.json").exists():
            _check_extends(PredictorSpec.read(out), spec, out)
    elif (out / "resume").exists():
        raise ValueError(f"{out} already has training checkpoints; pass --resume to continue "
                         "them or choose another --output")


def train_predictors(options: TrainOptions) -> TrainResult:
    """Build the data, encode it (cached), train each kind, evaluate on held-out prompts,
    fit the noise models, and write everything under `options.output` (see checkpoint.py)."""
    base = load_model(options.encoder.base_model)
    dataset = build_dataset(base.tokenizer, options.num_train, options.num_test,
                            seed=options.train.seed)
    encoder = PromptEncoder(base, options.encoder)
    head_cfg = HeadConfig(feature_dim=encoder.feature_dim, hidden=options.hidden)
    spec = PredictorSpec(options.encoder, head_cfg, options.kinds, training={
        **asdict(options.train), "num_train": len(dataset.train), "num_test": len(dataset.test)})
    _check_resume(options, spec)  # before minutes of encoding, not after
    spec.write(options.output)

    t0 = time.perf_counter()
    x_train = cached_features(encoder, dataset.train, progress=options.progress)
    x_test = cached_features(encoder, dataset.test, progress=options.progress)
    encode_seconds = time.perf_counter() - t0
    y_train = np.array([ex.output_len for ex in dataset.train])
    y_test = np.array([ex.output_len for ex in dataset.test])

    t0 = time.perf_counter()
    metrics, noise = {}, {}
    for kind in options.kinds:
        head = make_head(kind, head_cfg, seed=options.train.seed)
        labels = train_head(head, x_train, y_train, options.train, options.output,
                            options.progress)
        save_head(options.output, kind, head)
        out = jax.tree.map(np.asarray, predict_features(head, x_test))
        metrics[kind] = length_metrics(
            out.lengths, y_test, over_prob=out.over_prob, lo=out.lo, hi=out.hi,
            majority_over=None if labels is None else bool(labels.mean() > 0.5))
        noise[kind] = NoiseModel.fit(kind, y_test, out.lengths, max_length=head_cfg.max_length,
                                     bucket_width=head_cfg.bucket_width, over_prob=out.over_prob,
                                     lo=out.lo, hi=out.hi)
    # What the heads must beat: one constant guess, the training median, for every prompt.
    metrics[MEDIAN_BASELINE] = length_metrics(np.full(y_test.shape, np.median(y_train)), y_test)
    result = TrainResult(metrics, len(dataset.train), len(dataset.test), encode_seconds,
                         time.perf_counter() - t0)
    write_noise_models(options.output, noise)
    (options.output / METRICS_FILE).write_text(json.dumps({
        "held_out": {k: m.to_json() for k, m in metrics.items()},
        "num_train": result.num_train, "num_test": result.num_test,
        "encode_seconds": round(encode_seconds, 1), "train_seconds": round(result.train_seconds, 1),
    }, indent=1) + "\n")
    return result

