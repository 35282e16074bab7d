"""Python per decode step on the JAX runner's host side: padding a 64-sequence decode batch
into the step's inputs (`build_step_inputs`) and flattening them as the jit call does,
this checkout against another, turn about, in one run (issue 29: the model's step moved to
`jserve.models.functional`, which must not add host work per step).

    python bench/step_python.py --baseline DIR [--rounds 4]

DIR is another checkout (e.g. `git archive REV | tar -x -C DIR`, with `jserve/models` and
`jserve/pallas_kernels` linked to its `models/` and `pallas_kernels/` so its own are
imported). Each round runs both in fresh processes; the figure is the best of each.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQS, BLOCK, CALLS = 64, 16, 2000


def measure() -> float:
    """Microseconds per step, best of 5 batches of `CALLS`."""
    import jax
    import numpy as np

    from jserve.engine.batch import Batch, BatchDelta, BatchInputs
    from jserve.engine.view import SchedulerLimits
    from jserve.runners.input_batch import PersistentBatch
    from jserve.runners.jax_runner import Buckets, build_step_inputs

    n = SEQS
    buckets = Buckets.for_limits(SchedulerLimits(256, 2048, 2048), BLOCK)
    rng = np.random.default_rng(0)
    tables = [rng.permutation(2000)[:64].astype(np.int32) for _ in range(n)]
    inputs = BatchInputs(token_ids=np.ones(n, np.int32), output_index=np.zeros(n, np.int32),
                         delta=BatchDelta.of_sequences(range(n), tables))
    held = PersistentBatch.holding(inputs.delta, buckets.max_blocks_per_seq, 5000)
    batch = Batch(seq_ids=np.arange(n), start=np.full(n, 500, np.int32), query_lens=np.ones(n, np.int32),
                  sample=np.ones(n, bool), inputs=inputs)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            jax.tree.flatten(build_step_inputs(batch, buckets, BLOCK, held, True))
        best = min(best, (time.perf_counter() - t0) / CALLS * 1e6)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=pathlib.Path, required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(measure())
        return 0
    trees = {"baseline": args.baseline.resolve(), "this": ROOT}
    best = {k: float("inf") for k in trees}
    for _ in range(args.rounds):
        for label, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
            out = subprocess.run([sys.executable, __file__, "--child", "--baseline", str(tree)], env=env,
                                 cwd=tree, capture_output=True, text=True, check=True)
            best[label] = min(best[label], float(out.stdout.strip().splitlines()[-1]))
    print(f"host Python per {SEQS}-sequence decode step (build inputs + flatten), best of "
          f"{args.rounds} rounds: baseline {best['baseline']:.0f} us, this {best['this']:.0f} us "
          f"({best['this'] / best['baseline']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
