"""`jserve` command line: `jserve generate "PROMPT"` and friends (`jserve --help`)."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn, TypeVar

T = TypeVar("T")


class BadArguments(Exception):
    """An option the configuration refused; `main` prints it as one `error:` line."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, whose refusal of an option (an unknown choice, a value that does not
    parse) is its one `error:` line and a pointer to `--help`, not the command's whole
    usage text before it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(see `{self.prog} --help`)\n")


def _checked(make: Callable[[], T]) -> T:
    """Build a configuration from the options: its `ValueError` is the user's mistake, not
    a bug, so it becomes `BadArguments` (a ValueError later, while running, stays a bug
    with its traceback)."""
    try:
        return make()
    except ValueError as e:
        raise BadArguments(str(e)) from None

if TYPE_CHECKING:
    from jserve.benchmarking.bench import BenchConfig

from jserve.config import (
    add_engine_args,
    add_model_arg,
    add_server_args,
    engine_config_from_args,
    server_config_from_args,
)
from jserve.errors import ConfigError
from jserve.models.hf_checkpoint import CheckpointError
from jserve.runners.cpu_threads import start_xla_on
from jserve.serving.vllm_flags import add_vllm_serve_args


def _generate(args: argparse.Namespace) -> int:
    from jserve import LLM, InvalidRequestError, SamplingParams

    t0 = time.perf_counter()
    print(f"loading {args.model} ...", file=sys.stderr)
    llm = LLM(_checked(lambda: engine_config_from_args(args)))
    print(f"ready in {time.perf_counter() - t0:.1f}s"
          + ("" if args.warmup else " (step shapes compile on first use)"), file=sys.stderr)
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed)
        if llm.tokenizer is None:
            raise InvalidRequestError(f"{args.model} has no tokenizer (dummy weights, or a checkpoint "
                                      "without tokenizer.json)")
        prompt = args.prompt
        if not args.raw:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        printed = 0
        for out in llm.generate_stream(prompt, params):
            sys.stdout.write(out.text[printed:])
            sys.stdout.flush()
            printed = len(out.text)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    m = out.metrics
    print(f"[{len(out.token_ids)} tokens, finish={out.finish_reason}, "
          f"ttft={m.first_token_time - m.arrival_time:.2f}s, "
          f"total={m.finished_time - m.arrival_time:.2f}s]", file=sys.stderr)
    return 0


