"""Loading a multi-GB Hugging Face checkpoint: one device against four (tensor parallelism,
each parameter read straight into its shards), and four the way the runner placed weights
before (the whole model on one device, then split), side by side in one run.

A dummy Llama-shaped checkpoint (GQA, bfloat16 safetensors in 2 GiB shards, ~2.4 GB by
default) is written once; each load then runs in a fresh process (JAX fixes its device
count at start: `--xla_force_host_platform_device_count=4` for the four-device runs), which
reports the load's wall time, its peak resident memory, anonymous (arrays) and file-backed
(the memory-mapped safetensors pages it touched) apart, sampled every 5 ms from
/proc/self/status, and the bytes each device ends up holding. Forced CPU devices share one
process, so every shard counts in that process's memory: what four devices save is the
whole-model copy the old path made on the way (and, on real accelerators, each device
holds only its shard).

    python bench/load_checkpoint.py [--layers 24] [--repeats 2] [--dir /tmp/jserve-load-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from datetime import date

import numpy as np

RESULTS = pathlib.Path(__file__).with_name("results") / "load_checkpoint_cpu.json"
MODES = ("one device", "4 devices, read into shards", "4 devices, whole then split")


class _Random:
    """A parameter's worth of random values, made only when the writer asks for it."""

    def __init__(self, shape: tuple[int, ...], seed: int) -> None:
        import ml_dtypes

        self.shape, self.dtype, self.seed = shape, np.dtype(ml_dtypes.bfloat16), seed
        self.size = int(np.prod(shape))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        x = np.random.default_rng(self.seed).random(self.shape, np.float32) - 0.5
        return x.astype(self.dtype)


def write(path: pathlib.Path, layers: int) -> int:
    """The dummy checkpoint (a Llama shape between 1B and 2B parameters); its bytes."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jserve.models.config import ModelConfig
    from jserve.models.hf_checkpoint import save_checkpoint
    from jserve.models.loading import abstract_model

    cfg = ModelConfig(name="load-bench", family="llama", vocab_size=32000, hidden_size=2048,
                      num_layers=layers, num_heads=16, num_kv_heads=4, head_dim=128,
                      intermediate_size=5632, max_position=4096)
    _, shapes = nnx.split(abstract_model(cfg, jnp.bfloat16))
    leaves, treedef = jax.tree.flatten(shapes)
    state = jax.tree.unflatten(treedef, [_Random(x.shape, i) for i, x in enumerate(leaves)])
    save_checkpoint(cfg, state, path, max_shard_bytes=2 * 2**30)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _memory() -> tuple[int, int]:
    """This process's resident anonymous and file-backed bytes."""
    fields = dict(line.split(":", 1) for line in pathlib.Path("/proc/self/status").read_text().splitlines())
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile"))


def load(path: str, mode: str) -> dict:
    """One load, in this process (started by `main` with the device count it needs)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jserve.models.loading import load_model
    from jserve.runners.sharding import TensorParallel

    jax.numpy.zeros(1).block_until_ready()  # the backend up before the clock starts
    base = _memory()
    peak = list(base)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[:] = [max(p, m) for p, m in zip(peak, _memory())]

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    tp = TensorParallel.over(4) if mode != MODES[0] else None
    if mode == MODES[1]:
        model = load_model(path, dtype=jnp.bfloat16, placement=tp).model
        params = nnx.state(model)
    else:
        model = tp.prepare(load_model(path, dtype=jnp.bfloat16).model) if tp else load_model(path, dtype=jnp.bfloat16).model
        params = tp.place_params(nnx.state(model)) if tp else nnx.state(model)
        del model
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    peak = [max(p, m) for p, m in zip(peak, _memory())]
    per_device: dict[str, int] = {}
    for x in jax.tree.leaves(params):
        for shard in x.addressable_shards:
            per_device[str(shard.device.id)] = per_device.get(str(shard.device.id), 0) + shard.data.nbytes
    return dict(mode=mode, seconds=seconds, peak_anon_bytes=peak[0] - base[0],
                peak_file_bytes=peak[1] - base[1], device_bytes=per_device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (default: 24, ~2.4 GB)")
    parser.add_argument("--repeats", type=int, default=2, help="loads per mode, interleaved (default: 2)")
    parser.add_argument("--dir", default="/tmp/jserve-load-bench", help="where the checkpoint is written")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    parser.add_argument("--output", default=str(RESULTS))
    parser.add_argument("--child", nargs=2, metavar=("PATH", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(load(*args.child)))
        return 0
    path = pathlib.Path(args.dir)
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    size = write(path, args.layers)
    print(f"wrote {size / 1e9:.2f} GB of bfloat16 safetensors in {time.perf_counter() - t0:.0f}s to {path}")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        for _ in range(args.repeats):  # interleaved, so a noisy minute hits every mode alike
            for mode in MODES:
                devices = 1 if mode == MODES[0] else 4
                env = {**os.environ, "JAX_PLATFORMS": "cpu",
                       "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
                out = subprocess.run([sys.executable, __file__, "--child", str(path), mode], env=env,
                                     capture_output=True, text=True, check=True)
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)
    rows = []
    print(f"\n{'mode':<30} {'load s':>7} {'vs one':>7} {'peak anon GB':>13} {'file GB':>8} "
          f"{'max device GB':>14}")
    one = statistics.median(r["seconds"] for r in runs[MODES[0]])
    for mode in MODES:
        rs = runs[mode]
        row = dict(mode=mode, seconds=statistics.median(r["seconds"] for r in rs),
                   peak_anon_gb=max(r["peak_anon_bytes"] for r in rs) / 1e9,
                   peak_file_gb=max(r["peak_file_bytes"] for r in rs) / 1e9,
                   max_device_gb=max(rs[0]["device_bytes"].values()) / 1e9,
                   devices=len(rs[0]["device_bytes"]), runs=rs)
        rows.append(row)
        print(f"{mode:<30} {row['seconds']:>7.1f} {row['seconds'] / one:>6.2f}x {row['peak_anon_gb']:>13.2f} "
              f"{row['peak_file_gb']:>8.2f} {row['max_device_gb']:>14.2f}")
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(date=str(date.today()), machine=platform.processor() or platform.machine(),
                                   cpus=os.cpu_count(), checkpoint_bytes=size, layers=args.layers,
                                   rows=rows), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
