"""Why CacheOpt's direction classifier was at chance, and what it reaches now (held-out).

On real ShareGPT prompts (the `jserve train-predictor` split: seed 0, the first
`--num-test` prompts of the seeded shuffle held out, the next `--num-train` for training;
features of the frozen SmolLM2-135M base, cached), this trains CacheOpt's head twice per
seed and variant, from the same step-1 length layer, the variants differing in where
step 2's direction labels (and the length outputs the classifier reads with them) come
from and in what the classifier reads:

- `in_sample`: the step-1 length layer's directions and outputs on its own training
  prompts (the first version's labels);
- `out_of_fold`: each prompt's direction and outputs under a step-1 layer trained on the
  other folds (what `train.py` does now);
- `+features`: the classifier also reads the base's 1,152 pooled features, as the paper
  has it (`HeadConfig.direction_features`); without: the length outputs alone (default),

and prints, beside each other: the labels' class balance and agreement, the length
layer's in-sample vs held-out MAE (how much it memorises), the classifier's accuracy on
its own training labels vs held-out accuracy and ROC AUC, the trivial baselines (always
the training labels' majority direction: accuracy; AUC 0.5; the training median as the
length: MAE), and the predicted range's coverage and width. Last, the shipped default's
held-out figures (`jserve/predictor/default/metrics.json`) beside draws of its noise model
(`--predictions noise` in the simulator) for the same held-out true lengths, to show that
the simulator sees the same error, direction and range behaviour. Writes `bench/results/predictor_accuracy.json`
and `.md`.

    PYTHONPATH=$PWD python bench/predictor_accuracy.py [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jserve.predictor import DEFAULT_DIR, load_noise_model
from jserve.benchmarking.tables import markdown_table
from jserve.predictor.data import build_dataset, cached_features
from jserve.predictor.encoder import EncoderConfig, PromptEncoder
from jserve.predictor.heads import HeadConfig, make_head, predict_features
from jserve.predictor.metrics import length_metrics, roc_auc
from jserve.predictor.train import (
    TrainConfig, directions, out_of_fold_directions, train_direction, train_length,
)
from jserve.models.loading import load_model

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("in_sample", "in_sample+features", "out_of_fold", "out_of_fold+features")


def run_seed(seed: int, x_tr: np.ndarray, y_tr: np.ndarray, x_te: np.ndarray, y_te: np.ndarray,
             head_cfg: HeadConfig, work: Path) -> dict[str, dict[str, float]]:
    cfg = TrainConfig(seed=seed)
    out: dict[str, dict[str, float]] = {}
    step1 = make_head("cacheopt", head_cfg, seed=seed)  # its direction classifier is unused
    train_length(step1.length, x_tr, y_tr, cfg, work / f"s{seed}" / "length", "step 1", False)
    collected = {
        "in_sample": directions(step1.length, x_tr, y_tr, head_cfg.max_length),
        "out_of_fold": out_of_fold_directions(head_cfg, step1.length.levels, x_tr, y_tr, cfg,
                                              work / f"s{seed}", progress=False),
    }
    step1_tr_pred = np.asarray(predict_features(step1, x_tr).lengths)
    step1_te = jax.tree.map(np.asarray, predict_features(step1, x_te))
    for (name, data), features in itertools.product(collected.items(), (False, True)):
        variant = f"{name}{'+features' if features else ''}"
        head = make_head("cacheopt", dataclasses.replace(head_cfg, direction_features=features),
                         seed=seed)
        head.length = step1.length  # step 2 starts from the same step-1 layer and keeps it
        head.calibrate_range(collected["out_of_fold"].log_quantiles, y_tr)
        train_direction(head, x_tr, data, cfg, work / f"s{seed}" / variant, False)
        logit = head.direction(head.length.norm(jax.numpy.asarray(x_tr)), data.log_quantiles)
        te = jax.tree.map(np.asarray, predict_features(head, x_te))
        held = length_metrics(te.lengths, y_te, over_prob=te.over_prob, lo=te.lo, hi=te.hi,
                              majority_over=bool(data.over.mean() > 0.5))
        out[variant] = {
            "label_over_rate": float(data.over.mean()),
            # on the very inputs and labels it was trained with
            "classifier_train_acc": float(np.mean((np.asarray(logit) > 0) == data.over.astype(bool))),
            "held_out_acc": held.direction_acc,
            "held_out_auc": held.direction_auc,
            "majority_acc": held.direction_majority_acc,
            "held_out_over_rate": held.over_rate,
            "final_mae": held.mae,
            "range_coverage": held.range_coverage,
            "range_width": held.range_width,
        }
    out["labels"] = {  # step1's range_margin is 0: the range before widening
        "range_coverage_before_widening": float(np.mean((step1_te.lo <= y_te) & (y_te <= step1_te.hi))),
        "range_width_before_widening": float(np.mean(step1_te.hi - step1_te.lo)),
        "agreement_in_sample_vs_out_of_fold": float(np.mean(
            collected["in_sample"].over == collected["out_of_fold"].over)),
        "step1_mae_train": float(np.mean(np.abs(step1_tr_pred - y_tr))),
        "step1_mae_held_out": float(np.mean(np.abs(step1_te.lengths - y_te))),
        # Does the direction depend on the predicted length itself (predictions too extreme,
        # or shrunk towards the typical length)? AUC of the step-1 length as a score for
        # "over", held out.
        "held_out_auc_of_predicted_length": roc_auc(step1_te.lengths, step1_te.lengths > y_te),
        "median_baseline_mae": float(np.mean(np.abs(np.median(y_tr) - y_te))),
    }
    return out


def noise_consistency(y_te: np.ndarray) -> dict[str, dict[str, float]]:
    """The shipped CacheOpt head's held-out metrics beside its noise model's draws."""
    shipped = json.loads((DEFAULT_DIR / "metrics.json").read_text())["held_out"]["cacheopt"]
    draws = load_noise_model("cacheopt").sample(y_te, np.random.default_rng(0))
    drawn = length_metrics(np.array([d.length for d in draws]), y_te,
                           over_prob=np.array([d.over_prob for d in draws]),
                           lo=np.array([d.lo for d in draws]), hi=np.array([d.hi for d in draws]))
    keys = ("mae", "over_rate", "direction_acc", "direction_auc", "range_coverage", "range_width")
    return {"shipped_head": {k: shipped[k] for k in keys},
            "noise_model_draws": {k: getattr(drawn, k) for k in keys}}


def _mean_sd(values: list[float]) -> str:
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def markdown(per_seed: dict[int, dict], noise: dict[str, dict[str, float]], meta: dict) -> str:
    rows = [
        ("direction labels: fraction 'over'", "label_over_rate"),
        ("classifier accuracy on its own training labels", "classifier_train_acc"),
        ("held-out direction accuracy", "held_out_acc"),
        ("held-out accuracy of always the labels' majority", "majority_acc"),
        ("held-out direction ROC AUC (trivial: 0.5)", "held_out_auc"),
        ("held-out fraction over-predicted", "held_out_over_rate"),
    ]
    seeds = sorted(per_seed)
    lines = [
        "# CacheOpt output-length predictor on held-out ShareGPT prompts",
        "",
        f"{meta['num_train']} training / {meta['num_test']} held-out prompts (seed-0 split), "
        f"frozen {meta['base_model']} features, head seeds {seeds} (mean ± sd over seeds). "
        f"Command: `{meta['command']}`.",
        "",
        "Direction classifier (step 2) by where its labels and inputs come from; "
        "`+features`: it also reads the base's features, as the paper has it. "
        "Shipped: out_of_fold.",
        "",
    ]
    lines += markdown_table(["quantity", *VARIANTS],
                            ([label, *(_mean_sd([per_seed[s][v][key] for s in seeds]) for v in VARIANTS)]
                             for label, key in rows))
    lines += [""] + markdown_table(
        ["length layer (held out)", "value"],
        ([label, _mean_sd([per_seed[s]["out_of_fold"][key] for s in seeds])]
         for label, key in (("MAE (tokens)", "final_mae"),
                            ("coverage of [lo, hi], widened on out-of-fold (target 0.90)", "range_coverage"),
                            ("mean width hi - lo (tokens)", "range_width"))))
    lines += [""] + markdown_table(["diagnostics (step-1 length layer)", "value"],
                                   ([key, _mean_sd([per_seed[s]["labels"][key] for s in seeds])]
                                    for key in per_seed[seeds[0]]["labels"]))
    shipped, drawn = noise["shipped_head"], noise["noise_model_draws"]
    lines += [""] + markdown_table(["shipped cacheopt head, held out", "real head", "noise model draws"],
                                   ([k, f"{shipped[k]:.3f}", f"{drawn[k]:.3f}"] for k in shipped))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-train", type=int, default=3000)
    parser.add_argument("--num-test", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    t0 = time.perf_counter()
    encoder_cfg = EncoderConfig()
    base = load_model(encoder_cfg.base_model)
    data = build_dataset(base.tokenizer, args.num_train, args.num_test, seed=0)
    encoder = PromptEncoder(base, encoder_cfg)
    x_tr = cached_features(encoder, data.train, progress=True)
    x_te = cached_features(encoder, data.test, progress=True)
    y_tr = np.array([ex.output_len for ex in data.train])
    y_te = np.array([ex.output_len for ex in data.test])
    head_cfg = HeadConfig(feature_dim=encoder.feature_dim)
    with tempfile.TemporaryDirectory() as work:
        per_seed = {s: run_seed(s, x_tr, y_tr, x_te, y_te, head_cfg, Path(work)) for s in args.seeds}
    meta = {
        "command": "PYTHONPATH=$PWD python bench/predictor_accuracy.py " + " ".join(
            [f"--num-train {args.num_train}", f"--num-test {args.num_test}",
             "--seeds", *map(str, args.seeds)]),
        "base_model": encoder_cfg.base_model, "num_train": len(data.train),
        "num_test": len(data.test), "machine": f"{platform.machine()}, CPU",
        "wall_seconds": round(time.perf_counter() - t0, 1),
    }
    noise = noise_consistency(y_te)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "predictor_accuracy.json").write_text(
        json.dumps({**meta, "per_seed": per_seed, "noise_consistency": noise}, indent=1) + "\n")
    table = markdown(per_seed, noise, meta)
    (RESULTS / "predictor_accuracy.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
