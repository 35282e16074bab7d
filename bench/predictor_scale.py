#!/usr/bin/env python
"""A length predictor trained on several times the shipped one's prompts, beside it (issue 43):
held-out accuracy, what each encoding shortcut costs on its own, and CacheOpt at bar J's loads
with each.

1. Held-out figures of each predictor directory (its `metrics.json`, written by `jserve
   train-predictor` on the first 1,000 prompts of the seed-0 shuffle, the same for every run):
   CacheOpt's MAE, accuracy within 50 tokens, direction accuracy and ROC AUC, range coverage
   and width; the training median's MAE beside.
2. Encoding shortcuts at equal data: CacheOpt's head trained on the first `--ablation-train`
   training prompts and scored on the first `--ablation-test` held-out ones, once per encoder
   (prompt tokens kept, base layers run; features from the feature store, encoded if missing).
   The default encoders are the shipped one (128 tokens, all layers), truncation alone (64
   tokens), fewer layers alone (8) and both; each row's MAE change against the first encoder
   is paired over the same held-out prompts, with its standard error. Beside each, the rate it
   encodes `--rate-sample` prompts at here (after a warm-up batch; on a shared machine the
   rates are only comparable with each other).
3. CacheOpt at bar J's loads (issue 41: OPT-13B on one simulated A100-80G, ShareGPT, 1,500
   requests, seed 21, 8-token blocks, 12 and 28 req/s; `--slos paper`: Section 5's SLOs set by
   the SLO-unaware baselines with the shipped predictor, as `cacheopt_preemptions.py` runs
   them, or none), once per predictor: the simulator draws CacheOpt's predictions from that
   directory's noise model (`predictor=DIR`); vLLM beside, with its median TTFT per tenth of
   the run (`cacheopt_preemptions.row`), which says whether the load is a steady state.

    nice python bench/predictor_scale.py --predictor 9.2k=DIR [--encoders 128:0,64:0,128:8,64:8]

Writes `--output` (JSON); the printed tables are what bench/results/issue43_predictor.md holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from cacheopt_preemptions import row  # noqa: E402
from reproduce_cacheopt import WORKLOADS, Setting, bench_config, simulate, slo_runs  # noqa: E402

from jserve.benchmarking.tables import markdown_table  # noqa: E402
from jserve.benchmarking.workload import save_trace  # noqa: E402
from jserve.models.loading import load_model  # noqa: E402
from jserve.predictor import DEFAULT_DIR  # noqa: E402
from jserve.predictor.checkpoint import METRICS_FILE, PredictorSpec  # noqa: E402
from jserve.predictor.data import build_dataset, cached_features  # noqa: E402
from jserve.predictor.encoder import EncoderConfig, PromptEncoder  # noqa: E402
from jserve.predictor.heads import HeadConfig, make_head, predict_features  # noqa: E402
from jserve.predictor.metrics import length_metrics  # noqa: E402
from jserve.predictor.train import TrainConfig, train_head  # noqa: E402
from jserve.runners.testbeds import DEFAULT_COST_MODEL  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
HELD_OUT = ("mae", "acc_within", "direction_acc", "direction_auc", "direction_majority_acc",
            "range_coverage", "range_width")
TAIL = ("preemptions", "requests_preempted", "ttft_p99", "tbt_p99", "worst_gap_p99", "ttft_mean",
        "ttft_attainment", "tbt_attainment")


def held_out(predictors: dict[str, pathlib.Path]) -> dict[str, dict]:
    """Each directory's CacheOpt held-out metrics, its training size and encoder."""
    out = {}
    for label, directory in predictors.items():
        metrics = json.loads((directory / METRICS_FILE).read_text())
        spec = PredictorSpec.read(directory)
        cacheopt = metrics["held_out"]["cacheopt"]
        out[label] = {"num_train": metrics["num_train"], "num_test": metrics["num_test"],
                      "max_prompt_len": spec.encoder.max_prompt_len,
                      "encoder_layers": spec.encoder.num_layers or "all",
                      **{k: cacheopt[k] for k in HELD_OUT},
                      "median_mae": metrics["held_out"]["median"]["mae"]}
    return out


def paired_change(errors: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """Mean change in absolute error against `reference` over the same prompts, and its
    standard error (pairing removes the prompts' own spread, which dwarfs the encoders')."""
    d = errors - reference
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))


def encoder_choices(encoders: list[tuple[int, int | None]], args: argparse.Namespace,
                    work: pathlib.Path) -> dict[str, dict]:
    """CacheOpt's held-out figures and the encode rate per encoder, at equal data."""
    base = load_model("smollm2-135m")
    data = build_dataset(base.tokenizer, args.ablation_train, 1000, seed=0)
    train, test = data.train[:args.ablation_train], data.test[:args.ablation_test]
    y_tr = np.array([ex.output_len for ex in train])
    y_te = np.array([ex.output_len for ex in test])
    sample = [ex.prompt_ids for ex in data.train[-args.rate_sample:]]
    out, reference = {}, None
    for tokens, layers in encoders:
        label = f"{tokens} tokens, {layers or 'all'} layers"
        encoder = PromptEncoder(base, EncoderConfig(max_prompt_len=tokens, num_layers=layers))
        encoder.encode(sample[:16])  # compiles the shapes the timed batch meets
        t0 = time.perf_counter()
        encoder.encode(sample)
        rate = len(sample) / (time.perf_counter() - t0)
        x_tr = cached_features(encoder, train, progress=True)
        x_te = cached_features(encoder, test, progress=True)
        head = make_head("cacheopt", HeadConfig(feature_dim=encoder.feature_dim), seed=0)
        labels = train_head(head, x_tr, y_tr, TrainConfig(), work / label.replace(" ", "_"), False)
        pred = jax.tree.map(np.asarray, predict_features(head, x_te))
        m = length_metrics(pred.lengths, y_te, over_prob=pred.over_prob, lo=pred.lo, hi=pred.hi,
                           majority_over=bool(labels.mean() > 0.5))
        errors = np.abs(pred.lengths - y_te).astype(np.float64)
        reference = errors if reference is None else reference
        change, se = paired_change(errors, reference)
        out[label] = {"prompts_per_s": rate, "num_train": len(train), "num_test": len(test),
                      **{k: getattr(m, k) for k in HELD_OUT}, "mae_change": change, "mae_change_se": se}
        print(f"{label}: MAE {m.mae:.1f} ({change:+.1f} +- {se:.1f}), AUC {m.direction_auc:.3f}, "
              f"{rate:.2f} prompts/s", flush=True)
    return out


