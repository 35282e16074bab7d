"""A trained predictor directory everywhere predictors are chosen (`--predictor DIR`: the real
engine reads its heads, the simulator its noise model), training that scales (fewer encoder
layers, features stored per prompt and resumed, `--resume` extending a run)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jserve.benchmarking.bench import make_trace, trace_predictions
from jserve.cli import main
from jserve.config import EngineConfig
from jserve.models.loading import LoadedModel
from jserve.predictor import DEFAULT_DIR
from jserve.predictor import feature_store
from jserve.predictor.checkpoint import PredictorSpec
from jserve.predictor.encoder import EncoderConfig, PromptEncoder
from jserve.predictor.feature_store import FeatureStore
from jserve.predictor.train import (
    TrainConfig, TrainOptions, _check_resume, out_of_fold_directions, split_validation,
)
from jserve.sim import SimConfig


@pytest.fixture
def trained_dir(tmp_path: Path) -> Path:
    """A copy of the shipped predictor whose CacheOpt noise model makes no error at all and
    whose encoder reads 64 prompt tokens: what a run of one's own looks like to a loader."""
    out = tmp_path / "mine"
    shutil.copytree(DEFAULT_DIR, out)
    noise = json.loads((out / "noise.json").read_text())
    cacheopt = noise["cacheopt"]
    cacheopt["error_quantiles"] = [[0.0] * len(q) for q in cacheopt["error_quantiles"]]
    (out / "noise.json").write_text(json.dumps(noise))
    config = json.loads((out / "config.json").read_text())
    config["encoder"]["max_prompt_len"] = 64
    (out / "config.json").write_text(json.dumps(config))
    return out


# --------------------------------------------------------------------------- plugging a run in


def test_the_simulator_draws_from_the_directory_s_own_noise_model(trained_dir: Path) -> None:
    for config in (SimConfig(policy="cacheopt", predictor=str(trained_dir), num_requests=50).bench_config(),
                   SimConfig(policy="cacheopt", num_requests=50).bench_config()):
        trace = make_trace(config)
        drawn = trace_predictions(config, trace)
        exact = [drawn[r.request_id][0] == r.output_len for r in trace.requests]
        assert all(exact) == (config.engine.predictor_dir == trained_dir)


