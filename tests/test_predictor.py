"""Tests for jserve.predictor: metrics, heads, training and resume, the shipped default, noise."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jserve.cli import main
from jserve.datasets.sharegpt import Conversation, Turn
from jserve.predictor import (
    DEFAULT_DIR,
    KINDS,
    LengthPredictor,
    NoiseModel,
    load_noise_model,
)
from jserve.predictor.checkpoint import PredictorSpec, load_head, save_head
from jserve.predictor.data import (
    LengthExample,
    build_dataset,
    cached_features,
    chat_prompt_ids,
)
from jserve.predictor.encoder import EncoderConfig, PromptEncoder, truncate_prompt
from jserve.predictor.heads import HeadConfig, bucket_of, make_head, predict_features
from jserve.predictor import train as train_module
from jserve.predictor.metrics import length_metrics, roc_auc
from jserve.predictor.noise import QUANTILE_LEVELS
from jserve.predictor.train import (
    Directions, TrainConfig, fit, length_loss, out_of_fold_directions, split_validation, train_head,
)
from jserve.models.loading import LoadedModel

FEATURES = 16


def _synthetic(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Features whose first coordinates set the log-length, plus noise and a large offset."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    lengths = np.clip(np.round(np.exp(5 + 0.5 * x[:, 0] - 0.3 * x[:, 1])), 1, 2048)
    return x * 3 + 10, lengths.astype(np.int64)


def _params(module: nnx.Module) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(module))]


# --------------------------------------------------------------------------- metrics


def test_length_metrics_on_hand_made_numbers() -> None:
    pred = np.array([100, 150, 80, 300, 40])
    true = np.array([100, 100, 100, 200, 45])
    m = length_metrics(pred, true, tolerance=50, over_prob=np.array([0.2, 0.9, 0.1, 0.6, 0.7]))
    assert m.num == 5
    assert m.mae == pytest.approx((0 + 50 + 20 + 100 + 5) / 5)
    assert m.acc_within == pytest.approx(4 / 5)  # 50 is within, 100 is not
    assert m.over_rate == pytest.approx(2 / 5) and m.under_rate == pytest.approx(2 / 5)
    assert m.mean_over == pytest.approx((50 + 100) / 2)
    assert m.mean_under == pytest.approx((20 + 5) / 2)
    # Over-predicted: [F, T, F, T, F]; classifier says over: [F, T, F, T, T].
    assert m.direction_acc == pytest.approx(4 / 5)


def test_direction_and_range_metrics_on_hand_made_numbers() -> None:
    pred, true = np.array([100, 150, 80, 300]), np.array([100, 100, 100, 200])
    m = length_metrics(pred, true, over_prob=np.array([0.2, 0.9, 0.1, 0.6]), majority_over=False,
                       lo=np.array([50, 120, 60, 100]), hi=np.array([200, 300, 90, 400]))
    assert m.direction_auc == pytest.approx(1.0)  # both over-predicted score above the rest
    assert m.direction_majority_acc == pytest.approx(2 / 4)  # "never over": right on 2 of 4
    assert m.range_coverage == pytest.approx(2 / 4)  # 100 in [50, 200]; 200 in [100, 400]
    assert m.range_width == pytest.approx((150 + 180 + 30 + 300) / 4)


def test_roc_auc_counts_ties_half() -> None:
    assert roc_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    assert roc_auc(np.array([0.5, 0.5, 0.5]), np.array([1, 0, 1])) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        roc_auc(np.array([0.1, 0.2]), np.array([1, 1]))


def test_length_metrics_without_errors_on_one_side() -> None:
    m = length_metrics(np.array([10, 20]), np.array([5, 20]))
    assert (m.under_rate, m.mean_under, m.direction_acc) == (0.0, 0.0, None)
    with pytest.raises(ValueError):
        length_metrics(np.array([1, 2]), np.array([1]))


# --------------------------------------------------------------------------- heads


@pytest.mark.parametrize("kind", KINDS)
def test_heads_predict_lengths_in_range(kind: str) -> None:
    cfg = HeadConfig(feature_dim=FEATURES, hidden=8, max_length=300)
    head = make_head(kind, cfg)
    out = predict_features(head, np.random.default_rng(0).normal(size=(7, FEATURES)) * 50)
    lengths = np.asarray(out.lengths)
    assert lengths.shape == (7,)
    assert (lengths >= 1).all() and (lengths <= 300).all() and (lengths == np.round(lengths)).all()
    assert (out.over_prob is None) == (kind != "cacheopt")
    assert (out.lo is None) == (out.hi is None) == (kind != "cacheopt")
    if kind == "cacheopt":
        assert np.asarray(out.over_prob).shape == (7,)
        assert (np.asarray(out.lo) <= lengths).all() and (lengths <= np.asarray(out.hi)).all()
        quantiles, logit = head(np.zeros((3, FEATURES), np.float32))
        assert quantiles.shape == (3, 3) and logit.shape == (3,)
    if kind == "s3":
        assert head.classifier(np.zeros((3, FEATURES), np.float32)).shape == (3, cfg.num_buckets)
        assert set(lengths % 50) <= {0}  # upper bucket edges (300 is one)


def test_bucket_edges() -> None:
    np.testing.assert_array_equal(bucket_of(np.array([1, 50, 51, 100, 101]), 50), [0, 0, 1, 1, 2])
    assert HeadConfig(feature_dim=1, max_length=2048).num_buckets == 41


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown predictor kind"):
        make_head("oracle", HeadConfig(feature_dim=1))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- training


def test_optax_steps_reduce_the_loss(tmp_path: Path) -> None:
    x, lengths = _synthetic(256)
    head = make_head("rlp", HeadConfig(feature_dim=FEATURES, hidden=16))
    batch = {"x": x, "log_len": np.log(lengths).astype(np.float32)}
    head.length.fit_data(x, batch["log_len"])
    before = float(length_loss(head.length, batch))
    fit(head.length, length_loss, batch, TrainConfig(epochs=5, batch_size=32, lr=3e-3),
        tmp_path / "ckpt", "test", progress=False)
    assert float(length_loss(head.length, batch)) < 0.5 * before


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_learns_synthetic_lengths(tmp_path: Path, kind: str) -> None:
    x, lengths = _synthetic(512)
    head = make_head(kind, HeadConfig(feature_dim=FEATURES, hidden=64))
    train_head(head, x, lengths, TrainConfig(epochs=6, lr=1e-2, direction_folds=2), tmp_path,
               progress=False)
    x_test, y_test = _synthetic(256, seed=1)
    pred = np.asarray(predict_features(head, x_test).lengths)
    if kind == "rlp":
        pred = pred - head.cfg.rlp_padding
    # S3's bucket edges alone cost it 0.3 of this constant guess's error here.
    baseline = length_metrics(np.full_like(y_test, np.median(lengths)), y_test).mae
    assert length_metrics(pred, y_test).mae < 0.7 * baseline


def test_cacheopt_range_covers_held_out_lengths(tmp_path: Path) -> None:
    """The 5%-95% quantile outputs, widened on out-of-fold predictions, bracket about 90%
    of unseen lengths."""
    x, lengths = _synthetic(1024)
    head = make_head("cacheopt", HeadConfig(feature_dim=FEATURES, hidden=32))
    train_head(head, x, lengths, TrainConfig(epochs=8, lr=1e-2, direction_folds=2), tmp_path,
               progress=False)
    x_test, y_test = _synthetic(512, seed=1)
    out = predict_features(head, x_test)
    m = length_metrics(np.asarray(out.lengths), y_test, lo=np.asarray(out.lo), hi=np.asarray(out.hi))
    assert 0.8 <= m.range_coverage <= 0.97


def test_direction_labels_come_from_layers_that_never_saw_the_prompt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x, lengths = _synthetic(50)
    x[:, 0] = np.arange(50)  # a row id, to see which prompts each fold trained on
    trained_on: list[set[int]] = []
    predicted_on: list[set[int]] = []
    monkeypatch.setattr(train_module, "train_length",
                        lambda reg, xs, *a, **k: trained_on.append(set(xs[:, 0].astype(int))))
    monkeypatch.setattr(train_module, "directions",
                        lambda reg, xs, ys, m: predicted_on.append(set(xs[:, 0].astype(int)))
                        or Directions(np.tile(xs[:, :1], (1, 3)), np.zeros(len(xs), np.float32)))
    out = out_of_fold_directions(HeadConfig(feature_dim=FEATURES), (0.05, 0.5, 0.95), x, lengths,
                                 TrainConfig(direction_folds=5), tmp_path, progress=False)
    np.testing.assert_array_equal(out.log_quantiles[:, 1], np.arange(50))  # back in row order
    assert len(trained_on) == len(predicted_on) == 5
    assert set().union(*predicted_on) == set(range(50))
    for seen, labelled in zip(trained_on, predicted_on):
        assert not seen & labelled and seen | labelled == set(range(50))


@pytest.mark.parametrize("features", [False, True])
def test_direction_classifier_reads_features_only_when_configured(features: bool) -> None:
    head = make_head("cacheopt", HeadConfig(feature_dim=FEATURES, hidden=8, direction_features=features))
    assert head.direction.hidden.in_features == 3 + (FEATURES if features else 0)
    assert np.asarray(predict_features(head, np.ones((2, FEATURES), np.float32)).over_prob).shape == (2,)


def test_fit_keeps_the_epoch_with_the_lowest_validation_loss(tmp_path: Path) -> None:
    """Lengths unrelated to the features: later epochs only fit noise, so the module ends
    with the best validation epoch's parameters, not the last epoch's (which the resume
    checkpoint holds)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, FEATURES)).astype(np.float32)
    batch = {"x": x, "log_len": rng.normal(5, 1, 120).astype(np.float32)}
    cfg = TrainConfig(epochs=10, batch_size=16, lr=1e-2, val_fraction=0.25)
    head = make_head("rlp", HeadConfig(feature_dim=FEATURES, hidden=64))
    head.length.fit_data(x, batch["log_len"])
    fit(head.length, length_loss, batch, cfg, tmp_path / "ckpt", "test", progress=False)
    _, val_rows = split_validation(120, cfg)
    val = {k: v[val_rows] for k, v in batch.items()}
    saved = ocp.CheckpointManager(tmp_path / "ckpt").restore(cfg.epochs)
    last = make_head("rlp", HeadConfig(feature_dim=FEATURES, hidden=64))
    state = nnx.state(last.length)
    nnx.replace_by_pure_dict(state, saved["model"])
    nnx.update(last.length, state)
    kept = float(length_loss(head.length, val))
    assert kept == pytest.approx(float(saved["best_loss"]), rel=1e-5)
    assert kept < float(length_loss(last.length, val))