def bar_j(predictors: dict[str, pathlib.Path], args: argparse.Namespace,
          scratch: pathlib.Path) -> dict[str, dict[str, dict]]:
    """Per load: vLLM, and CacheOpt with each predictor's noise model, on one SLO trace."""
    w = dataclasses.replace(WORKLOADS["sharegpt"], num_requests=args.num_requests)
    s = Setting("a100-80g", DEFAULT_COST_MODEL, args.workers)
    out = {}
    for rate in args.loads:
        path, slos = None, None
        if args.slos == "paper":
            (runs, slos), = slo_runs(w, [(rate, args.seed)], s, ["vllm"], scratch)
            path = scratch / f"slos_{rate:g}.jsonl"
            save_trace(slos, path)
            vllm = runs["vllm"]
        configs = []
        for directory in predictors.values():
            config = bench_config(w, "cacheopt", rate, args.seed, s, path)
            configs.append(dataclasses.replace(config, engine=dataclasses.replace(
                config.engine, predictor=str(directory))))
        if slos is None:
            vllm, *cacheopt = simulate([bench_config(w, "vllm", rate, args.seed, s), *configs], s)
        else:
            cacheopt = simulate(configs, s)
        rows = {"vllm": row(vllm, slos)}
        for label, run in zip(predictors, cacheopt, strict=True):
            rows[f"cacheopt, {label}"] = row(run, slos)
        out[f"{rate:g}"] = rows
        print(f"bar J at {rate:g} req/s done", flush=True)
    return out


def table(rows: dict[str, dict], columns: tuple[str, ...], first: str) -> str:
    def cell(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    return "\n".join(markdown_table([first, *columns], [[label, *(cell(r[c]) for c in columns)]
                                                        for label, r in rows.items()]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--predictor", action="append", default=[], metavar="LABEL=DIR",
                    help="a trained predictor directory to set beside the shipped one (repeatable)")
    ap.add_argument("--encoders", default="128:0,64:0,128:8,64:8",
                    help="TOKENS:LAYERS encoders to compare at equal data ('' skips; LAYERS 0: all)")
    ap.add_argument("--ablation-train", type=int, default=1000)
    ap.add_argument("--ablation-test", type=int, default=500)
    ap.add_argument("--rate-sample", type=int, default=64)
    ap.add_argument("--loads", type=lambda t: [float(x) for x in t.split(",")], default=[12.0, 28.0])
    ap.add_argument("--num-requests", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--slos", choices=("paper", "none"), default="paper",
                    help="paper: Section 5's per-request SLOs, set by four baseline runs per "
                         "load; none: no SLO (the audit's runs) (default: %(default)s)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--output", default=str(RESULTS / "issue43_predictor.json"))
    args = ap.parse_args()
    predictors = {"shipped": DEFAULT_DIR}
    for item in args.predictor:
        label, _, directory = item.partition("=")
        predictors[label] = pathlib.Path(directory)
    encoders = [(int(t), int(n) or None) for t, n in (e.split(":") for e in args.encoders.split(",") if e)]

    report: dict = {"held_out": held_out(predictors)}
    print("## Held-out CacheOpt predictor (1,000 ShareGPT prompts, seed-0 split)\n")
    print(table(report["held_out"], ("num_train", "max_prompt_len", "encoder_layers", *HELD_OUT,
                                     "median_mae"), "predictor"))
    with tempfile.TemporaryDirectory(prefix="predictor_scale_") as tmp:
        if encoders:
            report["encoders"] = encoder_choices(encoders, args, pathlib.Path(tmp))
            print(f"\n## Encoding choices at equal data ({args.ablation_train} training, "
                  f"{args.ablation_test} held-out prompts)\n")
            print(table(report["encoders"], ("prompts_per_s", "mae_change", "mae_change_se", *HELD_OUT),
                        "encoder"))
        report["bar_j"] = bar_j(predictors, args, pathlib.Path(tmp))
    for rate, rows in report["bar_j"].items():
        print(f"\n## CacheOpt at {rate} req/s (OPT-13B, A100-80G, ShareGPT, {args.num_requests} "
              f"requests, seed {args.seed}, SLOs: {args.slos})\n")
        medians = ", ".join("-" if x is None else f"{x:.3g}" for x in rows["vllm"]["ttft_window_medians"])
        print(f"vLLM's median TTFT per tenth of the run, in arrival order (s): {medians}\n")
        print(table(rows, TAIL, "run"))
    out = pathlib.Path(args.output)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
