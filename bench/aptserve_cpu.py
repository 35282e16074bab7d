#!/usr/bin/env python
"""Apt-Serve's hidden cache on the real engine on this CPU: the memory it saves on a
multi-head-attention model and the step time it costs, beside the prediction the policy
decides from (Eq. 6: rho per hidden block, here from `jserve profile`'s hidden-cache
measurement on this machine).

OPT-125m's shape (MHA: hidden size = K/V width, 768) with dummy weights in fp32, blocks of
16 tokens, so a block holds 32 tokens of hidden rows (K page, then V page). For each
context length C, a decode step of S sequences of C cached tokens is timed on the JAX runner
with every sequence on the KV cache and with every one on the hidden cache (its K/V
recomputed from the rows of all C + 1 positions in every layer); the memory is the blocks
each needs times one block's bytes. The prediction: the KV step + rho x the hidden blocks in
the batch (rho = the fitted seconds per hidden row x 32, no /5) -- what the policy's
penalty assumes a hidden request adds to a step.

    python bench/aptserve_cpu.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
from typing import cast

import numpy as np
from device_timing import median_seconds, today

from jserve.builder import build_engine
from jserve.cache.sizing import block_bytes, hidden_block_tokens
from jserve.config import EngineConfig
from jserve.runners.jax_runner import JaxRunner
from jserve.runners.profiling import _batch, measure_hidden_projection

RESULTS = pathlib.Path(__file__).parent / "results"
MODEL, BLOCK = "opt-125m", 16
SEQS = 8
CONTEXTS = (128, 512, 1024)
QUICK_CONTEXTS = (128, 512)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two context lengths, fewer repeats")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    contexts = QUICK_CONTEXTS if args.quick else CONTEXTS
    repeats = args.repeats or (3 if args.quick else 7)
    longest = max(contexts) + 1
    blocks = SEQS * -(-longest // BLOCK) + 8
    built = build_engine(EngineConfig(model=MODEL, weights="dummy", dtype="float32", block_size=BLOCK,
                                      num_blocks=blocks, max_model_len=2048, max_num_seqs=SEQS, warmup=False))
    runner, cfg = cast(JaxRunner, built.runner), built.model_config
    per_hidden_block = hidden_block_tokens(cfg, BLOCK)
    bytes_per_block = block_bytes(cfg, BLOCK, 4)
    profile = measure_hidden_projection(cfg, np.float32, repeats=repeats)
    rho = profile.block_cost(per_hidden_block)
    rows = []
    print(f"{MODEL} (dummy weights, fp32) on {platform.processor() or platform.machine()}: {SEQS} sequences decoding; "
          f"a block: {BLOCK} KV tokens or {per_hidden_block} hidden rows, {bytes_per_block / 2**10:.0f} KiB; "
          f"rho = {rho * 1e3:.3f} ms per hidden block ({profile.per_row * 1e6:.2f} us per row)")
    print(f"{'context':>8} {'KV MiB':>8} {'hidden MiB':>10} {'saved':>6} {'KV step ms':>11} {'hidden step ms':>15} "
          f"{'extra ms':>9} {'predicted extra ms':>19} {'measured/predicted':>19}")
    for c in contexts:
        starts, q = [c] * SEQS, [1] * SEQS
        kv, hid = _batch(starts, q, BLOCK), _batch(starts, q, BLOCK, per_hidden_block)
        t_kv = median_seconds(lambda: runner.execute(kv), repeats=repeats)
        t_hid = median_seconds(lambda: runner.execute(hid), repeats=repeats)
        kv_blocks = sum(len(t) for _, t in kv.inputs.delta.tables.values())
        hid_blocks = sum(len(t) for _, t in hid.inputs.delta.tables.values())
        predicted = rho * hid_blocks
        row = {"context": c, "seqs": SEQS, "kv_blocks": kv_blocks, "hidden_blocks": hid_blocks,
               "kv_mib": kv_blocks * bytes_per_block / 2**20, "hidden_mib": hid_blocks * bytes_per_block / 2**20,
               "memory_saved": 1 - hid_blocks / kv_blocks, "kv_step_s": t_kv, "hidden_step_s": t_hid,
               "extra_s": t_hid - t_kv, "predicted_extra_s": predicted,
               "measured_over_predicted": (t_hid - t_kv) / predicted}
        rows.append(row)
        print(f"{c:>8} {row['kv_mib']:>8.1f} {row['hidden_mib']:>10.1f} {row['memory_saved']:>6.0%} "
              f"{t_kv * 1e3:>11.1f} {t_hid * 1e3:>15.1f} {row['extra_s'] * 1e3:>9.1f} {predicted * 1e3:>19.1f} "
              f"{row['measured_over_predicted']:>19.2f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("aptserve_cpu_quick.json" if args.quick else "aptserve_cpu.json")
    out.write_text(json.dumps({"date": today(), "model": MODEL, "weights": "dummy", "dtype": "float32",
                               "block_size": BLOCK, "hidden_block_tokens": per_hidden_block,
                               "rho_s_per_hidden_block": rho, "hidden_profile": profile.to_dict(),
                               "repeats": repeats, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