def test_resume_continues_exactly(tmp_path: Path) -> None:
    x, lengths = _synthetic(200)
    batch = {"x": x, "log_len": np.log(lengths).astype(np.float32)}
    cfg = HeadConfig(feature_dim=FEATURES, hidden=8)

    def run(epochs: int, ckpt: Path) -> nnx.Module:
        head = make_head("rlp", cfg)
        head.length.fit_data(x, batch["log_len"])
        fit(head.length, length_loss, batch, TrainConfig(epochs=epochs, batch_size=48), ckpt,
            "test", progress=False)
        return head

    straight = run(3, tmp_path / "straight")
    run(1, tmp_path / "interrupted")  # "killed" after one epoch
    resumed = run(3, tmp_path / "interrupted")  # fresh init, restored from epoch 1
    for a, b in zip(_params(straight), _params(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


def test_head_checkpoint_round_trip(tmp_path: Path) -> None:
    cfg = HeadConfig(feature_dim=FEATURES, hidden=8)
    head = make_head("cacheopt", cfg, seed=3)
    head.length.norm.fit(_synthetic(50)[0])
    spec = PredictorSpec(EncoderConfig(), cfg, ("cacheopt",))
    spec.write(tmp_path)
    save_head(tmp_path, "cacheopt", head)
    loaded = load_head(tmp_path, PredictorSpec.read(tmp_path), "cacheopt")
    for a, b in zip(_params(head), _params(loaded), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="no 's3' predictor"):
        load_head(tmp_path, spec, "s3")


def test_finetune_base_is_not_an_option(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train-predictor", "--finetune-base", "--output", str(tmp_path)])
    assert exc.value.code == 2


# --------------------------------------------------------------------------- data and encoder


def test_truncate_prompt_keeps_head_and_tail() -> None:
    assert truncate_prompt(range(5), 8) == [0, 1, 2, 3, 4]
    assert truncate_prompt(range(20), 7) == [0, 1, 2, 16, 17, 18, 19]


def test_packed_encoding_matches_one_at_a_time(tiny_loaded: LoadedModel) -> None:
    encoder = PromptEncoder(tiny_loaded, EncoderConfig("tiny-llama", max_prompt_len=16),
                            max_batch_tokens=32, max_batch_seqs=4)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 200, n).tolist() for n in (3, 16, 40, 1, 12, 9)]
    packed = encoder.encode(prompts)
    alone = np.stack([encoder.encode([p])[0] for p in prompts])
    assert packed.shape == (6, 2 * tiny_loaded.config.hidden_size)
    np.testing.assert_allclose(packed, alone, rtol=1e-4, atol=1e-4)
    # The mean half is the mean over the prompt, not the last token again.
    assert not np.allclose(packed[1, :tiny_loaded.config.hidden_size],
                           packed[1, tiny_loaded.config.hidden_size:])


def test_dataset_split_is_deterministic_and_deduplicated(smollm2_loaded: LoadedModel) -> None:
    """(Takes the loaded model's tokenizer: the shipped-default test loads that model anyway.)"""
    tok = smollm2_loaded.tokenizer
    texts = [f"question number {i} about rivers and lakes" for i in range(25)]
    texts[7] = texts[3]  # a repeated prompt
    convs = [Conversation(str(i), (Turn("user", t), Turn("assistant", "an answer " * (i + 2))))
             for i, t in enumerate(texts)]
    ds = build_dataset(tok, 20, 5, seed=1, conversations=convs)  # samples all 25
    again = build_dataset(tok, 20, 5, seed=1, conversations=convs)
    assert ds == again and len(ds.test) == 5 and len(ds.train) == 19
    prompts = [ex.prompt_ids for ex in ds.train + ds.test]
    assert len(set(prompts)) == len(prompts)
    ex = ds.test[0]
    conv = convs[int(ex.conversation_id)]
    assert list(ex.prompt_ids) == chat_prompt_ids(tok, conv.turns[0].text)
    assert ex.output_len == len(tok.encode(conv.turns[1].text))
    # The held-out examples do not depend on the size of the training set.
    assert build_dataset(tok, 12, 5, seed=1, conversations=convs).test == ds.test


def test_features_are_cached_on_disk(tmp_path: Path) -> None:
    class CountingEncoder:
        config = EncoderConfig()
        calls = 0

        def encode(self, prompts: list, progress: bool = False) -> np.ndarray:
            self.calls += 1
            return np.arange(len(prompts), dtype=np.float32)[:, None]

    enc = CountingEncoder()
    examples = [LengthExample("a", (1, 2, 3), 10), LengthExample("b", (4,), 5)]
    first = cached_features(enc, examples, tmp_path)  # type: ignore[arg-type]
    second = cached_features(enc, examples, tmp_path)  # type: ignore[arg-type]
    np.testing.assert_array_equal(first, second)
    assert enc.calls == 1
    cached_features(enc, examples[:1], tmp_path)  # type: ignore[arg-type]
    assert enc.calls == 1  # features are stored per prompt: a subset is never encoded again


# --------------------------------------------------------------------------- the shipped default


def test_shipped_default_predicts_positive_lengths(smollm2_loaded: LoadedModel) -> None:
    tok = smollm2_loaded.tokenizer
    prompts = [chat_prompt_ids(tok, t) for t in (
        "Hi!", "Write a detailed essay on the causes of the First World War.",
        "What is 2 + 2? Answer with one number.")]
    prompts[2] = np.asarray(prompts[2])  # the engine may hold token ids as an array
    spec = PredictorSpec.read(DEFAULT_DIR)
    for kind in KINDS:
        predictor = LengthPredictor.load(kind, base=smollm2_loaded)
        predictions = predictor.predict_batch(prompts)
        assert len(predictions) == 3
        for p in predictions:
            assert 1 <= p.length <= spec.head.max_length
            assert (p.over_prob is not None) == (kind == "cacheopt")
            if kind == "cacheopt":
                assert 1 <= p.lo <= p.length <= p.hi <= spec.head.max_length
    metrics = (DEFAULT_DIR / "metrics.json").read_text()
    assert all(kind in metrics for kind in KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_shipped_noise_models_load(kind: str) -> None:
    model = load_noise_model(kind)
    draws = model.sample([5, 100, 1000], np.random.default_rng(0))
    assert all(1 <= p.length <= model.max_length for p in draws)
    assert all((p.over_prob is not None) == (p.lo is not None) == (kind == "cacheopt")
               for p in draws)


# --------------------------------------------------------------------------- noise model


def test_noise_model_reproduces_stored_quantiles() -> None:
    rng = np.random.default_rng(0)
    true = rng.integers(500, 4000, 2000)
    pred = np.round(true * np.exp(rng.normal(-0.1, 0.4, true.size) - 0.0001 * true))
    over_prob = np.where(pred > true, rng.uniform(0.4, 1.0, true.size), rng.uniform(0, 0.7, true.size))
    model = NoiseModel.fit("cacheopt", true, pred, max_length=100_000, bucket_width=50,
                           over_prob=over_prob)
    model = NoiseModel.from_json(model.to_json())  # what the simulator reads back
    assert len(model.error_quantiles) == 4
    for b, length in enumerate((600, 1500, 2500, 3800)):
        assert (np.searchsorted(model.bin_edges, length) == b)
        draws = model.sample(np.full(100_000, length), rng)
        errors = np.log([d.length / length for d in draws])
        np.testing.assert_allclose(np.quantile(errors, QUANTILE_LEVELS[1:-1]),
                                   model.error_quantiles[b][1:-1], atol=0.03)
        assert model.error_quantiles[b][0] - 1e-3 <= errors.min()
        assert errors.max() <= model.error_quantiles[b][-1] + 1e-3
        probs = np.array([d.over_prob for d in draws])
        over = np.array([d.length > length for d in draws])
        np.testing.assert_allclose(np.quantile(probs[over], [0.25, 0.5, 0.75]),
                                   np.interp([0.25, 0.5, 0.75], QUANTILE_LEVELS,
                                             model.over_prob_quantiles["over"]), atol=0.02)


def test_noise_model_draws_ranges_with_the_held_out_coverage() -> None:
    """Ranges drawn around drawn lengths hold the true length about as often as the real
    predictor's held-out ranges did, and always bracket the drawn length."""
    rng = np.random.default_rng(0)
    true = rng.integers(20, 1500, 4000)
    pred = np.round(true * np.exp(rng.normal(0, 0.6, true.size))).clip(1)
    width = np.exp(rng.normal(0.9, 0.2, true.size))  # log half-widths around 0.9
    lo, hi = np.round(pred / width).clip(1), np.round(pred * width)
    held_out = np.mean((lo <= true) & (true <= hi))
    model = NoiseModel.fit("cacheopt", true, pred, max_length=100_000, bucket_width=50,
                           over_prob=rng.random(true.size), lo=lo, hi=hi)
    model = NoiseModel.from_json(model.to_json())
    draws = model.sample(true, rng)
    assert all(1 <= d.lo <= d.length <= d.hi for d in draws)
    drawn = np.mean([d.lo <= t <= d.hi for d, t in zip(draws, true)])
    assert abs(drawn - held_out) < 0.05


def test_bucket_noise_model_draws_bucket_edges() -> None:
    rng = np.random.default_rng(0)
    true = rng.integers(1, 1000, 500)
    pred = np.minimum((bucket_of(true, 50) + rng.integers(-1, 3, true.size)).clip(0) * 50 + 50, 2048)
    model = NoiseModel.fit("s3", true, pred, max_length=2048, bucket_width=50)
    draws = np.array([p.length for p in model.sample(np.full(5000, 420), rng)])
    assert set(np.unique(draws)) <= {350, 400, 450, 500, 550}
    assert {400, 450, 500} <= set(np.unique(draws))


def test_llm_uses_the_shipped_predictor_only_for_its_base_model(tiny_loaded, smollm2_loaded) -> None:
    """`predictor="auto"`: SmolLM2 serving a prediction-based policy gets the shipped
    predictor of that policy's kind; a model whose tokens it cannot read gets none."""
    from jserve import LLM

    assert LLM(tiny_loaded, policy="cacheopt", num_blocks=16, warmup=False).predictor is None
    assert LLM(smollm2_loaded, policy="vllm", num_blocks=16, warmup=False).predictor is None
    llm = LLM(smollm2_loaded, policy="s3", num_blocks=16, warmup=False)
    assert llm.predictor is not None and llm.predictor.kind == "s3"
