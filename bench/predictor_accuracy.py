"""Why CacheOpt's direction classifier was at chance, and what it reaches now (held-out).

On real ShareGPT prompts (the `jserve train-predictor` split: seed 0, the first
`--num-test` prompts of the seeded shuffle held out, the next `--num-train` for training;
features of the frozen SmolLM2-135M base, cached), this trains CacheOpt's head twice per
seed, differing only in where step 2's direction labels come from:

- `in_sample`: the step-1 length layer's direction on its own training prompts (the first
  version);
- `out_of_fold`: each prompt's direction under a step-1 layer trained on the other folds
  (what `train.py` does now),

and prints, beside each other: the labels' class balance and agreement, the length
layer's in-sample vs held-out MAE (how much it memorises), the classifier's accuracy on
its own training labels vs held-out accuracy and ROC AUC, the trivial baselines (always
the training labels' majority direction: accuracy; AUC 0.5; the training median as the
length: MAE), how many held-out directions step 2 flips by moving the length layer, and
the predicted range's coverage and width. Writes `bench/results/predictor_accuracy.json`
and `.md`.

    PYTHONPATH=$PWD python bench/predictor_accuracy.py [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jserve.predictor.data import build_dataset, cached_features
from jserve.predictor.encoder import EncoderConfig, PromptEncoder
from jserve.predictor.heads import HeadConfig, make_head, predict_features
from jserve.predictor.metrics import length_metrics, roc_auc
from jserve.predictor.train import (
    TrainConfig, out_of_fold_directions, over_predicted, train_direction, train_length,
)
from models.loading import load_model

RESULTS = Path(__file__).resolve().parent / "results"


def run_seed(seed: int, x_tr: np.ndarray, y_tr: np.ndarray, x_te: np.ndarray, y_te: np.ndarray,
             head_cfg: HeadConfig, work: Path) -> dict[str, dict[str, float]]:
    cfg = TrainConfig(seed=seed)
    out: dict[str, dict[str, float]] = {}
    step1 = make_head("cacheopt", head_cfg, seed=seed)
    train_length(step1.length, x_tr, y_tr, cfg, work / f"s{seed}" / "length", "step 1", False)
    step1_state = nnx.to_pure_dict(nnx.state(step1))
    labels = {
        "in_sample": over_predicted(step1.length, x_tr, y_tr, head_cfg.max_length),
        "out_of_fold": out_of_fold_directions(head_cfg, step1.length.levels, x_tr, y_tr, cfg,
                                              work / f"s{seed}", progress=False),
    }
    step1_held_out = over_predicted(step1.length, x_te, y_te, head_cfg.max_length).astype(bool)
    step1_tr_pred = np.asarray(predict_features(step1, x_tr).lengths)
    step1_te = jax.tree.map(np.asarray, predict_features(step1, x_te))
    for name, over in labels.items():
        head = make_head("cacheopt", head_cfg, seed=seed)
        state = nnx.state(head)  # step 2 starts from the same step-1 layer
        nnx.replace_by_pure_dict(state, step1_state)
        nnx.update(head, state)
        train_direction(head, x_tr, y_tr, over, cfg, work / f"s{seed}" / name, False)
        tr = jax.tree.map(np.asarray, predict_features(head, x_tr))
        te = jax.tree.map(np.asarray, predict_features(head, x_te))
        held = length_metrics(te.lengths, y_te, over_prob=te.over_prob, lo=te.lo, hi=te.hi,
                              majority_over=bool(over.mean() > 0.5))
        out[name] = {
            "label_over_rate": float(over.mean()),
            "classifier_train_acc": float(np.mean((tr.over_prob > 0.5) == over.astype(bool))),
            "held_out_acc": held.direction_acc,
            "held_out_auc": held.direction_auc,
            "majority_acc": held.direction_majority_acc,
            "held_out_over_rate": held.over_rate,
            "step2_flipped_held_out_directions": float(np.mean((te.lengths > y_te) != step1_held_out)),
            "final_mae": held.mae,
            "range_coverage": held.range_coverage,
            "range_width": held.range_width,
        }
    out["labels"] = {
        "agreement_in_sample_vs_out_of_fold": float(np.mean(labels["in_sample"] == labels["out_of_fold"])),
        "step1_mae_train": float(np.mean(np.abs(step1_tr_pred - y_tr))),
        "step1_mae_held_out": float(np.mean(np.abs(step1_te.lengths - y_te))),
        # Does the direction depend on the predicted length itself (regression towards the
        # typical length)? AUC of the step-1 length as a score for "over", held out.
        "held_out_auc_of_predicted_length": roc_auc(step1_te.lengths, step1_te.lengths > y_te),
        "median_baseline_mae": float(np.mean(np.abs(np.median(y_tr) - y_te))),
    }
    return out


def _mean_sd(values: list[float]) -> str:
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def markdown(per_seed: dict[int, dict], meta: dict) -> str:
    rows = [
        ("direction labels: fraction 'over'", "label_over_rate"),
        ("classifier accuracy on its own training labels", "classifier_train_acc"),
        ("held-out direction accuracy", "held_out_acc"),
        ("held-out accuracy of always the labels' majority", "majority_acc"),
        ("held-out direction ROC AUC (trivial: 0.5)", "held_out_auc"),
        ("held-out fraction over-predicted", "held_out_over_rate"),
        ("held-out directions flipped by step 2", "step2_flipped_held_out_directions"),
        ("held-out MAE of the final length (tokens)", "final_mae"),
        ("held-out coverage of [lo, hi] (target 0.90)", "range_coverage"),
        ("held-out mean width hi - lo (tokens)", "range_width"),
    ]
    seeds = sorted(per_seed)
    lines = [
        "# CacheOpt output-length predictor on held-out ShareGPT prompts",
        "",
        f"{meta['num_train']} training / {meta['num_test']} held-out prompts (seed-0 split), "
        f"frozen {meta['base_model']} features, head seeds {seeds} (mean ± sd over seeds). "
        f"Command: `{meta['command']}`.",
        "",
        "| quantity | in-sample labels (before) | out-of-fold labels (now) |",
        "|---|---|---|",
    ]
    for label, key in rows:
        a = _mean_sd([per_seed[s]["in_sample"][key] for s in seeds])
        b = _mean_sd([per_seed[s]["out_of_fold"][key] for s in seeds])
        lines.append(f"| {label} | {a} | {b} |")
    lines += ["", "| label diagnostics (step-1 length layer) | value |", "|---|---|"]
    for key in per_seed[seeds[0]]["labels"]:
        lines.append(f"| {key} | {_mean_sd([per_seed[s]['labels'][key] for s in seeds])} |")
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
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "predictor_accuracy.json").write_text(
        json.dumps({**meta, "per_seed": per_seed}, indent=1) + "\n")
    table = markdown(per_seed, meta)
    (RESULTS / "predictor_accuracy.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