def _add_bench_args(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    """Options of `bench` and `sweep`: the engine's, then the workload's."""
    from jserve.benchmarking.metrics import TBT_SLO_MEASURES
    from jserve.benchmarking.workload import WORKLOADS

    add_engine_args(p, benchmark=True, policy=not sweep)
    p.add_argument("--workload", default="sharegpt",
                   help=f"one of {', '.join(WORKLOADS)} or fixed:IN:OUT (default: sharegpt)")
    p.add_argument("--num-requests", type=int, default=1000, help="requests in the trace (default: 1000)")
    p.add_argument("--cv", type=float, default=1.0,
                   help="coefficient of variation of inter-arrival gaps; 1 is Poisson (default: 1)")
    p.add_argument("--ttft-slo", type=float, default=None, help="TTFT SLO in seconds")
    p.add_argument("--tbt-slo", type=float, default=None,
                   help="TBT SLO in seconds, met when a request's P99 TBT (or TPOT, see "
                        "--tbt-slo-on) is within it")
    p.add_argument("--tbt-slo-on", choices=list(TBT_SLO_MEASURES), default="p99-tbt",
                   help="what the TBT SLO bounds: each request's P99 gap between tokens "
                        "(Apt-Serve, CacheOpt) or its mean time per output token (LayerKV) "
                        "(default: p99-tbt)")
    p.add_argument("--slo-scale", type=float, nargs=2, metavar=("LO", "HI"), default=None,
                   help="per-request SLOs = the SLOs x U[LO, HI] (CacheOpt uses 0.5 2.5)")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths, arrivals and SLOs")
    p.add_argument("--predictions", choices=["noise", "oracle", "none"], default="noise",
                   help="output lengths that cacheopt/rlp/s3/layerkv see: draws from the trained "
                        "predictor's error distribution, the true lengths, or none "
                        "(default: noise)")
    p.add_argument("--conversation-process", choices=["birth-death", "think-time", "open-loop", "exp-think"],
                   default="birth-death",
                   help="sharegpt-multiturn: turns come after Exp(own rate) think times and "
                        "chats end at --end-rate (birth-death), or after --think-time, or "
                        "every turn Exp(--turn-rate) after the previous reply (exp-think, the "
                        "T-LRU paper's Appendix F) or after the previous turn's arrival "
                        "(open-loop) (default: birth-death). --rate is then new conversations/s "
                        "and --num-requests the number of conversations")
    p.add_argument("--turn-rate", type=float, default=0.1,
                   help="birth-death: mean of each conversation's turn rate, 1/s (default: 0.1)")
    p.add_argument("--end-rate", type=float, default=0.05,
                   help="birth-death: rate at which a conversation ends, 1/s (default: 0.05)")
    p.add_argument("--think-time", type=float, default=5.0,
                   help="think-time: seconds between a reply and the next turn (default: 5)")
    p.add_argument("--trace", default=None, help="replay this JSONL trace instead of sampling")


def _bench_config(args: argparse.Namespace, policy: str, rate: float, backend: str = "inprocess",
                  url: str | None = None):
    import dataclasses

    from jserve.benchmarking.bench import BenchConfig

    engine = _checked(lambda: dataclasses.replace(
        engine_config_from_args(args), policy=policy, runner="real" if backend == "http" else args.runner))
    return _checked(lambda: BenchConfig(
        engine, backend=backend, url=url, workload=args.workload, rate=rate,
        num_requests=args.num_requests, cv=args.cv, ttft_slo=args.ttft_slo, tbt_slo=args.tbt_slo,
        tbt_slo_on=args.tbt_slo_on, slo_scale=tuple(args.slo_scale) if args.slo_scale else None, seed=args.seed,
        trace=args.trace, predictions=args.predictions, tel_threshold=args.tel_threshold,
        conversation_process=args.conversation_process, turn_rate=args.turn_rate,
        end_rate=args.end_rate, think_time=args.think_time,
    ))


def _write_json(path: str, payload: dict) -> None:
    import json
    import pathlib

    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {out}", file=sys.stderr)


def _say_what_is_simulated(config: BenchConfig) -> None:
    """One line naming the GPU model and the stack a simulated run charges."""
    from jserve.benchmarking.bench import simulated_json

    simulated = simulated_json(config)
    if simulated is not None:
        engine = config.engine
        print(f"simulating {engine.model_name} on {engine.hardware}: {simulated['description']}", file=sys.stderr)


def _bench(args: argparse.Namespace) -> int:
    from jserve.benchmarking.bench import run_benchmark
    from jserve.benchmarking.metrics import format_table

    if args.backend == "http" and not args.url:
        print("error: --backend http needs --url", file=sys.stderr)
        return 2
    config = _bench_config(args, args.policy, args.rate, args.backend, args.url)
    _say_what_is_simulated(config)
    result = run_benchmark(config)
    print(format_table(result.summary, result.vllm))
    if result.multiturn is not None:
        m = result.multiturn
        print(f"turns {m['num_turns']} in {m['num_conversations']} conversations; "
              f"prompt tokens from the prefix cache {m['cached_prompt_fraction']:.1%}; "
              f"TEL (xi={m['tel_threshold']}s) {m['tel']:.2f}s; "
              f"TTFT > {m['slo']}s: {m['slo_violation']:.1%}")
    print(f"steps {result.num_steps}, KV blocks {result.num_blocks}, "
          f"wall {result.wall_time:.1f}s", file=sys.stderr)
    if args.output:
        _write_json(args.output, result.to_json())
    return 0


def _sweep(args: argparse.Namespace) -> int:
    import pathlib

    from jserve.benchmarking.sweep import run_sweeps, write_sweep

    config = _bench_config(args, args.policies[0], args.rates[0])
    for policy in args.policies:
        for rate in args.rates:
            _checked(lambda: config.with_policy(policy, rate))  # every point, before any runs
    seeds = args.seeds or [args.seed]
    _say_what_is_simulated(config)
    sweeps = run_sweeps(config, args.policies, args.rates, seeds, workers=args.workers,
                        ray_address=args.ray)
    for seed, sweep in zip(seeds, sweeps):
        if len(seeds) > 1:
            print(f"seed {seed}")
        for policy in args.policies:
            print(f"{policy:>10}: effective throughput {sweep.effective_throughput(policy)} req/s")
            for rate, r in zip(args.rates, sweep.results[policy]):
                s = r.summary
                print(f"{'':>10}  rate {rate:>7.2f}: attainment {s.slo_attainment}, "
                      f"P99 TTFT {s.ttft_p99}, P99 TBT {s.tbt_p99}")
        out = pathlib.Path(args.output)
        if len(seeds) > 1:
            out = out.with_name(f"{out.stem}-seed{seed}{out.suffix}")
        png = write_sweep(sweep, out)
        print(f"wrote {out} and {png}", file=sys.stderr)
    return 0


def _profile(args: argparse.Namespace) -> int:
    from jserve.benchmarking.calibrate import run_profile

    fitted = run_profile(args.model, args.output, max_len=args.max_len, repeats=args.repeats,
                         hidden_cost_divisor=args.hidden_cost_divisor)
    err = abs(fitted.fit_errors())
    print(f"fitted {len(fitted.samples)} shapes: median |error| {100 * float(err.mean() if len(err) else 0):.1f}%"
          f", max {100 * float(err.max() if len(err) else 0):.1f}%; wrote {args.output}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging
    import os

    from jserve import LLM
    from jserve.serving.server import bind, serve
    from jserve.serving.vllm_flags import apply_vllm_serve_args

    logging.basicConfig(format="%(levelname)s:     %(message)s")  # uvicorn's look
    logging.getLogger("jserve").setLevel(logging.INFO)
    vllm = _checked(lambda: apply_vllm_serve_args(args))
    server = _checked(lambda: server_config_from_args(args, dict(os.environ)))
    engine = _checked(lambda: vllm.engine_config(engine_config_from_args(args)))
    try:
        sock = bind(server)  # before the model loads: a busy port fails in a second, not a minute
    except OSError as e:
        raise BadArguments(f"cannot listen on {server.host}:{server.port}: {e.strerror or e}") from None
    # The model loads once the server listens: /health answers 503 until it is ready.
    serve(lambda: LLM(engine), server, sock, log_level=vllm.log_level)
    # The process ends next: spare Python's teardown its garbage collections over JAX's
    # object graph, which took seconds after the server had shut down (measured in
    # bench/serve_shutdown.py); the memory goes back to the OS either way.
    gc.freeze()
    return 0


def _export_tokenizer(args: argparse.Namespace) -> int:
    from jserve.config import MAX_DEFAULT_MODEL_LEN
    from jserve.models.loading import load_tokenizer
    from jserve.models.registry import get_config

    tokenizer = load_tokenizer(args.model)
    if tokenizer is None:
        raise BadArguments(f"{args.model} has no tokenizer: a named shape other than smollm2-135m "
                           "has random weights, a checkpoint directory needs tokenizer.json")
    context = args.max_model_len or min(get_config(args.model).max_position, MAX_DEFAULT_MODEL_LEN)
    for path in tokenizer.export_hf(args.output, model_max_length=context):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _train_predictor(args: argparse.Namespace) -> int:
    import pathlib

    from jserve.predictor.checkpoint import METRICS_FILE
    from jserve.predictor.encoder import EncoderConfig
    from jserve.predictor.heads import KINDS
    from jserve.predictor.metrics import format_metrics_table
    from jserve.predictor.train import (
        MEDIAN_BASELINE,
        TrainConfig,
        TrainOptions,
        train_predictors,
    )

    options = TrainOptions(
        output=pathlib.Path(args.output), kinds=KINDS if args.kind == "all" else (args.kind,),
        num_train=args.num_train, num_test=args.num_test,
        encoder=EncoderConfig(max_prompt_len=args.max_prompt_len, num_layers=args.encoder_layers),
        train=TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                          seed=args.seed, direction_folds=args.direction_folds),
        resume=args.resume,
    )
    try:
        result = train_predictors(options)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"held-out metrics ({result.num_test} prompts; trained on {result.num_train}; "
          f"{MEDIAN_BASELINE}: the training median guessed for every prompt; majority: the "
          f"direction classifier's trivial baseline; range: CacheOpt's [lo, hi]):")
    print(format_metrics_table(result.metrics))
    print(f"wrote {options.output} (metrics in {options.output / METRICS_FILE})", file=sys.stderr)
    return 0


