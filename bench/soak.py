"""Soak test of `jserve serve`: a bounded loopback run of mixed, partly hostile traffic.

Starts `jserve serve --model tiny-llama` (random weights, token-id prompts) as a child
process on a free 127.0.0.1 port and sends --num-requests requests as a Poisson process at
--rate: streaming and not, a third abandoned mid-way (streams closed after two chunks,
non-streaming requests given up by a client timeout), some malformed (bad JSON, bad field
values, unknown model), some over the context (prompt + max_tokens past it). Then checks the
server: every request ended (none running or waiting), every KV block free again.

Prints requests by outcome, client-side P99 TTFT of streamed requests, the count of 5xx
answers (goal 0), KV blocks leaked (goal 0) and the server's resident memory after a warm-up
phase and at the end (goal: within 10%). Writes bench/results/soak_cpu.json; exits non-zero
when a goal is missed.

    python bench/soak.py [--num-requests 2000] [--rate 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import IO

import httpx
import numpy as np
import psutil

from jserve.benchmarking.http_client import scrape_metrics, wait_until_idle
from jserve.benchmarking.metrics import percentiles

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = "tiny-llama"
CONTEXT = 256
KINDS = ("stream", "complete", "abandon-stream", "abandon-complete", "malformed", "over-context")
# A third abandoned; a tenth malformed, a twentieth over the context; the rest served whole.
WEIGHTS = (0.27, 0.28, 0.17, 0.16, 0.08, 0.04)
MALFORMED = (
    b'{"model": "tiny-llama", "prompt": [1, 2',
    b'{"model": "tiny-llama", "prompt": [1], "temperature": -1}',
    b'{"model": "tiny-llama", "prompt": [1], "max_tokens": "many"}',
    b'{"model": "gpt-4", "prompt": [1]}',
    b'{"model": "tiny-llama", "prompt": [1, 99999]}',
    b'{"model": "tiny-llama", "prompt": [], "stream": true}',
    b'[1, 2, 3]',
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(port: int, log: IO[str]) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "jserve", "serve", "--model", MODEL, "--port", str(port),
         "--max-model-len", str(CONTEXT), "--max-num-seqs", "64", "--max-num-batched-tokens", "512",
         "--kv-cache-space", "0.25"],
        env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)  # a file: a pipe would fill


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health").status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit("the server did not start")


def _body(kind: str, rng: np.random.Generator) -> dict:
    prompt = rng.integers(3, 500, size=int(rng.integers(4, 64))).tolist()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": int(rng.integers(8, 64)),
            "ignore_eos": True, "stream": kind in ("stream", "abandon-stream")}
    if kind == "over-context":
        body["max_tokens"] = CONTEXT  # prompt + max_tokens > context: a 400 naming both
    if kind in ("abandon-stream", "abandon-complete"):
        body["max_tokens"] = int(rng.integers(150, CONTEXT - 64))
    return body


async def _one(client: httpx.AsyncClient, kind: str, rng: np.random.Generator) -> tuple[str, float | None]:
    """(outcome, TTFT of a streamed request)."""
    t0 = time.perf_counter()
    try:
        if kind == "malformed":
            r = await client.post("/v1/completions", content=MALFORMED[int(rng.integers(len(MALFORMED)))],
                                  headers={"Content-Type": "application/json"})
            return f"{r.status_code}", None
        body = _body(kind, rng)
        if kind == "abandon-complete":
            with contextlib.suppress(httpx.TimeoutException):
                await client.post("/v1/completions", json=body, timeout=0.15)
                return "200 (finished before the client gave up)", None
            return "abandoned", None
        if not body["stream"]:
            r = await client.post("/v1/completions", json=body)
            return f"{r.status_code}", None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return f"{r.status_code}", None
            ttft = None
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                chunks += 1
                if kind == "abandon-stream" and chunks == 2:
                    return "abandoned", ttft
                if line == "data: [DONE]":
                    return "200", ttft
            return "stream cut", ttft
    except httpx.TransportError as e:
        return f"transport error ({type(e).__name__})", None


async def _run(url: str, kinds: list[str], gaps: np.ndarray, seed: int) -> tuple[Counter, list[float]]:
    rng = np.random.default_rng(seed + 1)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        tasks = []
        for kind, gap in zip(kinds, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(_one(client, kind, np.random.default_rng(rng.integers(2**32)))))
        results = await asyncio.gather(*tasks)
    outcomes = Counter((kind, outcome) for kind, (outcome, _) in zip(kinds, results))
    return outcomes, [t for _, t in results if t is not None]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=10.0, help="requests/s (Poisson)")
    ap.add_argument("--warmup-requests", type=int, default=200,
                    help="sent first; resident memory is read after them")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=str(ROOT / "bench" / "results" / "soak_cpu.json"))
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    n = args.warmup_requests + args.num_requests
    kinds = rng.choice(KINDS, size=n, p=WEIGHTS).tolist()
    gaps = rng.exponential(1 / args.rate, size=n)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile("w+")
    proc = _start_server(port, log)
    try:
        t_start = time.monotonic()
        _wait_ready(url, proc)
        print(f"server ready in {time.monotonic() - t_start:.1f}s", file=sys.stderr)
        server = psutil.Process(proc.pid)
        asyncio.run(_run(url, kinds[:args.warmup_requests], gaps[:args.warmup_requests], args.seed))
        assert wait_until_idle(url, timeout=120)
        rss_start = server.memory_info().rss
        t0 = time.monotonic()
        outcomes, ttfts = asyncio.run(_run(url, kinds[args.warmup_requests:],
                                           gaps[args.warmup_requests:], args.seed))
        wall = time.monotonic() - t0
        idle = wait_until_idle(url, timeout=120)
        rss_end = server.memory_info().rss
        metrics = scrape_metrics(url)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()

    log.seek(0)
    server_log = log.read()
    tracebacks = server_log.count("Traceback")
    if tracebacks:
        first = server_log.index("Traceback")
        end = server_log.find("\nINFO", first)
        print("the server's first traceback:\n" + server_log[first:end if end > 0 else None][-2500:], file=sys.stderr)
    num_5xx = sum(c for (_, o), c in outcomes.items() if o.startswith("5"))
    leaked = int(metrics["jserve_kv_blocks_total"] - metrics["jserve_kv_blocks_free"])
    unfinished = int(metrics["jserve_requests_running"] + metrics["jserve_requests_waiting"])
    p99_ttft = percentiles(ttfts, (99,))[0]
    growth = rss_end / rss_start - 1
    print(f"{args.num_requests} requests at {args.rate}/s in {wall:.0f} s "
          f"(after {args.warmup_requests} warm-up requests)")
    print(f"{'kind':<18}{'outcome':<44}{'count':>6}")
    for (kind, outcome), count in sorted(outcomes.items()):
        print(f"{kind:<18}{outcome:<44}{count:>6}")
    print(f"P99 TTFT (streamed, client side) {p99_ttft * 1e3:.0f} ms")
    print(f"5xx answers                      {num_5xx} (goal 0)")
    print(f"KV blocks leaked                 {leaked} of {int(metrics['jserve_kv_blocks_total'])}, "
          f"requests left {unfinished} (goal 0)")
    print(f"server resident memory           {rss_start / 2**20:.0f} MiB -> {rss_end / 2**20:.0f} MiB "
          f"({growth:+.1%}; goal within 10%)")
    print(f"tracebacks in the server's log   {tracebacks} (goal 0; it exited {proc.returncode})")
    aborted = metrics.get('jserve_requests_finished_total{finish_reason="abort"}', 0)
    print(f"server-side aborts (warm-up included) {aborted:.0f}")
    ok = tracebacks == 0 and num_5xx == 0 and leaked == 0 and unfinished == 0 and idle and abs(growth) <= 0.10
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "num_requests": args.num_requests, "rate": args.rate, "seed": args.seed,
        "warmup_requests": args.warmup_requests, "wall_s": wall,
        "outcomes": [{"kind": k, "outcome": o, "count": c} for (k, o), c in sorted(outcomes.items())],
        "p99_ttft_ms": None if p99_ttft is None else p99_ttft * 1e3,
        "num_5xx": num_5xx, "blocks_leaked": leaked, "requests_left": unfinished,
        "rss_start_mib": rss_start / 2**20, "rss_end_mib": rss_end / 2**20, "rss_growth": growth,
        "server_aborts": aborted, "server_tracebacks": tracebacks, "passed": ok,
    }, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
