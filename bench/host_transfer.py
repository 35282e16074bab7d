#!/usr/bin/env python
"""Host <-> device transfer rates through `jax.device_put` with memory kinds, beside the
`pcie_bandwidth` the simulator's hardware table (jserve/runners/hardware.py) assumes.

The engine swaps K/V out by gathering blocks into one buffer and `device_put`-ting it to a
host memory kind (`pinned_host`), and back (see pallas_kernels/block_copy.py). This times
exactly those two moves on random data of several sizes (median of `--repeats` after
warm-up, outputs ready), one direction at a time, and prints GB/s (1e9 bytes/s) next to the
table's figure for this device. The whole buffer crosses the link once per transfer, so
bytes = buffer size.

    python bench/host_transfer.py [--sizes-mib 16 256 1024] [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
from device_timing import device_name, median_seconds, random_like, results_tag, today

from jserve.runners.hardware import HARDWARE

RESULTS = pathlib.Path(__file__).parent / "results"


def table_entry() -> str | None:
    """The hardware-table entry for this device, by its kind (None if none matches)."""
    d = jax.devices()[0]
    kind = getattr(d, "device_kind", "").lower()
    for name in ("h200", "h100", "l20"):
        if name in kind:
            return name
    if "a100" in kind:
        limit = (d.memory_stats() or {}).get("bytes_limit", 0)
        return "a100-80g" if limit > 48 * 2**30 else "a100-40g"
    return None


def sharding(kind: str) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def host_kinds() -> list[str]:
    """Host memory kinds this device can address (pinned first)."""
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    return [k for k in ("pinned_host", "unpinned_host") if k in kinds]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 256, 1024])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--output", default=None,
                    help="JSON path (default: bench/results/host_transfer_<device>.json)")
    args = ap.parse_args()
    entry = table_entry()
    table_bps = HARDWARE[entry].pcie_bandwidth if entry else None
    kinds = host_kinds()
    print(f"{device_name()}: host memory kinds {kinds}; hardware table entry {entry!r}"
          + (f", pcie_bandwidth {table_bps / 1e9:.0f} GB/s" if table_bps else ""), flush=True)
    rows = []
    for kind in kinds:
        for mib in args.sizes_mib:
            x = random_like((mib * 2**20 // 2,), "bfloat16", seed=mib)
            jax.block_until_ready(x)
            on_host = jax.device_put(x, sharding(kind))
            jax.block_until_ready(on_host)
            assert on_host.sharding.memory_kind == kind
            back = jax.device_put(on_host, sharding("device"))
            assert bool((back == x).all()), "round trip changed the data"
            out_s = median_seconds(lambda: jax.device_put(x, sharding(kind)), repeats=args.repeats)
            in_s = median_seconds(lambda: jax.device_put(on_host, sharding("device")),
                                  repeats=args.repeats)
            for direction, t in (("device->host", out_s), ("host->device", in_s)):
                bps = x.nbytes / t
                rows.append(dict(memory_kind=kind, direction=direction, bytes=x.nbytes,
                                 seconds=t, bytes_per_s=bps,
                                 fraction_of_table=bps / table_bps if table_bps else None))
                print(f"  {kind:<14} {direction:<13} {mib:>6} MiB  {t * 1e3:9.3f} ms  "
                      f"{bps / 1e9:7.1f} GB/s"
                      + (f"  ({bps / table_bps:.2f}x the table's {table_bps / 1e9:.0f} GB/s)"
                         if table_bps else ""), flush=True)
            del on_host, back, x
    if not kinds:
        print("  this backend has no host memory kind; nothing to time")
    out = pathlib.Path(args.output or RESULTS / f"host_transfer_{results_tag()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": device_name(), "date": today(), "jax_version": jax.__version__,
        "hardware_entry": entry, "table_pcie_bytes_per_s": table_bps, "rows": rows,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