def _add_train_predictor_parser(sub: argparse._SubParsersAction) -> None:
    from jserve.predictor.heads import KINDS
    from jserve.predictor.train import TrainConfig, TrainOptions

    defaults, train = TrainOptions(), TrainConfig()
    t = sub.add_parser("train-predictor",
                       help="train the CacheOpt / S3 / RLP output-length predictors on ShareGPT")
    t.add_argument("--kind", choices=[*KINDS, "all"], default="all",
                   help="which predictor to train (default: all)")
    t.add_argument("--num-train", type=int, default=defaults.num_train,
                   help="training prompts (default: %(default)s)")
    t.add_argument("--num-test", type=int, default=defaults.num_test,
                   help="held-out prompts, the first of the seeded shuffle (default: %(default)s)")
    t.add_argument("--max-prompt-len", type=int, default=defaults.encoder.max_prompt_len,
                   help="prompt tokens the base reads; longer prompts keep head and tail "
                        "(default: %(default)s)")
    t.add_argument("--encoder-layers", type=int, default=defaults.encoder.num_layers, metavar="N",
                   help="run only the base's first N layers to encode prompts (cheaper; what "
                        "it costs: bench/results/issue43_predictor.md) (default: all)")
    t.add_argument("--epochs", type=int, default=train.epochs,
                   help="epochs per stage in all; with --resume, more continue the run "
                        "(default: %(default)s)")
    t.add_argument("--batch-size", type=int, default=train.batch_size, help="default: %(default)s")
    t.add_argument("--lr", type=float, default=train.lr, help="AdamW learning rate (default: %(default)s)")
    t.add_argument("--seed", type=int, default=train.seed,
                   help="seed of the data sample, split, initialisation and batch order")
    t.add_argument("--output", default=str(defaults.output),
                   help="directory for checkpoints, metrics.json and noise.json (default: %(default)s)")
    t.add_argument("--direction-folds", type=int, default=train.direction_folds,
                   help="folds over which CacheOpt's direction labels are collected out of "
                        "fold (default: %(default)s)")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --output from its last epoch checkpoints, or "
                        "extend it: more --epochs, more --num-train (with more --epochs)")
    t.set_defaults(func=_train_predictor)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_xla_cpu_cores_arg(parser: argparse.ArgumentParser) -> None:
    """A process's option, not an engine's: it acts when JAX's backend starts."""
    parser.add_argument("--xla-cpu-cores", type=int, default=None, metavar="N",
                        help="start XLA's CPU thread pools on N of this process's cores and leave "
                             "the engine's host thread on all: on a CPU a small model's step is "
                             "faster when the host has a core of its own, a larger model's slower "
                             "(default: all cores)")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="jserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and stream the text to stdout")
    g.add_argument("prompt", help="the user message (wrapped in the chat template unless --raw)")
    g.add_argument("--max-tokens", type=int, default=128, help="output token cap (default: 128)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, (0, 1] (default: 1)")
    g.add_argument("--top-k", type=int, default=0, help="0 disables top-k (default: 0)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    add_engine_args(g)
    add_xla_cpu_cores_arg(g)
    g.set_defaults(func=_generate, warmup=False)  # one prompt compiles only the shapes it meets

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, "
                                     "/v1/chat/completions, /v1/models, /health, /metrics)")
    add_server_args(s)
    add_engine_args(s)
    add_vllm_serve_args(s)
    add_xla_cpu_cores_arg(s)
    s.set_defaults(func=_serve, background_compile=True)  # answer early (README, "Start-up")

    b = sub.add_parser("bench", help="replay a workload through the real engine, the simulator "
                                     "or a running server")
    b.add_argument("--rate", type=float, default=float("inf"),
                   help="arrival rate in requests/s; inf sends all at once (default: inf)")
    b.add_argument("--output", default=None, help="write the summary and per-request records as JSON")
    b.add_argument("--backend", choices=["inprocess", "http"], default="inprocess",
                   help="inprocess: run the engine (or simulator) here; http: send the trace to a "
                        "running `jserve serve` at --url (--model and --policy must name what it "
                        "runs; its cache settings apply) (default: inprocess)")
    b.add_argument("--url", default=None, help="base URL of the server, e.g. http://127.0.0.1:8000")
    _add_bench_args(b)
    b.set_defaults(func=_bench)

    w = sub.add_parser("sweep", help="SLO attainment and tail latency versus rate, per policy")
    w.add_argument("--policies", type=_names, default=["vllm"], help="comma-separated (default: vllm)")
    w.add_argument("--rates", type=_floats, required=True, help="comma-separated requests/s")
    w.add_argument("--output", default="sweep.json",
                   help="JSON path; the PNG goes beside it (with several seeds, NAME-seedS.json each)")
    w.add_argument("--seeds", type=_ints, default=None,
                   help="comma-separated: run every point at each seed (default: --seed)")
    w.add_argument("--workers", type=int, default=None,
                   help="local processes the points run in (default: one per CPU; 1 runs them "
                        "in this process)")
    w.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run the points as tasks on the Ray cluster at ADDRESS ('auto', "
                        "'HOST:PORT', 'ray://HOST:PORT', or 'local' to start one here); its "
                        "workers must be able to import jserve")
    _add_bench_args(w, sweep=True)
    w.set_defaults(func=_sweep)

    p = sub.add_parser("profile", help="time real steps over a grid of shapes and fit the "
                                       "simulator's cost model")
    add_model_arg(p)
    p.add_argument("--output", default="profile.json", help="profile JSON (default: profile.json)")
    p.add_argument("--max-len", type=int, default=2048, help="longest context profiled")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per shape (median)")
    p.add_argument("--hidden-cost-divisor", type=float, default=1.0,
                   help="divide the fitted hidden-cache cost (Apt-Serve's rho) by this; the authors' "
                        "code uses 5, unexplained in the paper (default: 1)")
    p.set_defaults(func=_profile)
    _add_train_predictor_parser(sub)

    e = sub.add_parser("export-tokenizer",
                       help="write the model's tokenizer as a Hugging Face tokenizer folder "
                            "(tokenizer.json, tokenizer_config.json with the chat template), for "
                            "clients that load one locally (guidellm --processor, lm-eval "
                            "tokenizer=)")
    e.add_argument("output", help="the folder to write (made if missing)")
    add_model_arg(e)
    e.add_argument("--max-model-len", type=int, default=None, metavar="L",
                   help="the context the folder declares (model_max_length); pass the server's "
                        "(default: min(model context, 2048), the server's default)")
    e.set_defaults(func=_export_tokenizer)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "xla_cpu_cores", None) is not None:
            _checked(lambda: start_xla_on(args.xla_cpu_cores))
        return args.func(args)
    except (BadArguments, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
