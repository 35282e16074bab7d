#!/usr/bin/env python
"""What penalties cost a decode step of the real runner (issue 44 item 2): a greedy step of
sequences without penalties, and one of sequences with presence, frequency and repetition
penalties, side by side on one runner (`runner.execute`, the call the engine makes per step:
host metadata, transfer, the jitted step, token read-back), the settings taking turns.

The sequences' settings reach the runner once, as the engine sends them; the timed steps
send no delta. Run it with main's checkout first on PYTHONPATH for the step without the
change (that checkout has no penalised setting: only the plain one is timed).

    python bench/penalties.py [--model smollm2-135m] [--batches 1 64] [--context 256]
                              [--repeats 20] [--output FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib

import jax
import numpy as np
from decode_step import add_decode_batch_args, decode_batch, decode_runner
from device_timing import device_name, today, turn_about_medians

import jserve
from jserve.engine.batch import Batch, BatchDelta, SequenceSettings
from jserve.models.loading import load_model
from jserve.runners.jax_runner import JaxRunner

try:
    from jserve.engine.batch import PenaltySettings
except ImportError:  # a checkout from before penalties
    PenaltySettings = None


def settings(seq_ids: np.ndarray, penalised: bool) -> SequenceSettings:
    n = len(seq_ids)
    z = np.zeros(n, np.float32)
    extra = ()
    if penalised:
        prompts = tuple(np.arange(i, i + 200, dtype=np.int32) for i in range(n))
        extra = (PenaltySettings(np.full(n, 0.5, np.float32), np.full(n, 0.5, np.float32),
                                 np.full(n, 1.2, np.float32), np.full(n, 200, np.int32), prompts),)
    return SequenceSettings(np.asarray(seq_ids, np.int64), z, np.ones(n, np.float32), np.zeros(n, np.int32),
                            np.zeros(n, np.uint32), *extra)


def held_batch(runner: JaxRunner, batch: Batch, first_id: int, penalised: bool) -> Batch:
    """`batch` under seq ids from `first_id`, its settings and tables sent to `runner` now,
    and the batch to time, which sends nothing more."""
    ids = batch.seq_ids + first_id
    x = batch.inputs
    tables = {int(s) + first_id: t for s, t in x.delta.tables.items()}
    hold = getattr(runner, "_hold", runner.held.apply)  # (main's runner has no device counts)
    hold(BatchDelta(settings(ids, penalised), tables))
    empty = BatchDelta(settings(np.zeros(0, np.int64), False), {})
    return dataclasses.replace(batch, seq_ids=ids, inputs=dataclasses.replace(x, delta=empty))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_decode_batch_args(ap, repeats=20)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    loaded = load_model(args.model)
    cfg = loaded.config
    rng = np.random.default_rng(0)
    rows = []
    for batch_size in args.batches:
        runner, num_blocks = decode_runner(loaded, batch_size, args.context, args.block_size)
        batch = decode_batch(batch_size, args.context, args.block_size, num_blocks, cfg.vocab_size, rng)
        fns = {"plain": functools.partial(runner.execute, held_batch(runner, batch, 0, False))}
        if PenaltySettings is not None:
            fns["penalties"] = functools.partial(runner.execute, held_batch(runner, batch, 10_000, True))
        seconds = turn_about_medians(fns, args.repeats)
        print(f"batch {batch_size} ({args.model}, {device_name()}): "
              + "  ".join(f"{k} {v * 1e3:.2f} ms" for k, v in seconds.items()))
        rows += [{"batch": batch_size, "setting": k, "seconds": v} for k, v in seconds.items()]
        del runner
    result = {"date": today(), "device": device_name(), "model": args.model, "context": args.context,
              "repeats": args.repeats, "jserve": str(pathlib.Path(jserve.__file__).parent),
              "load_average": os.getloadavg()[0], "jax_version": jax.__version__, "rows": rows}
    if args.output:
        pathlib.Path(args.output).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
