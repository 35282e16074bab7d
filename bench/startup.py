"""Start-up time: where `LLM(...)` spends its seconds on a first start (empty compile cache)
and a second one (cache warm), and how soon `jserve serve` answers `/health` (issue 12 item 5;
goal: `jserve serve` ready in < 15 s on a second start).

Every start is a fresh subprocess with a private compile cache ($JSERVE_COMPILE_CACHE, a new
temporary folder per measured command), so "first" and "second" mean what they say whatever
~/.cache holds. The `LLM(...)` child times the stages by wrapping the functions that do them
(import, GGUF metadata, dequantisation, model build, weights to device, tokenizer, cache
sizing, runner set-up with the KV cache allocation, warm-up) and splits the warm-up with
JAX's compile events into per-bucket tracing, lowering and compiling (or loading from the
persistent cache); what is left of the warm-up is executing its padding batches. The total
is the parent's wall time from spawning the child to its report, so it includes starting
Python. `jserve serve` runs with its defaults (the KV cache sized from memory) on a free
port; its total is spawn to the first 200 from `/health`, and its KV block count is read
from `/metrics` so starts can be checked to build the same shapes.

    python bench/startup.py [--model smollm2-135m] [--num-blocks 512] [--repeats 2]
                            [--tree DIR] [--baseline DIR] [--only {llm,serve}] [--output FILE]

`--tree` runs the children on another checkout; `--baseline DIR` measures a second one
alongside, the two taking turns (a before/after in one run, e.g. on `git archive REV`
unpacked in DIR). The children's instrumentation is this file's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import date
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOAL_S = 15.0
REPORT = "STARTUP-REPORT "
SERVE_TIMEOUT_S = 3600.0
# The line a server that compiles in the background logs when it has finished.
BACKGROUND_DONE = "step buckets in the background"

# (stage label, module, attribute): the functions `LLM(...)` calls for each stage, wrapped by
# the child where they are looked up. A name a checkout lacks is reported as absent.
STAGES = [
    ("load_model (all of it)", "jserve.builder", "load_model"),
    ("GGUF metadata", "jserve.models.loading", "open_gguf"),
    ("dequantise weights", "jserve.models.loading", "load_llama_gguf"),
    ("weights to device", "jserve.models.loading", "load_llama_weights"),
    ("tokenizer", "jserve.models.loading", "Tokenizer.from_gguf"),
    ("KV cache sizing", "jserve.builder", "device_kv_budget"),
    ("runner set-up (KV cache allocation)", "jserve.runners.jax_runner", "JaxRunner.__init__"),
    ("warm-up", "jserve.runners.jax_runner", "JaxRunner.warmup"),
]
STEP_NAME = "step"  # the runner's jitted step in JAX's compile events
PHASES = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower",
          "backend_compile_duration": "compile"}


# ------------------------------------------------------------------------------ child
def _wrap(module: Any, path: str, times: dict[str, float], label: str) -> bool:
    """Replace `module.path` (a function, method or classmethod) by a timed copy."""
    owner_name, _, name = path.rpartition(".")
    owner = getattr(module, owner_name) if owner_name else module
    raw = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if raw is None:
        return False
    is_classmethod = isinstance(raw, classmethod)
    fn = raw.__func__ if is_classmethod else raw

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[label] = times.get(label, 0.0) + time.perf_counter() - t0

    setattr(owner, name, classmethod(timed) if is_classmethod else timed)
    return True


def _child_llm(model: str, num_blocks: int | None) -> None:
    """One start of `LLM(model, num_blocks)`; prints the breakdown as one JSON line."""
    t_start = time.perf_counter()
    import importlib

    import jax
    from jax import monitoring

    import jserve

    t_import = time.perf_counter() - t_start
    times: dict[str, float] = {}
    present = {label: _wrap(importlib.import_module(mod), attr, times, label)
               for label, mod, attr in STAGES}
    phases: dict[str, list[float]] = {phase: [] for phase in PHASES.values()}
    cache = collections.Counter()
    other = collections.Counter()

    def on_duration(event: str, seconds: float, **kw: Any) -> None:
        phase = PHASES.get(event.rsplit("/", 1)[-1])
        name = kw.get("fun_name", "").removeprefix("jit(").removesuffix(")")
        if phase is None:
            return
        if name == STEP_NAME:  # warm-up lowers the buckets in order and compiles them so
            phases[phase].append(seconds)
        else:
            other[phase] += seconds

    def on_event(event: str, **_: Any) -> None:
        if event.endswith(("cache_hits", "cache_misses")):
            cache["hit" if event.endswith("hits") else "miss"] += 1

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)
    t0 = time.perf_counter()
    llm = jserve.LLM(model=model, num_blocks=num_blocks)
    t_llm = time.perf_counter() - t0
    # Steps are dispatched asynchronously: a warm-up that executes batches returns before
    # they finish, and the first request would wait for them.
    jax.block_until_ready(llm.runner.cache)
    t_drain = time.perf_counter() - t0 - t_llm
    compiles = [{"trace": trace, "lower": lower, "compile": compile_} for trace, lower, compile_
                in zip(phases["trace"], phases["lower"], phases["compile"])]
    shapes = llm.runner.buckets.shapes()
    for record, shape in zip(compiles, shapes if len(shapes) == len(compiles) else []):
        record["bucket"] = [shape]
    in_warmup = sum(c["trace"] + c["lower"] + c["compile"] for c in compiles)
    report = {
        "import": t_import, "llm_init": t_llm, "drain": t_drain,
        "in_process": time.perf_counter() - t_start,
        "stages": {label: times.get(label, 0.0) if present[label] else None
                   for label, _, _ in STAGES},
        "buckets": compiles,
        "warmup_trace_lower_compile": in_warmup,
        # Negative where warm-up overlaps lowering with compiling.
        "warmup_execute": times.get("warm-up", 0.0) - in_warmup + t_drain,
        "other_compiles": dict(other), "cache_hits": cache["hit"], "cache_misses": cache["miss"],
        "num_blocks": llm.engine.state.blocks.num_blocks,
        "compile_cache_entries": len(os.listdir(jax.config.jax_compilation_cache_dir)),
    }
    print(REPORT + json.dumps(report), flush=True)


# ----------------------------------------------------------------------------- parent
def _env(tree: pathlib.Path, cache_dir: str) -> dict[str, str]:
    env = dict(os.environ, JSERVE_COMPILE_CACHE=cache_dir, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _llm_start(args: argparse.Namespace, tree: pathlib.Path, cache_dir: str) -> dict[str, Any]:
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child-llm",
           "--model", args.model, "--num-blocks", str(args.num_blocks)]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=_env(tree, cache_dir), cwd=tree,
                                stdout=subprocess.PIPE, stderr=err, text=True)
        report = None
        for line in proc.stdout:
            if line.startswith(REPORT):
                report = json.loads(line[len(REPORT):])
                report["total"] = time.perf_counter() - t0
                report["python_start"] = report["total"] - report["in_process"]
        proc.wait()
        if report is None:
            err.seek(0)
            raise RuntimeError(f"LLM child failed (rc {proc.returncode}):\n{err.read()[-3000:]}")
    return report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def _first_answer(base: str) -> None:
    """One short greedy completion (a 3-token prompt, 8 tokens out)."""
    model = json.loads(_get(f"{base}/v1/models")[1])["data"][0]["id"]
    body = {"model": model, "prompt": "Hello there!", "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=SERVE_TIMEOUT_S) as r:
        r.read()


def _log_has(log: Any, text: str) -> bool:
    log.seek(0)
    return text in log.read()


def _serve_start(args: argparse.Namespace, tree: pathlib.Path, cache_dir: str) -> dict[str, Any]:
    """Spawn to `/health` answering, then to the first completion's answer, then (where
    the server compiles in the background) to the log line saying that has ended."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "jserve.cli", "serve", "--port", str(port), "--model", args.model,
           *shlex.split(args.serve_args)]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, env=_env(tree, cache_dir), cwd=tree,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            while _get(f"{base}/health")[0] != 200:
                if proc.poll() is not None or time.perf_counter() - t0 > SERVE_TIMEOUT_S:
                    log.seek(0)
                    raise RuntimeError(f"jserve serve never got ready:\n{log.read()[-3000:]}")
                time.sleep(0.05)
            ready = time.perf_counter() - t0
            print(f"  [{tree}] /health answered after {ready:.1f} s", flush=True)
            _first_answer(base)
            first_answer = time.perf_counter() - t0
            print(f"  [{tree}] first completion answered after {first_answer:.1f} s", flush=True)
            all_compiled = None
            # A checkout that compiles in the background says so in its log when it is done.
            if ((tree / "jserve" / "runners" / "executables.py").exists()
                    and "--no-background-compile" not in args.serve_args):
                while not _log_has(log, BACKGROUND_DONE) and proc.poll() is None:
                    time.sleep(0.5)
                all_compiled = time.perf_counter() - t0 if _log_has(log, BACKGROUND_DONE) else None
            metrics = _get(f"{base}/metrics")[1]
            rss = _rss_bytes(proc.pid)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    blocks = _gauge(metrics, "jserve_kv_blocks_total")
    return {"total": ready, "first_answer": first_answer, "all_compiled": all_compiled,
            "num_blocks": None if blocks is None else int(blocks),
            "compile_cache_entries": len(os.listdir(cache_dir)), "rss_bytes": rss}


