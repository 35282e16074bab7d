#!/usr/bin/env python
"""Resident memory of `jserve serve`, broken down (issue 30 item 2): weights, KV cache,
host KV pool, compiling, and the rest.

The server runs in a child with its defaults (plus `--serve-args`), with the functions that
do each stage wrapped so the child records its resident set (VmRSS) before and after each:
loading the model (weights), the runner's set-up (the KV cache, and the LayerKV host pool
where the policy has one), the warm-up (compiling the step buckets into an empty compile
cache, as on a first start; in the foreground, `--no-background-compile`, so that all of
compiling's growth falls inside the warm-up: a background warm-up ends with the same steps). The parent waits
for `/health`, sends `--requests` completions (greedy and sampled, concurrently), and reads
the child's VmRSS and its peak (VmHWM) from /proc at ready and after the requests. "Other"
is what the stages do not account for: Python, the imports, the server, and what serving
the requests added. Arrays' own sizes (weights and KV nbytes, host pool nbytes) are printed
beside the RSS deltas, which also count allocator and mapping slack.

    python bench/footprint.py [--model smollm2-135m] [--serve-args "..."] [--requests 16]
                              [--tree DIR] [--baseline DIR] [--output FILE]

`--baseline DIR` measures another checkout too (e.g. `git archive REV` unpacked in DIR).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import date
from typing import Any

from startup import _env, _free_port, _get

ROOT = pathlib.Path(__file__).resolve().parents[1]
REPORT = "FOOTPRINT-STAGE "
GiB = 2**30
# (label, module, attribute): the stages whose RSS deltas are charged to a component.
STAGES = [
    ("weights", "jserve.builder", "load_model"),
    ("runner set-up (KV cache, host pool)", "jserve.runners.jax_runner", "JaxRunner.__init__"),
    ("compile (warm-up)", "jserve.runners.jax_runner", "JaxRunner.warmup"),
]


def rss(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, VmHWM (peak), RssAnon and RssFile of a process, in bytes."""
    out = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


# ------------------------------------------------------------------------------ child
def _child(argv: list[str]) -> None:
    """`jserve serve` in this process, each stage reporting its RSS before and after."""
    import importlib

    import jax
    from flax import nnx

    from jserve import cli

    def report(record: dict[str, Any]) -> None:
        print(REPORT + json.dumps(record), flush=True)

    report({"stage": "start", "rss": rss()["VmRSS"]})
    for label, mod, attr in STAGES:
        module = importlib.import_module(mod)
        owner_name, _, name = attr.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        fn = getattr(owner, name)

        def staged(*args: Any, _fn=fn, _label=label, **kwargs: Any) -> Any:
            before = rss()["VmRSS"]
            out = _fn(*args, **kwargs)
            jax.effects_barrier()
            record = {"stage": _label, "before": before, "after": rss()["VmRSS"]}
            if _label == "weights":
                record["nbytes"] = sum(x.nbytes for x in jax.tree.leaves(nnx.state(out.model)))
            elif _label.startswith("runner"):
                runner = args[0]
                record["kv_nbytes"] = runner.cache.k.nbytes + runner.cache.v.nbytes
                pools = [f.pool for f in getattr(runner, "features", ()) if getattr(f, "pool", None)]
                record["host_pool_nbytes"] = sum(x.nbytes for pool in pools for x in pool.k + pool.v)
            report(record)
            return out

        setattr(owner, name, staged)
    cli.main(["serve", *argv])


