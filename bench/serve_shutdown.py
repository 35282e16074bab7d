"""Shutdown with open streams (issue 30 item 6): how long after SIGINT the open streams get
their final event, when the process exits, and whether it logs an error on the way out.

Starts `jserve serve` (a fresh subprocess, `--no-warmup`, a free loopback port), opens
`--streams` streaming completions that would run far past the drain window (`ignore_eos`,
a large `max_tokens`), waits until each has sent a token, sends SIGINT, then records per
stream the time of its last event and whether that was `[DONE]` (a stream cut off mid-way
ends without it), the process's exit time and status, and every `ERROR` line it wrote. The drain window is the server's
`--drain-timeout` (default: the server's own default), so the streams' final events are
expected at about that time and the exit right after.

    python bench/serve_shutdown.py [--model tiny-llama] [--streams 4] [--repeats 2]
                                   [--drain-timeout S] [--baseline DIR] [--output FILE]

`--baseline DIR` measures another checkout alongside (e.g. `git archive REV` unpacked in
DIR), the two taking turns, so a before/after comes from one run on one machine load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tree: pathlib.Path, args: argparse.Namespace, port: int) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "jserve", "serve", "--model", args.model, "--port", str(port),
           "--no-warmup", "--max-model-len", "4096", "--num-blocks", "1024"]
    if args.drain_timeout is not None:
        cmd += ["--drain-timeout", str(args.drain_timeout)]
    return subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.3)


def _stream(url: str, model: str, started: threading.Event, record: dict[str, Any]) -> None:
    body = {"model": model, "prompt": [1, 2, 3] if model != "smollm2-135m" else "Once upon a time",
            "max_tokens": 4000, "ignore_eos": True, "stream": True}
    events: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line.removeprefix("data: "))
                    record["last_event_at"] = time.monotonic()
                    started.set()
    except httpx.HTTPError as e:
        record["client_error"] = repr(e)
    record["last_events"] = events[-2:]


def measure(tree: pathlib.Path, args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(tree, args, port)
    err_lines: list[str] = []
    reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        _wait_healthy(url, proc)
        records = [{} for _ in range(args.streams)]
        starts = [threading.Event() for _ in range(args.streams)]
        threads = [threading.Thread(target=_stream, args=(url, args.model, s, r), daemon=True)
                   for s, r in zip(starts, records)]
        for t in threads:
            t.start()
        for s in starts:
            if not s.wait(START_TIMEOUT_S):
                raise RuntimeError("a stream sent nothing")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(120)
        proc.wait(120)
        exited = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(5)
    return {
        "final_event_s": [round(r["last_event_at"] - t0, 2) for r in records],
        "last_events": [r["last_events"] for r in records],
        "client_errors": [r["client_error"] for r in records if "client_error" in r],
        "exit_s": round(exited, 2),
        "returncode": proc.returncode,
        "error_lines": [ln.rstrip() for ln in err_lines if "ERROR" in ln or "Traceback" in ln],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--drain-timeout", type=float, default=None,
                    help="the server's --drain-timeout (default: its own default)")
    ap.add_argument("--baseline", type=pathlib.Path, default=None,
                    help="another checkout to measure alongside (before/after)")
    ap.add_argument("--output", default=None,
                    help="default: bench/results/serve_shutdown_MODEL_cpu.json")
    args = ap.parse_args()
    args.output = args.output or str(ROOT / "bench" / "results" / f"serve_shutdown_{args.model}_cpu.json")
    trees = {"this": ROOT}
    if args.baseline is not None:
        trees = {"baseline": args.baseline.resolve(), **trees}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    for _ in range(args.repeats):
        for label, tree in trees.items():
            runs[label].append(measure(tree, args))
    print(f"SIGINT with {args.streams} open streams on {args.model} (seconds after the signal; "
          f"median of {args.repeats})")
    print(f"{'tree':>9}  {'last event':>10}  {'exit':>6}  {'rc':>4}  {'ended by [DONE]':>15}  error lines")
    summary = {}
    for label, rs in runs.items():
        final = statistics.median(max(r["final_event_s"]) for r in rs)
        exit_s = statistics.median(r["exit_s"] for r in rs)
        errors = sum(len(r["error_lines"]) for r in rs)
        done = sum(bool(e) and e[-1] == "[DONE]" for r in rs for e in r["last_events"])
        streams = sum(len(r["last_events"]) for r in rs)
        summary[label] = {"last_event_s": final, "exit_s": exit_s, "error_lines": errors,
                          "streams_ended_by_done": done, "streams": streams}
        print(f"{label:>9}  {final:>10.2f}  {exit_s:>6.2f}  {rs[-1]['returncode']:>4}  "
              f"{f'{done}/{streams}':>15}  {errors}")
        for r in rs:
            for line in r["error_lines"]:
                print(f"{'':>11}{line}")
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "streams": args.streams,
                               "drain_timeout": args.drain_timeout, "summary": summary,
                               "runs": runs}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
