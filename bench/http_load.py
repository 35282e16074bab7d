"""Load test of the HTTP server: 500 concurrent streaming requests over loopback.

Serves tiny-llama (random weights) on a free 127.0.0.1 port, then sends every request at
t=0 through the benchmark's HTTP backend (`jserve bench --backend http`): fixed prompt
length, greedy, `ignore_eos`, fixed `max_tokens`, streamed with token ids. Checks that
every request finished with exactly `max_tokens` streamed tokens, that none was lost, that
the server counted the same finishes, and that the engine's KV blocks are all free again.
Prints requests/s and P99 TTFT (client-side), writes bench/results/http_load_cpu.json,
exits non-zero when a check fails or the run outlives --timeout.

    python bench/http_load.py [--num-requests 500] [--max-tokens 32] [--timeout 600]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

from jserve import LLM
from jserve.benchmarking.http_client import scrape_metrics, wait_until_idle
from jserve.serving.server import build_app, serve_in_background

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = "tiny-llama"


def _watchdog(seconds: float) -> None:
    """End the process if the run hangs: a lost stream must not stall a CI job."""

    def expire() -> None:
        print(f"FAIL: still running after {seconds:.0f}s", file=sys.stderr, flush=True)
        os._exit(2)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def _finished_by_length(url: str) -> float:
    return scrape_metrics(url).get('jserve_requests_finished_total{finish_reason="length"}', 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=500)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="engine batch limit")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before the run gives up")
    ap.add_argument("--output", default=str(ROOT / "bench" / "results" / "http_load_cpu.json"))
    args = ap.parse_args()
    deadline = time.monotonic() + args.timeout
    _watchdog(args.timeout + 30)  # a backstop should the server itself hang

    t0 = time.perf_counter()
    max_model_len = args.prompt_len + args.max_tokens
    llm = LLM(MODEL, num_blocks=args.max_num_seqs * math.ceil(max_model_len / 16) * 2,
              max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=max(512, args.max_num_seqs))
    print(f"engine ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    failures: list[str] = []
    with serve_in_background(build_app(llm)) as url, tempfile.TemporaryDirectory() as tmp:
        # The client is `jserve bench --backend http` in its own process, as a user runs it,
        # so client and server do not share one interpreter lock.
        bench_json = pathlib.Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "jserve.cli", "bench", "--backend", "http", "--url", url,
               "--model", MODEL, "--workload", f"fixed:{args.prompt_len}:{args.max_tokens}",
               "--num-requests", str(args.num_requests), "--rate", "inf",
               "--max-total-len", str(max_model_len), "--output", str(bench_json)]
        before = _finished_by_length(url)
        subprocess.run(cmd, check=True, timeout=deadline - time.monotonic())
        served = _finished_by_length(url) - before
        idle = wait_until_idle(url)
        state = llm.engine.state
        if not idle or state.has_unfinished or state.blocks.num_free != state.blocks.num_blocks:
            failures.append(f"{state.blocks.num_blocks - state.blocks.num_free} KV blocks still held")
        state.check_invariants()
        result = json.loads(bench_json.read_text())

    records = result["requests"]
    short = [r["request_id"] for r in records if not r["finished"] or r["output_len"] != args.max_tokens]
    if len(records) != args.num_requests:
        failures.append(f"{len(records)} records for {args.num_requests} requests")
    if short:
        failures.append(f"{len(short)} requests lost or short of {args.max_tokens} tokens: {short[:5]}")
    if served != args.num_requests:
        failures.append(f"the server finished {served:.0f} requests by length, not {args.num_requests}")

    s = SimpleNamespace(**result["summary"])
    print(f"{s.num_finished}/{s.num_requests} requests finished, {args.max_tokens} tokens each")
    print(f"requests/s      {s.throughput_rps:.1f}")
    print(f"P99 TTFT        {s.ttft_p99 * 1e3:.0f} ms (P50 {s.ttft_p50 * 1e3:.0f} ms)")
    print(f"output tokens/s {s.output_tokens_per_s:.0f}, P99 TBT {s.tbt_p99 * 1e3:.1f} ms, "
          f"{result['num_steps']} engine steps, {s.num_preemptions} preemptions")
    for failure in failures:
        print(f"FAIL: {failure}")

    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "what": f"{args.num_requests} concurrent streaming requests to `jserve serve` ({MODEL}) "
                "over loopback on CPU; the client (`jserve bench --backend http`) in its own process",
        "passed": not failures,
        "failures": failures,
        "requests_per_s": s.throughput_rps,
        "ttft_p99_s": s.ttft_p99,
        "ttft_p50_s": s.ttft_p50,
        "tbt_p99_s": s.tbt_p99,
        "output_tokens_per_s": s.output_tokens_per_s,
        "num_steps": result["num_steps"],
        "num_blocks": result["num_blocks"],
        "config": result["config"] | {"url": "loopback"},
        "engine": {"max_num_seqs": args.max_num_seqs, "max_model_len": max_model_len},
        "cpu_count": os.cpu_count(),
        "summary": result["summary"],
    }, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