def _rss_bytes(pid: int) -> int:
    """The process's resident memory, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


def _gauge(metrics: str, name: str) -> float | None:
    return next((float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name)), None)


def _starts(run: Any, args: argparse.Namespace, name: str,
            trees: dict[str, pathlib.Path]) -> dict[str, dict[str, Any]]:
    """Per tree, a first start on an empty private compile cache, then `repeats` second
    starts; the trees take turns, so a change in the machine's load hits them alike."""
    caches = {label: tempfile.mkdtemp(prefix=f"startup-cc-{label}-") for label in trees}
    out: dict[str, dict[str, Any]] = {label: {"second": []} for label in trees}
    try:
        for label, tree in trees.items():
            out[label]["first"] = run(args, tree, caches[label])
            _print_start(f"{name} [{label}]", "first", out[label]["first"])
        for _ in range(args.repeats):
            for label, tree in trees.items():
                out[label]["second"].append(run(args, tree, caches[label]))
                _print_start(f"{name} [{label}]", "second", out[label]["second"][-1])
    finally:
        for cache in caches.values():
            shutil.rmtree(cache, ignore_errors=True)
    for r in out.values():
        r["second_median"] = (statistics.median(s["total"] for s in r["second"])
                              if r["second"] else None)
    return out


def _print_start(name: str, which: str, r: dict[str, Any]) -> None:
    print(f"\n{name}, {which} start: ready after {r['total']:.1f} s "
          f"({r['num_blocks']} KV blocks, {r['compile_cache_entries']} compile-cache entries)")
    if r.get("rss_bytes"):
        print(f"  resident memory after the first answer: {r['rss_bytes'] / 2**30:.2f} GiB")
    if "first_answer" in r:
        print(f"  first answer after {r['first_answer']:.1f} s; every bucket compiled after "
              + (f"{r['all_compiled']:.1f} s (in the background)" if r["all_compiled"]
                 else f"{r['total']:.1f} s (before ready)"))
    if "stages" not in r:
        return
    print(f"  {'python start':38s} {r['python_start']:6.2f} s")
    print(f"  {'import jserve (jax, flax, ...)':38s} {r['import']:6.2f} s")
    stages = r["stages"]
    load_parts = ("GGUF metadata", "dequantise weights", "weights to device", "tokenizer")
    whole = stages["load_model (all of it)"]
    for label, seconds in stages.items():
        indent = "  " if label in load_parts else ""
        print(f"  {indent + label:38s} " + ("absent" if seconds is None else f"{seconds:6.2f} s"))
        if label == load_parts[-1] and whole is not None:
            build = whole - sum(stages[k] or 0 for k in load_parts)
            print(f"  {'  model build, the rest':38s} {build:6.2f} s")
    buckets = r["buckets"]
    total = {k: sum(b[k] for b in buckets) for k in ("trace", "lower", "compile")}
    print(f"  {'waiting for warm-up batches to finish':38s} {r['drain']:6.2f} s")
    print(f"  warm-up: {len(buckets)} step buckets ({r['cache_hits']} compile-cache hits, "
          f"{r['cache_misses']} misses in all): trace {total['trace']:.2f} s, lower "
          f"{total['lower']:.2f} s, compile or load {total['compile']:.2f} s (these overlap "
          f"where warm-up pipelines them); the rest, executing padding batches: "
          f"{max(0.0, r['warmup_execute']):.2f} s")
    for b in buckets:
        bucket = "x".join(map(str, b.get("bucket", ["?"])))
        print(f"    T {bucket:>10s}: trace {b['trace']:5.2f}  lower {b['lower']:5.2f}  "
              f"compile/load {b['compile']:5.2f}")
    print("  other compiles: " + ", ".join(f"{k} {v:.2f} s" for k, v in r["other_compiles"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-blocks", type=int, default=512, help="KV blocks of the LLM(...) start")
    ap.add_argument("--repeats", type=int, default=2, help="second starts of each command")
    ap.add_argument("--tree", type=pathlib.Path, default=ROOT, help="checkout the children run")
    ap.add_argument("--baseline", type=pathlib.Path,
                    help="another checkout measured alongside, turn about (before/after)")
    ap.add_argument("--only", choices=("llm", "serve"), help="measure one command")
    ap.add_argument("--serve-args", default="", help="more `jserve serve` options, one string")
    ap.add_argument("--output", default=str(ROOT / "bench" / "results" / "startup_cpu.json"))
    ap.add_argument("--child-llm", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_llm:
        _child_llm(args.model, args.num_blocks)
        return
    trees = {"this": args.tree.resolve()}
    if args.baseline:
        trees = {"baseline": args.baseline.resolve(), **trees}
    load = os.getloadavg()
    print(f"children run {', '.join(f'{k}: {v}' for k, v in trees.items())}; "
          f"load average {load[0]:.1f} on {os.cpu_count()} cpus")
    results: dict[str, Any] = {
        "date": date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        "load_average_at_start": load[0], "trees": {k: str(v) for k, v in trees.items()},
        "model": args.model, "llm_num_blocks": args.num_blocks, "goal_seconds": GOAL_S,
    }
    commands = {"llm": (_llm_start, f"LLM({args.model!r}, num_blocks={args.num_blocks})"),
                "serve": (_serve_start, "jserve serve")}
    for key, (run, name) in commands.items():
        if args.only in (None, key):
            results[key] = _starts(run, args, name, trees)
    results["load_average_at_end"] = os.getloadavg()[0]
    print()
    for key, (_, name) in commands.items():
        for label, r in results.get(key, {}).items():
            second = (f", second (median of {len(r['second'])}) {r['second_median']:6.1f} s"
                      if r["second"] else "")
            answer = (f", first answer {r['first']['first_answer']:6.1f} s"
                      if "first_answer" in r["first"] else "")
            print(f"{name + ' [' + label + ']':52s} first {r['first']['total']:6.1f} s{answer}{second}")
    if "serve" in results and args.repeats:
        seconds = results["serve"]["this"]["second_median"]
        results["goal_met"] = seconds < GOAL_S
        print(f"goal: jserve serve ready < {GOAL_S:.0f} s on a second start ........ "
              f"{seconds:.1f} s  {'PASS' if results['goal_met'] else 'MISS'}")
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
