"""The engine's host work per decode step on the JAX runner, the device's step taken out:
every engine step plans, builds the batch and the step's inputs, and reads the previous
step's tokens as it does when serving, but the compiled step is replaced by one that hands
back its first real outputs at once. This checkout against another, turn about, each in
fresh processes, so a change to the host side (issue 42's persistent batch) is measured
apart from the device's time, which on a loaded 2-core CPU swamps it.

    python bench/host_step.py --baseline DIR [--batches 32,128] [--rounds 3]

DIR is another checkout with `jserve/models` and `jserve/pallas_kernels` linked to its
`models/` and `pallas_kernels/` (see bench/step_python.py). Only the public engine and the
runner's `_executable` are touched, so both trees run the same measurement.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 200


def measure(batch: int) -> float:
    """Median microseconds of `Engine.step()` over `STEPS` decode steps of `batch` requests."""
    from decoding_engine import PROMPT, decoding_engine

    built = decoding_engine("tiny-llama", batch, PROMPT + STEPS + 64)
    runner = built.engine.runner
    engine = built.engine
    real = runner._executable
    outputs = {}

    def stub(x):
        """The step of `x`'s bucket run once for real, then its outputs handed back (called
        with whatever arguments the tree's step takes)."""
        key, exe = x.batch.token_ids.shape, real(x)

        def step(*args):
            if key not in outputs:
                outputs[key] = exe(*args)
            return outputs[key]
        return step

    runner._executable = stub
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=pathlib.Path, required=True)
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(measure(args.child))
        return 0
    trees = {"baseline": args.baseline.resolve(), "this": ROOT}
    print(f"engine host work per decode step, tiny-llama, device step stubbed; best of {args.rounds} "
          "rounds (each the median of 200 steps), turn about")
    print(f"{'batch':>6} {'baseline us':>12} {'this us':>9} {'this/baseline':>14}")
    for batch in map(int, args.batches.split(",")):
        best = {k: float("inf") for k in trees}
        for _ in range(args.rounds):
            for label, tree in trees.items():
                env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
                out = subprocess.run([sys.executable, __file__, "--child", str(batch), "--baseline", str(tree)],
                                     env=env, cwd=tree, capture_output=True, text=True, check=True)
                best[label] = min(best[label], float(out.stdout.strip().splitlines()[-1]))
        print(f"{batch:>6} {best['baseline']:>12.0f} {best['this']:>9.0f} {best['this'] / best['baseline']:>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