def test_bench_and_sweep_take_predictor(trained_dir: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--policy", "cacheopt", "--num-requests", "10", "--rate", "4"]
    assert main(["bench", *common, "--predictor", str(trained_dir),
                 "--output", str(tmp_path / "b.json")]) == 0
    record = json.loads((tmp_path / "b.json").read_text())
    assert record["config"]["engine"]["predictor"] == str(trained_dir)
    assert main(["sweep", "--policies", "vllm,cacheopt", "--rates", "4", "--num-requests", "10",
                 "--workers", "1", "--predictor", str(trained_dir),
                 "--output", str(tmp_path / "s.json")]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("command", [["bench"], ["sweep", "--rates", "1"], ["serve"]])
def test_a_bad_predictor_directory_is_a_clear_error(tmp_path: Path, command: list[str],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    policy = ["--policies", "cacheopt"] if command[0] == "sweep" else ["--policy", "cacheopt"]
    assert main([*command, *policy, "--predictor", str(tmp_path / "missing")]) == 2
    assert "is not a directory `jserve train-predictor` wrote" in capsys.readouterr().err


def test_a_directory_without_the_policy_s_kind_is_refused(tmp_path: Path) -> None:
    shutil.copytree(DEFAULT_DIR, tmp_path / "s3-only")
    config = json.loads((tmp_path / "s3-only" / "config.json").read_text())
    config["kinds"] = ["s3"]
    (tmp_path / "s3-only" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="holds no 'cacheopt' predictor"):
        EngineConfig(policy="cacheopt", runner="sim", predictor=tmp_path / "s3-only")
    assert EngineConfig(policy="s3", runner="sim", predictor=tmp_path / "s3-only").predictor_dir


def test_llm_serves_with_the_directory_s_heads(trained_dir: Path, tiny_loaded: LoadedModel,
                                               smollm2_loaded: LoadedModel) -> None:
    from jserve import LLM

    llm = LLM(smollm2_loaded, policy="cacheopt", predictor=trained_dir, num_blocks=16, warmup=False)
    assert llm.predictor.kind == "cacheopt" and llm.predictor.encoder.config.max_prompt_len == 64
    with pytest.raises(ValueError, match="reads smollm2-135m's tokens; this engine serves tiny-llama"):
        LLM(tiny_loaded, policy="cacheopt", predictor=trained_dir, num_blocks=16, warmup=False)


# --------------------------------------------------------------------------- encoding at scale


def test_fewer_encoder_layers_are_the_base_cut_short(tiny_loaded: LoadedModel) -> None:
    prompts = [[5, 6, 7], list(range(1, 30))]

    def encode(layers: int | None) -> np.ndarray:
        config = EncoderConfig("tiny-llama", max_prompt_len=16, num_layers=layers)
        return PromptEncoder(tiny_loaded, config).encode(prompts)

    np.testing.assert_array_equal(encode(None), encode(2))
    assert not np.allclose(encode(None), encode(1))
    with pytest.raises(ValueError, match="has 2 layers"):
        encode(3)


class CountingEncoder:
    """Features a prompt's length, counting prompts encoded; fails after `fail_after` calls."""

    def __init__(self, layers: int | None = None, fail_after: int | None = None) -> None:
        self.config = EncoderConfig(num_layers=layers)
        self.encoded: list[int] = []
        self.fail_after = fail_after

    def encode(self, prompts: list, progress: bool = False) -> np.ndarray:
        if self.fail_after is not None and len(self.encoded) >= self.fail_after:
            raise KeyboardInterrupt
        self.encoded.append(len(prompts))
        return np.array([[len(p)] for p in prompts], np.float32)


def test_an_interrupted_encode_pass_resumes_where_it_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(feature_store, "CHUNK", 4)
    prompts = [tuple(range(1, n + 2)) for n in range(10)]
    killed = CountingEncoder(fail_after=2)
    with pytest.raises(KeyboardInterrupt):
        FeatureStore.of(killed.config, tmp_path).features(killed, prompts)
    again = CountingEncoder()
    out = FeatureStore.of(again.config, tmp_path).features(again, prompts)
    assert again.encoded == [2]  # the two stored chunks are not encoded again
    np.testing.assert_array_equal(out[:, 0], [len(p) for p in prompts])


def test_stored_features_serve_other_datasets_not_other_encoders(tmp_path: Path) -> None:
    prompts = [(1, 2, 3), (4,), (5, 6)]
    first = CountingEncoder()
    FeatureStore.of(first.config, tmp_path).features(first, prompts[:2])
    FeatureStore.of(first.config, tmp_path).features(first, [prompts[1], *prompts, prompts[0]])
    assert first.encoded == [2, 1]  # a grown dataset encodes only its new prompt
    other = CountingEncoder(layers=4)
    FeatureStore.of(other.config, tmp_path).features(other, prompts)
    assert other.encoded == [3]


# --------------------------------------------------------------------------- extending a run


def test_splits_keep_their_examples_when_data_grows() -> None:
    cfg = TrainConfig()
    small, grown = split_validation(300, cfg), split_validation(500, cfg)
    assert set(small[1]) == set(grown[1]) & set(range(300))
    assert 20 <= len(small[1]) <= 40


def test_direction_folds_keep_their_examples_when_data_grows(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from jserve.predictor import train as train_module
    from jserve.predictor.heads import HeadConfig
    from jserve.predictor.train import Directions

    def held_out(n: int) -> list[set[int]]:
        held: list[set[int]] = []
        monkeypatch.setattr(train_module, "train_length", lambda *a, **k: None)
        monkeypatch.setattr(train_module, "directions",
                            lambda reg, xs, ys, m: held.append(set(xs[:, 0].astype(int)))
                            or Directions(np.zeros((len(xs), 3)), np.zeros(len(xs), np.float32)))
        x = np.arange(n, dtype=np.float32)[:, None].repeat(4, 1)
        out_of_fold_directions(HeadConfig(feature_dim=4), (0.05, 0.5, 0.95), x, np.ones(n),
                               TrainConfig(), tmp_path, progress=False)
        return held

    for small, grown in zip(held_out(100), held_out(180), strict=True):
        assert small == grown & set(range(100))


def _spec(**training: int) -> PredictorSpec:
    return PredictorSpec(EncoderConfig(), PredictorSpec.read(DEFAULT_DIR).head, ("cacheopt",),
                         {"epochs": 20, "lr": 1e-3, "num_train": 3000, "num_test": 1000, **training})


@pytest.mark.parametrize(("training", "refusal"), [
    ({"epochs": 30}, None),
    ({"epochs": 30, "num_train": 9000}, None),
    ({"num_train": 9000}, "pass more --epochs too"),
    ({"epochs": 10}, "epochs 10 is below the run's 20"),
    ({"lr": 1e-2}, "lr differ"),
    ({"num_test": 500}, "num_test differ"),
])
def test_resume_extends_a_run_with_more_epochs_or_data(tmp_path: Path, training: dict,
                                                       refusal: str | None) -> None:
    _spec().write(tmp_path)
    options = TrainOptions(output=tmp_path, resume=True)
    if refusal is None:
        _check_resume(options, _spec(**training))
    else:
        with pytest.raises(ValueError, match=refusal):
            _check_resume(options, _spec(**training))
