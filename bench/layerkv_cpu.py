#!/usr/bin/env python
"""LayerKV against vLLM on the real engine on this CPU: one long-prompt trace on SmolLM2
with a KV cache small enough that prompts queue behind each other under `vllm`, run under
`vllm` and `layerkv`, printed side by side (mean and P99 TTFT, mean TPOT, partly offloaded
prefills, layer blocks moved each way), and the host transfer rate LayerKV's layer copies
achieved beside a plain `jax.device_put` of the same bytes to the same host memory kind.

The layer copies are timed by wrapping, in this script only, the runner's layer copy paths
(`LayerSteps.after_compute`, `before_moves`, `after_moves` and `LayerHostPool.flush`),
each waited on until its copies are done; bytes = layer blocks moved to and from the host
x K and V x one layer's block (the per-layer jit dispatches and the padded gathers/scatters
included; the copies are compiled, and the host pool mapped, before the run starts).
Device -> device slot copies (`LayerBatch.copies`) run inside the same paths: their blocks are
counted apart, and their time is in the copy time.

LayerKV's Eq. 3-4 costs come from `--profile` (default: the committed CPU profile of
SmolLM2); `--no-profile` runs it without one (prefills estimated at 0 s: the SLO gate then
only closes once a decoding request is already past its TPOT SLO).

    python bench/layerkv_cpu.py [--quick] [--no-profile] [--tpot-slo 0.2]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import time

import jax
from device_timing import median_seconds, random_like, today

from jserve.benchmarking.bench import BenchConfig, run_benchmark
from jserve.benchmarking.tables import markdown_head, markdown_row
from jserve.config import EngineConfig
from jserve.cache.host_memory import memory_shardings
from jserve.cache_features.layer_offload.batch import layer_work
from jserve.cache_features.layer_offload.host_pool import LayerHostPool
from jserve.cache_features.layer_offload.steps import LayerSteps
from jserve.runners.jax_runner import JaxRunner

RESULTS = pathlib.Path(__file__).parent / "results"
MODEL = "smollm2-135m"
PROFILE = RESULTS / "profile_smollm2-135m_cpu.json"
POLICIES = ("vllm", "layerkv")


class LayerCopyMeter:
    """Counts and times the real runner's layer moves by wrapping its copy paths (class
    attributes, restored by `close`)."""

    def __init__(self) -> None:
        self.reset()
        self._saved = {}
        for cls, name in ((JaxRunner, "execute"), (LayerSteps, "after_compute"),
                          (LayerSteps, "before_moves"), (LayerSteps, "after_moves"),
                          (LayerHostPool, "flush")):
            self._saved[(cls, name)] = getattr(cls, name)
            setattr(cls, name, self._wrap(name, getattr(cls, name)))

    def reset(self) -> None:
        self.offloaded_prefills: set[int] = set()
        self.blocks_to_host = self.blocks_to_device = self.blocks_copied = 0
        self.copy_seconds = 0.0
        self.block_bytes = 0

    def close(self) -> None:
        for (cls, name), fn in self._saved.items():
            setattr(cls, name, fn)

    def _wrap(self, name: str, fn):
        meter = self

        def counted(runner: JaxRunner, batch):
            meter._count(runner, batch)
            return fn(runner, batch)

        def timed(obj, *args):
            t0 = time.perf_counter()
            out = fn(obj, *args)
            pool = obj.pool if isinstance(obj, LayerSteps) else obj
            pending = [p[2:] for p in pool._pending]
            jax.block_until_ready([x for x in jax.tree.leaves((out, pending, args))
                                   if isinstance(x, jax.Array)])
            meter.copy_seconds += time.perf_counter() - t0
            return out

        return counted if name == "execute" else timed

    def _count(self, runner: JaxRunner, batch) -> None:
        steps = [f for f in runner.features if isinstance(f, LayerSteps)]
        if not steps:
            return
        k = steps[0].pool.k[0]
        self.block_bytes = 2 * k[0].nbytes  # one layer's block, K and V
        work = layer_work(batch)
        for i, t in work.tables.items():
            self.offloaded_prefills.add(int(batch.seq_ids[i]))
            self.blocks_to_host += sum(len(h) for h in t.host)
        self.blocks_to_host += sum(len(m.src) for m in work.to_host)
        self.blocks_to_device += sum(len(m.src) for m in work.to_device)
        self.blocks_copied += sum(len(m.src) for m in work.copies)


def plain_device_put(nbytes: int) -> dict:
    """The same bytes in one array, `device_put` to the host memory kind the pool uses and
    back (median of 5)."""
    x = random_like((max(1, nbytes // 4),), "float32", seed=1)
    host, dev = memory_shardings()
    if host is None:
        return {"memory_kind": None}
    on_host = jax.block_until_ready(jax.device_put(x, host))
    out_s = median_seconds(lambda: jax.device_put(x, host), repeats=5)
    in_s = median_seconds(lambda: jax.device_put(on_host, dev), repeats=5)
    return {"memory_kind": host.memory_kind, "bytes": x.nbytes,
            "to_host_bytes_per_s": x.nbytes / out_s, "to_device_bytes_per_s": x.nbytes / in_s}


def run(policy: str, args, meter: LayerCopyMeter) -> dict:
    engine = EngineConfig(runner="real", model=MODEL, policy=policy, num_blocks=args.num_blocks,
                          max_model_len=args.prompt_len + args.output_len,
                          max_num_batched_tokens=args.prompt_len + args.output_len,
                          swap_space=args.swap_space, profile=args.profile)
    cfg = BenchConfig(engine, workload=f"fixed:{args.prompt_len}:{args.output_len}", rate=args.rate,
                      num_requests=args.num_requests, seed=0, tbt_slo=args.tpot_slo,
                      tbt_slo_on="tpot", predictions="oracle")
    meter.reset()
    result = run_benchmark(cfg, progress=False)
    s = result.summary
    moved = (meter.blocks_to_host + meter.blocks_to_device) * meter.block_bytes
    return {
        "policy": policy, "ttft_mean": s.ttft_mean, "ttft_p99": s.ttft_p99, "tpot_mean": s.tpot_mean,
        "finished": s.num_finished, "requests": s.num_requests, "steps": result.num_steps,
        "preemptions": result.num_preemptions, "wall_s": result.wall_time,
        "offloaded_prefills": len(meter.offloaded_prefills),
        "layer_blocks_to_host": meter.blocks_to_host, "layer_blocks_to_device": meter.blocks_to_device,
        "layer_blocks_copied_on_device": meter.blocks_copied, "layer_block_bytes": meter.block_bytes,
        "host_bytes_moved": moved, "layer_copy_seconds": meter.copy_seconds,
        "layer_copy_bytes_per_s": moved / meter.copy_seconds if meter.copy_seconds else None,
    }


def table(rows: dict[str, dict], put: dict) -> list[str]:
    v, l = rows["vllm"], rows["layerkv"]

    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "-"

    out = markdown_head(["", "vllm", "layerkv", "vllm / layerkv"])
    for label, key in (("mean TTFT (s)", "ttft_mean"), ("P99 TTFT (s)", "ttft_p99"),
                       ("mean TPOT (s)", "tpot_mean")):
        out.append(markdown_row([label, f"{v[key]:.3f}", f"{l[key]:.3f}", ratio(v[key], l[key])]))
    for label, key in (("partly offloaded prefills", "offloaded_prefills"),
                       ("layer blocks to host", "layer_blocks_to_host"),
                       ("layer blocks to device", "layer_blocks_to_device"),
                       ("layer blocks copied on device", "layer_blocks_copied_on_device"),
                       ("steps", "steps"), ("preemptions", "preemptions"), ("finished", "finished")):
        out.append(markdown_row([label, v[key], l[key], ""]))
    out.append("")
    if l["layer_copy_bytes_per_s"]:
        out.append(f"LayerKV's layer copies: {l['host_bytes_moved'] / 1e6:.1f} MB to and from host in "
                   f"{l['layer_copy_seconds'] * 1e3:.1f} ms = {l['layer_copy_bytes_per_s'] / 1e9:.2f} GB/s; "
                   f"plain device_put of the same bytes to {put['memory_kind']}: "
                   f"{put['to_host_bytes_per_s'] / 1e9:.2f} GB/s out, "
                   f"{put['to_device_bytes_per_s'] / 1e9:.2f} GB/s back "
                   f"(layer copies / plain out: {l['layer_copy_bytes_per_s'] / put['to_host_bytes_per_s']:.2f}x)")
    else:
        out.append("LayerKV moved no layer to or from the host: no transfer rate to report.")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="6 requests of 512 tokens (about a minute)")
    ap.add_argument("--num-requests", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s (Poisson)")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="device KV blocks (default: room for two requests at once)")
    ap.add_argument("--swap-space", type=float, default=0.5, help="GiB of host memory for offloaded layers")
    ap.add_argument("--tpot-slo", type=float, default=None,
                    help="each request's TPOT SLO in seconds (LayerKV's gate; default none: the gate is open)")
    ap.add_argument("--profile", default=str(PROFILE) if PROFILE.exists() else None)
    ap.add_argument("--no-profile", dest="profile", action="store_const", const=None)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    if args.profile is not None:
        args.profile = os.path.relpath(args.profile)
    if args.quick:
        args.num_requests, args.prompt_len = 6, 512
    per_request = -(-(args.prompt_len + args.output_len) // 16)
    args.num_blocks = args.num_blocks or 2 * per_request + 4
    print(f"{MODEL} on {platform.processor() or platform.machine()} ({os.cpu_count()} cpus): "
          f"{args.num_requests} x fixed:{args.prompt_len}:{args.output_len} at {args.rate:g} req/s, "
          f"{args.num_blocks} device blocks ({per_request} per request), swap {args.swap_space} GiB, "
          f"TPOT SLO {args.tpot_slo}, profile {args.profile}", flush=True)
    meter = LayerCopyMeter()
    try:
        rows = {p: run(p, args, meter) for p in POLICIES}
    finally:
        meter.close()
    put = plain_device_put(rows["layerkv"]["host_bytes_moved"] or 2**20)
    lines = table(rows, put)
    print("\n".join(lines))
    out = pathlib.Path(args.output or RESULTS / f"layerkv_cpu{'_quick' if args.quick else ''}.json")
    out.write_text(json.dumps({
        "date": today(), "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        "jax_version": jax.__version__, "config": {k: v for k, v in vars(args).items() if k != "output"},
        "runs": rows, "plain_device_put": put,
    }, indent=1))
    out.with_suffix(".md").write_text(
        f"# LayerKV vs vLLM on the real engine, {MODEL} on CPU ({today()})\n\n"
        f"`python bench/layerkv_cpu.py{' --quick' if args.quick else ''}`: {args.num_requests} requests "
        f"of {args.prompt_len} prompt and {args.output_len} output tokens at {args.rate:g} req/s, "
        f"{args.num_blocks} device blocks of 16 tokens, profile `{args.profile}`, TPOT SLO {args.tpot_slo}.\n\n"
        + "\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
