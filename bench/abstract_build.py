"""Building a model abstractly (`abstract_model`: shapes, no values), with a real `nnx.Rngs`
against the single key it now uses, side by side, twice each; and whether both give the
same shapes and graph. The build runs whenever a GGUF or checkpoint is loaded and whenever a
runner or the simulator needs a model's structure.

    python bench/abstract_build.py [--models smollm2-135m opt-13b]
"""

from __future__ import annotations

import argparse
import time

import jax
from flax import nnx

from jserve.models.loading import MODEL_CLASSES, abstract_model
from jserve.models.registry import get_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "opt-13b"])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    for _ in range(args.repeats):
        for name in args.models:
            cfg = get_config(name)
            t0 = time.perf_counter()
            before = nnx.eval_shape(lambda cfg=cfg: MODEL_CLASSES[cfg.family](cfg, rngs=nnx.Rngs(0)))
            t1 = time.perf_counter()
            after = abstract_model(cfg)
            t2 = time.perf_counter()
            same = all(jax.tree.leaves(jax.tree.map(
                lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype), nnx.state(before), nnx.state(after))))
            print(f"{name}: nnx.Rngs {t1 - t0:.2f} s, one key {t2 - t1:.2f} s, "
                  f"same shapes {same}, same graph {nnx.graphdef(before) == nnx.graphdef(after)}")


if __name__ == "__main__":
    main()