# ----------------------------------------------------------------------------- parent
def _complete(base: str, model: str, i: int) -> None:
    body = {"model": model, "prompt": f"Request {i}: tell me about memory.", "max_tokens": 32}
    if i % 2:
        body["temperature"] = 1.0
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def measure(tree: pathlib.Path, args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    # Compiling in the foreground, so the warm-up's RSS growth is all of compiling's.
    foreground = ["--no-background-compile"] if (tree / "jserve/runners/executables.py").exists() else []
    argv = ["--port", str(port), "--model", args.model, *foreground, *shlex.split(args.serve_args)]
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", *argv]
    stages: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="footprint-cc-") as cache, \
            tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, env=_env(tree, cache), cwd=tree, stdout=subprocess.PIPE,
                                stderr=log, text=True)
        try:
            t0 = time.perf_counter()
            while _get(f"{base}/health")[0] != 200:
                if proc.poll() is not None or time.perf_counter() - t0 > 3600:
                    log.seek(0)
                    raise RuntimeError(f"server never got ready:\n{log.read()[-3000:]}")
                time.sleep(0.1)
            ready = rss(proc.pid)
            models = json.loads(_get(f"{base}/v1/models")[1])["data"]
            with concurrent.futures.ThreadPoolExecutor(max(1, args.requests)) as pool:
                list(pool.map(lambda i: _complete(base, models[0]["id"], i), range(args.requests)))
            served = rss(proc.pid)
        finally:
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=120)
    for line in out.splitlines():  # warm-up runs twice in a server (LLM's, then serve's)
        if line.startswith(REPORT):
            record = json.loads(line[len(REPORT):])
            label = record.pop("stage")
            if "before" in record:
                record["delta"] = record["after"] - record["before"]
                record["delta"] += stages.get(label, {}).get("delta", 0)
            stages[label] = record
    return {"ready": ready, "served": served, "stages": stages}


def breakdown(m: dict[str, Any]) -> dict[str, int]:
    """Bytes per component, summing to the RSS after serving."""
    s = m["stages"]
    delta = {label: s.get(label, {}).get("delta", 0) for label, _, _ in STAGES}
    runner = s["runner set-up (KV cache, host pool)"]
    host_pool = min(runner["host_pool_nbytes"], delta["runner set-up (KV cache, host pool)"])
    parts = {
        "weights": delta["weights"],
        "KV cache": delta["runner set-up (KV cache, host pool)"] - host_pool,
        "host pool": host_pool,
        "compile": delta["compile (warm-up)"],
    }
    parts["other"] = m["served"]["VmRSS"] - sum(parts.values())
    return parts


def _print(label: str, m: dict[str, Any]) -> None:
    s = m["stages"]
    parts = breakdown(m)
    runner = s["runner set-up (KV cache, host pool)"]
    sizes = {"weights": s["weights"].get("nbytes"), "KV cache": runner["kv_nbytes"],
             "host pool": runner["host_pool_nbytes"]}
    print(f"\n[{label}] resident at ready {m['ready']['VmRSS'] / GiB:.2f} GiB, after serving "
          f"{m['served']['VmRSS'] / GiB:.2f} GiB (peak {m['served']['VmHWM'] / GiB:.2f} GiB; "
          f"anonymous {m['served']['RssAnon'] / GiB:.2f}, file-backed {m['served']['RssFile'] / GiB:.2f})")
    for name, b in parts.items():
        size = f"   (arrays {sizes[name] / GiB:.2f} GiB)" if sizes.get(name) is not None else ""
        print(f"  {name:10s} {b / GiB:6.2f} GiB{size}")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--serve-args", default="", help="more `jserve serve` options, one string")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tree", type=pathlib.Path, default=ROOT)
    ap.add_argument("--baseline", type=pathlib.Path)
    ap.add_argument("--output", default=str(ROOT / "bench" / "results" / "footprint_cpu.json"))
    args = ap.parse_args()
    trees = {"this": args.tree.resolve()}
    if args.baseline:
        trees = {"baseline": args.baseline.resolve(), **trees}
    results: dict[str, Any] = {
        "date": date.today().isoformat(), "model": args.model, "serve_args": args.serve_args,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        "trees": {k: str(v) for k, v in trees.items()}, "runs": {},
    }
    for label, tree in trees.items():
        m = measure(tree, args)
        m["breakdown"] = breakdown(m)
        results["runs"][label] = m
        _print(label, m)
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
