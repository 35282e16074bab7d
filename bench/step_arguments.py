"""What a jitted call pays per argument: numpy arrays (converted on each call) against arrays
already on the device, for 1, 25 and 60 small int32 arguments. The reason the JAX runner
sends a step's two dozen host inputs packed in one buffer (`jserve/runners/packed_inputs.py`).

    python bench/step_arguments.py [--counts 1,25,60] [--calls 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np


def per_call_us(n: int, on_device: bool, calls: int, rounds: int) -> float:
    """Best of `rounds` mean wall times of a jitted call taking `n` [32] int32 arrays."""
    f = jax.jit(lambda *a: sum(x[0] for x in a))
    args = [np.arange(32, dtype=np.int32) + i for i in range(n)]
    if on_device:
        args = [jax.device_put(a) for a in args]
    f(*args).block_until_ready()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="1,25,60")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"backend {jax.default_backend()}; us per call")
    print(f"{'arguments':>9} {'numpy':>7} {'device':>7} {'numpy - device, per argument':>29}")
    for n in map(int, args.counts.split(",")):
        host = per_call_us(n, False, args.calls, args.rounds)
        device = per_call_us(n, True, args.calls, args.rounds)
        print(f"{n:>9} {host:>7.0f} {device:>7.0f} {(host - device) / n:>29.1f}")


if __name__ == "__main__":
    main()
